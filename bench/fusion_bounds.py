"""How much fusing the expert's small kernels away could buy at most (issue 14), measured.

    python3 bench/fusion_bounds.py [--out DIR]

The denoise graph (full size, ALOHA-3 inputs, batch 1, 2, 4, 8), as committed, against the same
graph with kernels skipped: the residual + AdaRMS norm after each split-K GEMM (the GEMMs' partial
sums still computed; the next kernel reads h unnormalized), the attention's log-sum-exp merge (the
split kernel still runs), or both. The skipped variants compute wrong actions on purpose; only their
time counts. No fusion of those kernels into their neighbours can save more than the time they
take here, so this bounds, for example, moving the norm into the split-K GEMM's last K-split program
and the next GEMM's prologue. JSON under bench/results/ (fusion_bounds.json) and --out.
"""

from __future__ import annotations

import json
import time

from bench_gpu import log
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise

from vlaserve.runtime.fast import kernels


class _Skipped:
    """Stands in for a Triton kernel: launching it does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _without_norm(x2d, w, h2d, gate, scale1p, shift, eps):
    kernels.splitk_partials(x2d, w)
    return h2d


def main():
    _, results, save = bench_run("fusion_bounds")
    started = time.time()
    _, _, _, fast, bufs, _ = denoise_setup()
    log(f"built ({time.time() - started:.0f}s)")
    committed_norm, committed_merge = kernels.linear_residual_norm, kernels._mqa_merge
    variants = {"committed": (committed_norm, committed_merge), "no_norms": (_without_norm, committed_merge),
                "no_merges": (committed_norm, _Skipped()), "neither": (_without_norm, _Skipped())}
    results["denoise_ms"] = {}
    for name, (norm, merge) in variants.items():
        kernels.linear_residual_norm, kernels._mqa_merge = norm, merge
        results["denoise_ms"][name] = {b: time_denoise(fast, bufs[b])[0] for b in BATCHES}
        log(name, json.dumps({b: round(t, 3) for b, t in results["denoise_ms"][name].items()}))
        save()
    kernels.linear_residual_norm, kernels._mqa_merge = committed_norm, committed_merge
    base = results["denoise_ms"]["committed"]
    results["at_most_saved_ms"] = {name: {b: base[b] - t[b] for b in BATCHES}
                                   for name, t in results["denoise_ms"].items() if name != "committed"}
    log("at most saved:", json.dumps(results["at_most_saved_ms"]))
    save()


if __name__ == "__main__":
    main()
