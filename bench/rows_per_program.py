"""Rows per program for the expert's small row-wise kernels: the attention's log-sum-exp merge (issue 14;
run 64 also swept the residual + AdaRMS norm kernel, in commit 245f2c0: one row per program won).

    python3 bench/rows_per_program.py [--out DIR]

Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 workload. The denoise
graph (10 Euler steps) at batch 1, 2, 4, 8 with each family's kernels.TUNING entry at each candidate
(rows per program, warps; the other families at their committed configs). Candidates are timed in
turn, twice over (the faster of the two counts: graphs of the same kernels differ by up to
~0.05 ms at batch 1); each one's actions against the committed config's (the same sums per row, in
another order at most). JSON under bench/results/ (rows_per_program.json) and --out.
"""

from __future__ import annotations

import copy
import time

from bench_gpu import log, maxdiff
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise

from vlaserve.runtime.fast import kernels

CANDIDATES = {  # family -> (rows, warps)
    "merge": [(1, 4), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)],
}


def main():
    args, results, save = bench_run("rows_per_program")
    started = time.time()
    _, _, _, fast, bufs, _ = denoise_setup()
    committed = {family: copy.deepcopy(kernels.TUNING[family]) for family in CANDIDATES}
    results["committed"] = committed
    for family, candidates in CANDIDATES.items():
        out = results[family] = {"denoise_ms": {}, "vs_committed": {}, "best": {}}
        for b in BATCHES:
            _, reference = time_denoise(fast, bufs[b])
            times = {c: [] for c in candidates}
            for _ in range(2):
                for rows, warps in candidates:
                    kernels.TUNING[family] = {"rows": rows, "warps": warps}
                    t, actions = time_denoise(fast, bufs[b])
                    times[(rows, warps)].append(t)
                    out["vs_committed"][f"b{b}:{rows}x{warps}"] = maxdiff(actions, reference)
            kernels.TUNING[family] = copy.deepcopy(committed[family])
            row = {f"{rows}x{warps}": min(ts) for (rows, warps), ts in times.items()}
            out["denoise_ms"][b] = row
            best = min(row, key=row.get)
            own = f"{committed[family]['rows']}x{committed[family]['warps']}"
            out["best"][b] = {"config": best, "ms": row[best], "committed_ms": row[own]}
            log(f"{family} b={b}: {row} best {best}")
            save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
