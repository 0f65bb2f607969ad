"""The expert's GEMMs through cuBLAS or through our kernels, per GEMM family and batch size, and
prompt buckets at every batch size, measured in one run (issue 14).

    python3 bench/expert_gemms.py [--out DIR]

Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 workload.
1. The denoise graph (10 Euler steps) at batch 1, 2, 4, 8 with each subset of the four expert
   GEMM families {qkv, o, gate_up, down} through cuBLAS (F.linear; then our RoPE / GeGLU /
   residual-norm kernels on its bf16 output: the rounding points of our fused kernels) and the
   rest through ours (split-K / fused epilogues); actions against the fp32 eager model.
2. Full calls (prefix + denoise graphs, committed defaults) at each batch size with the prompt
   padded to the checkpoint's 200 tokens and to buckets of 96 and 72 tokens (70 valid tokens),
   against the fp32 eager model on the 200-token prompt.
JSON under bench/results/ (expert_gemms.json) and --out.
"""

from __future__ import annotations

import copy
import itertools
import json
import time

from bench_gpu import bucketed, eager, log, maxdiff
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise, timed_call

from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.graphs import FastRunner

BUCKETS = (96, 72)


def main():
    args, results, save = bench_run("expert_gemms")
    started = time.time()
    cfg, model, policy_config, fast, bufs, calls = denoise_setup()
    model32 = copy.deepcopy(model).float()
    refs32 = {b: eager(model32, *calls[b]) for b in BATCHES}
    refs16 = {b: eager(model, *calls[b]) for b in BATCHES}
    log(f"built ({time.time() - started:.0f}s)")

    # 1. Each subset of the GEMM families through cuBLAS (from batch 1: this batch), then the defaults.
    committed = copy.deepcopy(kernels.TUNING["cublas_from_batch"])
    results["denoise_ms"], results["vs_fp32"], results["best"] = {}, {}, {}
    for b in BATCHES:
        rows = {}
        for n in range(len(kernels.EXPERT_GEMMS) + 1):
            for subset in itertools.combinations(kernels.EXPERT_GEMMS, n):
                kernels.TUNING["cublas_from_batch"] = {family: 1 for family in subset}
                t, out = time_denoise(fast, bufs[b])
                rows["+".join(subset) or "none"] = t
                results["vs_fp32"][f"b{b}:{'+'.join(subset) or 'none'}"] = maxdiff(out, refs32[b])
        kernels.TUNING["cublas_from_batch"] = copy.deepcopy(committed)
        t, _ = time_denoise(fast, bufs[b])
        rows["committed"] = t
        results["denoise_ms"][b] = rows
        best = min(rows, key=rows.get)
        results["best"][b] = {"cublas": best, "ms": rows[best], "committed_ms": t}
        log(f"b={b}: committed {t:.3f} ms, none {rows['none']:.3f}, all {rows['+'.join(kernels.EXPERT_GEMMS)]:.3f}, "
            f"best {best} {rows[best]:.3f}")
        save()

    # 2. Full calls: the checkpoint's prompt length against buckets.
    runner = FastRunner(model, policy_config)
    results["calls"] = {}
    for b in BATCHES:
        inputs, noise = calls[b]
        row = {}
        for length in (inputs.tokens.shape[1], *BUCKETS):
            x = bucketed(inputs, length)
            out, row[length] = timed_call(runner, x, noise, refs32[b])
            row[length]["vs_eager_bf16"] = maxdiff(out, refs16[b])
        log(f"call b={b}:", json.dumps(row))
        results["calls"][b] = row
        save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
