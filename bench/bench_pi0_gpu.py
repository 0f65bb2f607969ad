"""Pi0 on the GPU: the fast path against our eager model and LeRobot 0.6.1's PI0Policy, one run.

Full-size Pi0 with random weights (bf16 + the fp32 set), 3 cameras 224x224, prompts of 48 tokens (20
valid) -> 816 prefix tokens + the state token, chunk 50x32, 10 steps; batch 1, 2, 4, 8. Checks first
(max|Δ| against float32 on the same weights, for ours and LeRobot's bf16), then CUDA-event times.

    python bench/bench_pi0_gpu.py [--lerobot] [--batches 1,2,4,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gpu import lerobot_policy, log, maxdiff, per_item_max, random_prefix_inputs, time_cuda  # noqa: E402
from vlaserve.config import ModelConfig, PolicyConfig  # noqa: E402
from vlaserve.model.pi0 import Pi0Model  # noqa: E402
from vlaserve.checkpoint.weights import PI0_LAYOUT  # noqa: E402
from vlaserve.types import ModelInputs  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

CAMERAS, TOKENS, VALID_TOKENS, HORIZON, STEPS, STATE = 3, 48, 20, 50, 10, 32


def random_pi0(dtype: torch.dtype) -> Pi0Model:
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        model = Pi0Model(ModelConfig.full_size(), max_state_dim=STATE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02, generator=gen)
            if name.startswith("vision.") and name.endswith("layernorm.weight"):
                p.add_(1.0)
            if not PI0_LAYOUT.fp32.search(name):
                p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def make_inputs(b: int, vocab: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    images, masks, tokens, token_mask = random_prefix_inputs(g, b, vocab, CAMERAS, TOKENS, VALID_TOKENS)
    state = torch.zeros(b, STATE, device="cuda")
    state[:, :14] = torch.rand(b, 14, device="cuda", generator=g) * 2 - 1
    noise = torch.randn(b, HORIZON, 32, device="cuda", generator=g)
    return ModelInputs(images, masks, tokens, token_mask, state), noise


def eager(model, x, noise):
    with torch.no_grad():
        return model.sample(x.images, x.image_masks, x.tokens, x.token_mask, x.state, noise, STEPS)


def build_lerobot(model: Pi0Model, dtype: str):
    """LeRobot 0.6.1's PI0Policy holding exactly our weights."""
    from lerobot.policies.pi0.configuration_pi0 import PI0Config
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy

    return lerobot_policy(PI0Policy, PI0Config, {PI0_LAYOUT.to_lerobot(n): p for n, p in model.named_parameters()},
                          dtype, ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in",
                                  "action_time_mlp_out"))


def lerobot_sample(policy, x, noise):
    with torch.no_grad():
        return policy.model.sample_actions([x.images[:, i] for i in range(CAMERAS)],
                                           [x.image_masks[:, i] for i in range(CAMERAS)],
                                           x.tokens, x.token_mask, x.state, noise=noise)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lerobot", action="store_true")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [int(b) for b in args.batches.split(",")]
    started = time.time()
    model = random_pi0(torch.bfloat16)
    model32 = copy.deepcopy(model).float()
    config = PolicyConfig(model.config, ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), 14, 14,
                          max_token_len=TOKENS)
    fast = FastRunner(model, config)
    vocab = model.config.vlm.vocab_size
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "workload": {
        "cameras": CAMERAS, "tokens": TOKENS, "valid_tokens": VALID_TOKENS, "horizon": HORIZON, "steps": STEPS},
        "timings": {}, "accuracy": {}}
    lerobot = None
    if args.lerobot:
        try:
            lerobot = (build_lerobot(model, "bfloat16"), build_lerobot(model32, "float32"))
        except Exception as e:  # noqa: BLE001 - the rest of the run stays useful
            results["lerobot_error"] = f"{type(e).__name__}: {e}"
            log("lerobot:", results["lerobot_error"])
    for b in batches:
        x, noise = make_inputs(b, vocab, seed=b)
        ref32 = eager(model32, x, noise)
        ours_fast = fast.sample(x, noise, STEPS)[0]
        acc = {"fast_vs_fp32": maxdiff(ours_fast, ref32), "fast_vs_fp32_mean_item_max": per_item_max(ours_fast, ref32),
               "eager_bf16_vs_fp32": maxdiff(eager(model, x, noise), ref32),
               "fast_repeat_bit_identical": bool(torch.equal(ours_fast, fast.sample(x, noise, STEPS)[0]))}
        t = {"fast": time_cuda(lambda: fast.sample(x, noise, STEPS)),
             "eager_bf16": time_cuda(lambda: eager(model, x, noise), warmup=2, iters=5)}
        if lerobot is not None:
            l16, l32 = lerobot_sample(lerobot[0], x, noise), lerobot_sample(lerobot[1], x, noise)
            acc.update({"lerobot_bf16_vs_fp32": maxdiff(l16, l32), "ours_fp32_vs_lerobot_fp32": maxdiff(ref32, l32),
                        "lerobot_bf16_vs_fp32_mean_item_max": per_item_max(l16, l32)})
            t["lerobot_bf16"] = time_cuda(lambda: lerobot_sample(lerobot[0], x, noise), warmup=2, iters=5)
        results["timings"][b], results["accuracy"][b] = t, acc
        log(f"b={b}:", json.dumps({k: round(v["p50_ms"], 2) for k, v in t.items()}),
            json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in acc.items()}))
    results["elapsed_s"] = time.time() - started
    for d in filter(None, [ROOT / "bench" / "results", Path(args.out) if args.out else None]):
        d.mkdir(parents=True, exist_ok=True)
        (d / "bench_pi0_gpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
