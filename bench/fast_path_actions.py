"""The fast path's actions and times at full size on one GPU, with the runtime's API of whichever
source tree is first on sys.path: run it once per tree and compare the saved actions bitwise.

    PYTHONPATH=OLD/src python3 bench/fast_path_actions.py before.pt
    PYTHONPATH=src python3 bench/fast_path_actions.py after.pt --compare before.pt

Random full-size weights (seed 0), the ALOHA-3 inputs of bench_gpu.py (seeded), batch 1, 2, 4, 8.
The inputs are drawn here, as bench_gpu.make_inputs draws them, rather than imported from it:
bench_gpu imports the current tree's API, which an older tree on sys.path does not have.
"""

from __future__ import annotations

import statistics
import sys

import torch

CAMERAS, TOKENS, VALID_TOKENS, HORIZON, STEPS = 3, 200, 70, 50, 10


def build():
    try:  # the restructured runtime
        from vlaserve.checkpoint.weights import random_model
        from vlaserve.config import ModelConfig, PolicyConfig
        from vlaserve.runtime.fast.graphs import FastRunner
        from vlaserve.types import ModelInputs

        cfg = ModelConfig.full_size()
        model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
        policy_config = PolicyConfig(cfg, ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), 14, 14)
        return model, FastRunner(model, policy_config), ModelInputs
    except ImportError:  # before it
        from vlaserve.config import ModelConfig
        from vlaserve.engine.graphs import CudaGraphEngine
        from vlaserve.policy import ModelInputs
        from vlaserve.weights import random_model

        cfg = ModelConfig.full_size()
        model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
        return model, CudaGraphEngine(model, CAMERAS, TOKENS, HORIZON), ModelInputs


def main() -> None:
    model, runner, ModelInputs = build()
    vocab = model.config.vlm.vocab_size
    out, times = {}, {}
    for b in (1, 2, 4, 8):
        g = torch.Generator(device="cuda").manual_seed(b)
        images = torch.rand(b, CAMERAS, 3, 224, 224, device="cuda", generator=g) * 2 - 1
        masks = torch.ones(b, CAMERAS, dtype=torch.bool, device="cuda")
        tokens = torch.randint(3, vocab, (b, TOKENS), device="cuda", generator=g)
        token_mask = torch.zeros(b, TOKENS, dtype=torch.bool, device="cuda")
        token_mask[:, :VALID_TOKENS] = True
        tokens[~token_mask] = 0
        noise = torch.randn(b, HORIZON, 32, device="cuda", generator=g)
        inputs = ModelInputs(images, masks, tokens, token_mask)
        out[b] = runner.sample(inputs, noise, STEPS, None)[0].cpu()
        runs = []
        for i in range(23):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.sample(inputs, noise, STEPS, None)
            end.record()
            end.synchronize()
            if i >= 3:
                runs.append(start.elapsed_time(end))
        times[b] = statistics.median(runs)
        print(f"b={b}: p50 {times[b]:.2f} ms", flush=True)
    torch.save({"actions": out, "p50_ms": times}, sys.argv[1])
    if "--compare" in sys.argv:
        before = torch.load(sys.argv[sys.argv.index("--compare") + 1])
        for b in out:
            same = torch.equal(out[b], before["actions"][b])
            print(f"b={b}: bit-identical to before: {same}; p50 before {before['p50_ms'][b]:.2f} ms, "
                  f"now {times[b]:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
