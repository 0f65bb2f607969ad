"""bf16 error against fp32 over many inputs: ours (the fast path, with each attention library) and
LeRobot 0.6.1's own (issue 14's accuracy target, as a distribution rather than one draw).

    python3 bench/bf16_error.py [--fa4] [--out DIR]      (needs the wheels of bench/prepare_device.sh;
                                                          --fa4 also bench/prepare_cute.sh's libraries)

Full-size Pi0.5 (random weights), bench_gpu.py's ALOHA-3 inputs drawn from seeds 1..16 at batch 1 and
1..8 at batch 8 (1..4 until run 82). For each call: max|Δ| of the actions against our fp32 eager model (which equals
LeRobot's fp32 to ~1e-6, bench_gpu.py) for LeRobot's bf16 and for our fast path at the default prompt
bucket: with our Triton attention, and with --fa4 also with `attention_library="fa4"` (run 130; until
run 84 the variants were the attention merge at 1 and 2 queries per program, 2 being the served one).
One call's max over 50 x 32 actions moves by ~10% between inputs (runs 55-65), so the comparison is
the mean (and max) over calls, per item at batch 8.
JSON under bench/results/ (bf16_error.json) and --out.
"""

from __future__ import annotations

import statistics
import time

from bench_gpu import (STEPS, build_lerobot, bucketed, default_bucket, eager, lerobot_sample, log, make_inputs,
                       per_item_max)
from kernel_ladder import bench_run, full_size_models

from vlaserve.runtime.fast.graphs import FastRunner

SEEDS = {1: range(1, 17), 8: range(1, 9)}


def main():
    args, results, save = bench_run("bf16_error", {"fa4": "also the fast path with attention_library='fa4'"})
    started = time.time()
    cfg, model, model32, policy_config = full_size_models()
    lerobot = build_lerobot(model, "bfloat16")
    bucket = default_bucket()
    libraries = ("triton", "fa4") if args.fa4 else ("triton",)
    runners = {lib: FastRunner(model, policy_config, attention_library=lib) for lib in libraries}
    log(f"built ({time.time() - started:.0f}s)")
    results["per_call"] = {}
    for b, seeds in SEEDS.items():
        rows_out = []
        for seed in seeds:
            inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=100 * b + seed)
            ref = eager(model32, inputs, noise)
            row = {"seed": seed, "lerobot_bf16": per_item_max(lerobot_sample(lerobot, inputs, noise), ref)}
            for lib, runner in runners.items():
                out, _ = runner.sample(bucketed(inputs, bucket), noise, STEPS, None)
                row[f"ours_{lib}"] = per_item_max(out, ref)
            rows_out.append(row)
        results["per_call"][b] = rows_out
        names = [k for k in rows_out[0] if k != "seed"]
        results.setdefault("summary", {})[b] = {
            name: {"mean": statistics.mean(r[name] for r in rows_out), "max": max(r[name] for r in rows_out),
                   "calls": len(rows_out)} for name in names}
        log(f"b={b}:", {n: {k: round(v, 5) for k, v in s.items()} for n, s in results["summary"][b].items()})
        save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
