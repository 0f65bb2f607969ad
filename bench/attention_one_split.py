"""Probe: the expert's attention at batch 1 in one key split, no merge kernel (issue 14, run 136).

Runs 132-135 (persistent_cuda.py) found that at batch 1 each dependent kernel of the expert costs
~4 us of synchronization and latency before its bandwidth counts, so a layer-step's kernels, not
its bytes, set the time. The attention is two of them: 16 key splits (7 query tiles x 16 = 112
programs, fp32 partials of 6.5 MB a layer) and a merge. With one split and small query tiles
(16 or 32 of the 400 query rows a program: 25 or 13 programs, each over all ~914 keys) there is no
merge and no partial, at the price of fewer programs and each reading every K/V tile. Run 63/71's
b1 sweep (tune_batches.py) tried 2-16 splits only.

Denoise graph at batch 1 (10 Euler steps), p50 ms, for each one-split config against the
committed one; then full calls (a fresh graphed FastRunner) committed vs the fastest row, with
max|Δ| vs fp32 and eager bf16's own error.

    python3 bench/attention_one_split.py [--out DIR]
"""

from __future__ import annotations

import copy
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import log  # noqa: E402
from kernel_ladder import bench_run, denoise_setup, time_denoise  # noqa: E402
from tune_batches import compare_calls, sweep  # noqa: E402

from vlaserve.runtime.fast import kernels  # noqa: E402


def candidates() -> list:
    return [dict(block_m=m, splits=1, block_t=t, warps=w, stages=s)
            for m, t, w, s in itertools.product((16, 32, 64), (32, 64), (2, 4, 8), (2, 3)) if not (m == 16 and w == 8)]


def main():
    args, results, save = bench_run("attention_one_split")
    started = time.time()
    _, model, policy_config, fast, bufs, _ = denoise_setup()
    defaults = copy.deepcopy(kernels.TUNING)
    results["committed"] = defaults["attention"]
    default_ms, default_out = time_denoise(fast, bufs[1])

    def apply(c):
        kernels.TUNING["attention"] = c
    best, rows = sweep("attention b1, one split", [defaults["attention"]] + candidates(), apply,
                       lambda: time_denoise(fast, bufs[1]), default_out, default_ms)
    kernels.TUNING["attention"] = copy.deepcopy(defaults["attention"])
    results["denoise_b1"] = {"committed_ms": default_ms, "rows": rows}
    log("top 8:", [(round(r["ms"], 3), r["config"]) for r in rows[:8]])
    save()
    compare_calls(model, policy_config, (1,), defaults,
                  {"fastest": lambda _b: kernels.TUNING.update(attention=copy.deepcopy(best))}, results, save)
    results["elapsed_s"] = time.time() - started
    save()
    log(f"done in {results['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
