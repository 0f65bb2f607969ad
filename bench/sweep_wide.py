"""Launch configs that tune_batches.py never tried, at batch 8 (issue 14, run 121 on).

tune_batches.py (run 42) swept the batched split-K o/down GEMM over 128- and 256-row tiles only,
and the expert attention over 64-key tiles only. At batch 8 the GEMM has 400 rows: 128-row tiles
compute 512 (28% of them padding) and split K in two, with fp32 partials through HBM; 64-row tiles
compute 448 with no split. This sweeps, in the denoise graph, each family with everything else at
the committed defaults:
- split-K o/down: 64 / 128-row tiles x 32 / 64 / 128 columns x 64 / 128-deep K x 4 / 8 warps x
  one or two waves of programs,
- the expert attention: 64 / 128 queries x 1 / 2 / 4 / 8 key splits x 32 / 64 keys x 4 / 8 warps,

then full calls with each batch's best against the defaults, with the accuracy lines.

    python3 bench/sweep_wide.py [--out DIR]

Full-size Pi0.5, random weights, bench_gpu.py's ALOHA-3 workload. JSON under bench/results/
(sweep_wide.json) and --out. A launch config never changes what is computed: every candidate's
actions are compared with the default's (bf16 reassociation at most).
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import log  # noqa: E402
from kernel_ladder import bench_run, denoise_setup, time_denoise  # noqa: E402
from tune_batches import HORIZON, compare_calls, sweep  # noqa: E402

from vlaserve.runtime.fast import kernels  # noqa: E402

BATCHES = (8,)  # issue 14's target


def splitk_candidates() -> list:
    return [dict(block_r=r, block_n=n, block_k=k, max_waves=waves, warps=w, stages=4)
            for r, n, k, w, waves in itertools.product((64, 128), (32, 64, 128), (64, 128), (4, 8), (1, 2))
            if not (r == 128 and n == 128 and w == 4)]


def attention_candidates() -> list:
    return [dict(block_m=m, splits=s, block_t=t, warps=w, stages=2)
            for m, s, t, w in itertools.product((64, 128), (1, 2, 4, 8), (32, 64), (4, 8)) if not (m == 128 and w == 4)]


def main():
    args, results, save = bench_run("sweep_wide")
    results["committed"] = copy.deepcopy(kernels.TUNING)
    started = time.time()
    cfg, model, policy_config, fast, bufs, _ = denoise_setup()
    defaults = copy.deepcopy(kernels.TUNING)
    results["sweeps"], best = {}, {}
    for b in BATCHES:
        default_ms, default_out = time_denoise(fast, bufs[b])
        best[b] = {}
        committed = copy.deepcopy(kernels.batched_config(b * HORIZON))

        def apply_splitk(c, b=b):
            kernels.TUNING["batched"] = {1: {**committed, "splitk": c}}
        best[b]["splitk"], rows = sweep(f"splitk b{b}", [committed["splitk"]] + splitk_candidates(), apply_splitk,
                                        lambda b=b: time_denoise(fast, bufs[b]), default_out, default_ms)
        results["sweeps"][f"splitk_b{b}"] = {"default_ms": default_ms, "rows": rows}
        kernels.TUNING["batched"] = copy.deepcopy(defaults["batched"])
        save()

        def apply_attention(c, b=b):
            kernels.TUNING["attention_batched"] = {**defaults["attention_batched"], b: c}
        best[b]["attention"], rows = sweep(f"attention b{b}", [kernels.attention_config(b)] + attention_candidates(),
                                           apply_attention, lambda b=b: time_denoise(fast, bufs[b]), default_out,
                                           default_ms)
        results["sweeps"][f"attention_b{b}"] = {"default_ms": default_ms, "rows": rows}
        kernels.TUNING["attention_batched"] = copy.deepcopy(defaults["attention_batched"])
        save()
        for name, entry in results["sweeps"].items():
            if name.endswith(f"b{b}"):
                log(f"{name} top 5:", json.dumps([(round(r["ms"], 3), r["config"]) for r in entry["rows"][:5]]))

    def best_tiles(b: int) -> None:
        table = copy.deepcopy(kernels.batched_config(b * HORIZON))
        kernels.TUNING["batched"] = {1: {**table, "splitk": best[b]["splitk"]}}
        kernels.TUNING["attention_batched"] = {**defaults["attention_batched"], b: best[b]["attention"]}

    compare_calls(model, policy_config, BATCHES, defaults, {"best": best_tiles}, results, save)
    results["best"] = best
    results["elapsed_s"] = time.time() - started
    save()
    log(f"done in {results['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
