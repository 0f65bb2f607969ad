"""K splits reduced in the GEMM's last program, for the expert's qkv + RoPE and gate_up + GeGLU
(issue 14, runs 119-120): what they buy at batch 1 and 2, in the denoise graph.

At batch 1 these two kernels give each program a whole K of 1024: 80 (qkv) and 128 (gate_up)
programs stream the layer's weights at well under the HBM rate. With `splits` > 1 in their
kernels.TUNING entry, each tile's K is split over that many programs, which write fp32 partials;
the last to arrive sums them in split order (bit-reproducible) and runs the epilogue (RoPE and the
cache scatter, or the GeGLU), so no second kernel is needed. This sweeps splits and tiles for each
family at batch 1 and 2 (at 4 and 8 both run through cuBLAS), then times full calls with the best
against the committed defaults, with the accuracy lines.

    python3 bench/split_reduce.py [--out DIR]

Full-size Pi0.5, random weights, bench_gpu.py's ALOHA-3 workload. JSON under bench/results/
(split_reduce.json) and --out. Every candidate's actions are checked against the default's, and a
second replay of each graph against the first (bit-identical, or the reduction is not deterministic).
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import STEPS, eager, log, make_inputs, maxdiff, time_cuda  # noqa: E402
from kernel_ladder import bench_run, denoise_graph, denoise_setup  # noqa: E402

from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

BATCHES = (1, 2)


def measure(fast, buf) -> tuple[float, torch.Tensor, bool]:
    graph, out = denoise_graph(fast, buf)
    t = time_cuda(graph.replay, warmup=3, iters=30)["p50_ms"]
    graph.replay()
    first = out.clone()
    graph.replay()
    repeat = bool(torch.equal(first, out))
    del graph, out
    torch.cuda.empty_cache()
    return t, first, repeat


def candidates(family: str, committed: dict, b: int) -> list:
    widths = (16, 32) if b == 1 else (16, 32, 64)
    rows = [dict(committed, splits=s, block_n=n, block_k=k)
            for s, n, k in itertools.product((1, 2, 4), widths, (64, 128))]
    return [committed] + [c for c in rows if c != committed]


def entry(b: int, family: str) -> dict:
    return kernels.TUNING[family] if b == 1 else kernels.TUNING["batched"][65][family]


def set_entry(b: int, family: str, cfg: dict) -> None:
    if b == 1:
        kernels.TUNING[family] = cfg
    else:
        kernels.TUNING["batched"][65][family] = cfg


def main():
    args, results, save = bench_run("split_reduce")
    results["committed"] = copy.deepcopy(kernels.TUNING)
    started = time.time()
    cfg, model, policy_config, fast, bufs, calls = denoise_setup()
    defaults = copy.deepcopy(kernels.TUNING)
    results["sweeps"], best = {}, {}
    for b in BATCHES:
        default_ms, default_out, _ = measure(fast, bufs[b])
        best[b] = {}
        for family in ("qkv", "geglu"):
            rows = []
            for c in candidates(family, copy.deepcopy(entry(b, family)), b):
                set_entry(b, family, c)
                try:
                    t, out, repeat = measure(fast, bufs[b])
                except Exception as exc:  # a config the compiler rejects, or K not divisible
                    log(f"b{b} {family} {c}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                rows.append({"ms": t, "vs_default": maxdiff(out, default_out), "repeat_bit_identical": repeat,
                             "config": c})
            rows.sort(key=lambda r: r["ms"])
            best[b][family] = rows[0]["config"]
            set_entry(b, family, rows[0]["config"])  # the next family is swept on top of this one
            results["sweeps"][f"{family}_b{b}"] = {"default_ms": default_ms, "rows": rows}
            log(f"b{b} {family}: default {default_ms:.3f} ms, best {rows[0]['ms']:.3f} {rows[0]['config']} "
                f"(vs default {rows[0]['vs_default']:.2e}, repeat equal {rows[0]['repeat_bit_identical']})")
            log("   top 5 (ms, splits, block_n, block_k):", json.dumps(
                [(round(r["ms"], 3), r["config"].get("splits", 1), r["config"]["block_n"], r["config"]["block_k"])
                 for r in rows[:5]]))
            save()
        kernels.TUNING.clear()
        kernels.TUNING.update(copy.deepcopy(defaults))

    # Full calls (prefix + denoise graphs), committed against best, with accuracy lines.
    model32 = copy.deepcopy(model).float()
    results["calls"] = {}
    for b in BATCHES:
        inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=b)
        ref32, ref16 = eager(model32, inputs, noise), eager(model, inputs, noise)
        row = {}
        for label in ("default", "best"):
            kernels.TUNING.clear()
            kernels.TUNING.update(copy.deepcopy(defaults))
            if label == "best":
                for family, c in best[b].items():
                    set_entry(b, family, c)
            runner = FastRunner(model, policy_config)
            out, _ = runner.sample(inputs, noise, STEPS, None)
            again, _ = runner.sample(inputs, noise, STEPS, None)
            stages = [runner.sample(inputs, noise, STEPS, None)[1] for _ in range(10)]
            row[label] = {"p50_ms": time_cuda(lambda: runner.sample(inputs, noise, STEPS, None))["p50_ms"],
                          "denoise_ms": sorted(s["denoise_ms"] for s in stages)[5],
                          "vs_fp32": maxdiff(out, ref32), "vs_eager_bf16": maxdiff(out, ref16),
                          "eager_bf16_vs_fp32": maxdiff(ref16, ref32),
                          "repeat_bit_identical": bool(torch.equal(out, again))}
            del runner
            torch.cuda.empty_cache()
        log(f"call b{b}:", json.dumps(row))
        results["calls"][b] = row
        save()
    results["best"] = best
    results["elapsed_s"] = time.time() - started
    save()
    log(f"done in {results['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
