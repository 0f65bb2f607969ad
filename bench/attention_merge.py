"""The expert attention's log-sum-exp merge with several queries per program (issue 14).

    python3 bench/attention_merge.py [--out DIR]

Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 workload. The denoise
graph (10 Euler steps) at batch 1, 2, 4, 8 with kernels.TUNING["merge"] at each candidate (queries
per program, warps); the candidates are timed in turn, twice over (the faster of the two counts:
graphs of the same kernels differ by up to ~0.05 ms at batch 1), and each one's actions are compared
with the committed config's (the same sums per query, so equal up to the order of a split sum).
JSON under bench/results/ (attention_merge.json) and --out.
"""

from __future__ import annotations

import copy
import time

from bench_gpu import log, maxdiff
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise

from vlaserve.runtime.fast import kernels

CANDIDATES = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)]  # (rows, warps)


def main():
    args, results, save = bench_run("attention_merge")
    started = time.time()
    _, _, _, fast, bufs, _ = denoise_setup()
    committed = copy.deepcopy(kernels.TUNING["merge"])
    results["committed"], results["denoise_ms"], results["vs_committed"], results["best"] = committed, {}, {}, {}
    for b in BATCHES:
        _, reference = time_denoise(fast, bufs[b])
        times = {c: [] for c in CANDIDATES}
        for _ in range(2):
            for rows, warps in CANDIDATES:
                kernels.TUNING["merge"] = {"rows": rows, "warps": warps}
                t, out = time_denoise(fast, bufs[b])
                times[(rows, warps)].append(t)
                results["vs_committed"][f"b{b}:{rows}x{warps}"] = maxdiff(out, reference)
        kernels.TUNING["merge"] = copy.deepcopy(committed)
        row = {f"{rows}x{warps}": min(ts) for (rows, warps), ts in times.items()}
        results["denoise_ms"][b] = row
        best = min(row, key=row.get)
        results["best"][b] = {"config": best, "ms": row[best], "committed_ms": row[f"{committed['rows']}x{committed['warps']}"]}
        log(f"b={b}: {row} best {best}")
        save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
