"""bf16 error against fp32 over many inputs: ours (the fast path, with each attention library) and
LeRobot 0.6.1's own (issue 14's accuracy target, as a distribution rather than one draw).

Full-size Pi0.5 (random weights), bench_gpu.py's ALOHA-3 inputs drawn from seeds 1..16 at batch 1 and
1..8 at batch 8. For each call: max|Δ| of the actions against our fp32 eager model (which equals
LeRobot's fp32 to ~1e-6, bench_gpu.py) for LeRobot's bf16 and for our fast path at the default prompt
bucket: with our Triton attention, and with --fa4 also with `attention_library="fa4"`. One call's max
over 50 x 32 actions moves by ~10% between inputs, so the comparison is the mean (and max) over calls,
per item at batch 8. Writes bf16_error.json.

    python bench/bf16_error.py [--fa4] [--out DIR]   (LeRobot: bench/prepare_device.sh's wheels;
                                                       --fa4: the `cute` extra, bench/prepare_cute.sh)
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import time

import torch

from bench_gpu import build_lerobot, bucketed, default_bucket, eager, lerobot_sample
from common import bench_model, log, make_inputs, parser, per_item_max, sample, save_json
from vlaserve.runtime.runner import EagerRunner

SEEDS = {1: range(1, 17), 8: range(1, 9)}
SMOKE_SEEDS = {1: range(1, 3), 2: range(1, 2)}


def main():
    ap = parser(__doc__)
    ap.add_argument("--fa4", action="store_true", help="also the fast path with attention_library='fa4'")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    started = time.time()
    model, policy_config = bench_model(args.smoke, device)
    model32 = copy.deepcopy(model).float()
    vocab = model.config.vlm.vocab_size
    results: dict = {"device": device, "torch": torch.__version__, "smoke": args.smoke}
    lerobot = None
    if not args.smoke or importlib.util.find_spec("lerobot") is not None:  # the real run needs it
        lerobot = build_lerobot(model, "bfloat16", device)
    results["lerobot"] = lerobot is not None
    bucket = default_bucket()
    if device == "cuda":
        from vlaserve.runtime.graphs import FastRunner

        libraries = ("triton", "fa4") if args.fa4 else ("triton",)
        runners = {lib: FastRunner(model, policy_config, attention_library=lib) for lib in libraries}
    else:  # --smoke: the eager runner stands in for the CUDA fast path
        runners = {"eager_runner": EagerRunner(model, torch.device(device))}
    log(f"built ({time.time() - started:.0f}s)")
    results["per_call"] = {}
    for b, seeds in (SMOKE_SEEDS if args.smoke else SEEDS).items():
        rows_out = []
        for seed in seeds:
            inputs, noise = make_inputs(b, vocab, seed=100 * b + seed, device=device)
            ref = eager(model32, inputs, noise)
            row = {"seed": seed}
            if lerobot is not None:
                row["lerobot_bf16"] = per_item_max(lerobot_sample(lerobot, inputs, noise), ref)
            for lib, runner in runners.items():
                out, _ = sample(runner, bucketed(inputs, bucket), noise)
                row[f"ours_{lib}"] = per_item_max(out, ref)
            rows_out.append(row)
        results["per_call"][b] = rows_out
        names = [k for k in rows_out[0] if k != "seed"]
        results.setdefault("summary", {})[b] = {
            name: {"mean": statistics.mean(r[name] for r in rows_out), "max": max(r[name] for r in rows_out),
                   "calls": len(rows_out)} for name in names}
        log(f"b={b}:", {n: {k: round(v, 5) for k, v in s.items()} for n, s in results["summary"][b].items()})
        save_json(results, args.out, "bf16_error")
    results["elapsed_s"] = time.time() - started
    save_json(results, args.out, "bf16_error")


if __name__ == "__main__":
    main()
