"""Prompt buckets at full size (issue 14): what they cost at startup and what they buy per call.

    python3 bench/prompt_buckets.py [--out DIR]

Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 workload (3 cameras,
prompts of 70 valid tokens, the checkpoint's 200-token length). For each bucket set: a FastRunner
warmed up as the server does (batch sizes 1-8, every camera layout, with and without RTC, every
prompt length of the set and 200): seconds, graphs captured, device memory reserved by its buffers
and graph pool. Then, frozen, calls at batch 1, 2, 4, 8 padded to the set's smallest bucket that
holds 70 tokens (as the preprocessor pads): p50, graph use (no call may run uncaptured), and
max|Δ| of the actions against the fp32 eager model on the 200-token prompt over 4 seeds (their max
and mean: one seed's max is a noisy draw). JSON under bench/results/ (prompt_buckets.json) and --out.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench_gpu import STEPS, VALID_TOKENS, bucketed, eager, log, make_inputs, maxdiff, time_cuda
from kernel_ladder import BATCHES, bench_run, full_size_models

from vlaserve.config import prompt_lengths
from vlaserve.runtime.fast.graphs import FastRunner

BUCKET_SETS = ((), (96,), (48, 96), (64, 128))
SEEDS = (11, 12, 13, 14)


def main():
    args, results, save = bench_run("prompt_buckets")
    started = time.time()
    cfg, model, model32, policy_config = full_size_models()
    calls = {(b, s): make_inputs(b, cfg.vlm.vocab_size, seed=s) for b in BATCHES for s in SEEDS}
    refs = {key: eager(model32, *call) for key, call in calls.items()}
    del model32
    torch.cuda.empty_cache()
    log(f"built ({time.time() - started:.0f}s)")
    results["sets"] = {}
    for buckets in BUCKET_SETS:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        runner = FastRunner(model, policy_config)
        runner.warmup(tuple(range(1, 9)), STEPS, prompt_lengths(buckets, policy_config.max_token_len))
        torch.cuda.synchronize()
        row = {"warmup_s": time.perf_counter() - t0, "graphs": runner.captures,
               "reserved_gib": (torch.cuda.memory_reserved() - reserved) / 2**30, "calls": {}}
        length = min([b for b in buckets if b >= VALID_TOKENS], default=policy_config.max_token_len)
        for b in BATCHES:
            errors = []
            for s in SEEDS:
                inputs, noise = calls[(b, s)]
                out, _ = runner.sample(bucketed(inputs, length), noise, STEPS, None)
                errors.append(maxdiff(out, refs[(b, s)]))
            inputs, noise = calls[(b, SEEDS[0])]
            x = bucketed(inputs, length)
            row["calls"][b] = {"length": length, "p50_ms": time_cuda(lambda r=runner: r.sample(x, noise, STEPS, None))["p50_ms"],
                               "vs_fp32_max": max(errors), "vs_fp32_mean": statistics.mean(errors)}
        row["uncaptured_calls"], row["captures_after_warmup"] = runner.uncaptured_calls, runner.captures - row["graphs"]
        results["sets"][",".join(map(str, buckets)) or "none"] = row
        log(",".join(map(str, buckets)) or "none", json.dumps(row))
        save()
        del runner
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
