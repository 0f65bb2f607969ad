"""The expert's GEMM kernels asking L2 for the next GEMM's weights as they start (issue 14; run 80).

    python3 bench/l2_prefetch.py [--out DIR]

The denoise graph (10 Euler steps) of full-size Pi0.5 at batch 1, 2, 4 and 8 (bench_gpu.py's
ALOHA-3 workload, 200 tokens), with `kernels.TUNING["prefetch"]` off and on: ms p50, and the
actions of the two (a prefetch only moves bytes into L2 sooner: 0.0 expected). Then the same
with the attention's scores in log2 units (run 79's "exp2"). JSON under bench/results/
(l2_prefetch.json) and --out.
"""

from __future__ import annotations

import copy
import time

from bench_gpu import log, maxdiff
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise

from vlaserve.runtime.fast import kernels


def main():
    args, results, save = bench_run("l2_prefetch")
    started = time.time()
    _, _, _, fast, bufs, _ = denoise_setup()
    committed = {key: copy.deepcopy(kernels.TUNING[key]) for key in ("attention", "attention_batched", "prefetch")}
    results["denoise"] = {}
    for b in BATCHES:
        row = results["denoise"][b] = {}
        reference = None
        for exp2 in (False, True):
            if exp2:
                kernels.TUNING["attention"] = {**kernels.TUNING["attention"], "exp2": True}
                kernels.TUNING["attention_batched"] = {s: {**c, "exp2": True}
                                                       for s, c in kernels.TUNING["attention_batched"].items()}
            outs = {}
            for prefetch in (False, True):
                kernels.TUNING["prefetch"] = prefetch
                ms, outs[prefetch] = time_denoise(fast, bufs[b])
                reference = outs[prefetch] if reference is None else reference
                row[f"{'exp2_' if exp2 else ''}prefetch_{'on' if prefetch else 'off'}"] = {
                    "ms": ms, "vs_committed": maxdiff(outs[prefetch], reference)}
            row[f"{'exp2_' if exp2 else ''}on_vs_off"] = maxdiff(outs[True], outs[False])
            kernels.TUNING.update(copy.deepcopy(committed))
        log(f"denoise b{b}: {row}")
        save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
