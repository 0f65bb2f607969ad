"""Launch configs per batch size, measured in the denoise graph (issue 14): one run sweeps

- the expert attention at batch 1, 2, 4, 8 (query tile, key splits, warps; run 42 also had SDPA,
  slower at every batch, since dropped),
- the batched expert GEMMs (split-K o/down, gate_up + GeGLU, qkv + RoPE) at 2, 4, 8 separately,
- the fused action kernel's loop unrolling at batch 1,
- the prefix attention at batch 1 (alone, one layer),

then runs full calls (prefix + denoise graphs) with each batch's best, against the committed
defaults (kernels.TUNING: run 42's bests), with the accuracy lines (vs fp32 eager, vs bf16 eager).

    python3 bench/tune_batches.py [--out DIR] [--quick]

Full-size Pi0.5, random weights, bench_gpu.py's ALOHA-3 workload. JSON under bench/results/
(tune_batches.json) and --out. Every candidate's actions are checked against the default's (bf16
reassociation only: a launch config never changes what is computed).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import STEPS, TOKENS, eager, log, make_inputs, maxdiff, time_cuda, time_graphed  # noqa: E402
from kernel_ladder import bench_run, denoise_setup, time_denoise  # noqa: E402

from vlaserve.model.gemma import MASK_VALUE  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

BATCHES = (1, 2, 4, 8)
HORIZON = 50  # rows per item in the expert's GEMMs


def attention_candidates(b: int) -> list:
    shapes = ([(m, s, w) for m, s, w in itertools.product((16, 32, 64), (2, 4, 8, 16), (4, 8)) if not (m == 16 and w == 8)]
              if b == 1 else [(m, s, w) for m, s, w in itertools.product((64, 128), (1, 2, 4, 8), (4, 8))
                              if not (m == 128 and w == 4)])
    return [dict(block_m=m, splits=s, block_t=64, warps=w, stages=2) for m, s, w in shapes]


def gemm_candidates(family: str, b: int) -> list:
    rows = (64, 128) if b == 2 else (128, 256)
    if family == "splitk":
        return [dict(block_r=r, block_n=n, block_k=k, max_waves=1, warps=w, stages=4)
                for r, n, k, w in itertools.product(rows, (32, 64), (64, 128), (4, 8)) if not (r == 256 and w == 4)]
    if family == "geglu":
        return [dict(block_r=r, block_n=n, block_k=64, warps=w, stages=3)
                for r, n, w in itertools.product(rows, (None, 32, 64), (4, 8)) if not (r == 256 and w == 4)]
    return [dict(block_r=r, block_n=n, block_k=64, warps=8, stages=s)
            for r, n, s in itertools.product(rows, (16, 32, 64), (3, 4))]


def sweep(name, candidates, apply, measure, reference, default_ms: float):
    """Times every candidate (apply(c) sets it): (the fastest, every row fastest first)."""
    rows = []
    for c in candidates:
        apply(c)
        try:
            t, out = measure()
        except Exception as exc:  # a config the compiler rejects (shared memory, registers)
            log(f"{name} {c}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        rows.append({"ms": t, "vs_default": maxdiff(out, reference), "config": c})
    rows.sort(key=lambda r: r["ms"])
    log(f"{name}: best {rows[0]['ms']:.3f} ms {rows[0]['config']} (default {default_ms:.3f})")
    return rows[0]["config"], rows


def full_call(model, policy_config, inputs, noise, ref32, ref16) -> dict:
    """A fresh FastRunner under the current kernels.TUNING (graphs captured on its first call): p50,
    median prefix / denoise stage ms of 10 calls, max|Δ| vs fp32 and bf16 eager, repeat bit-identical."""
    runner = FastRunner(model, policy_config)
    out, _ = runner.sample(inputs, noise, STEPS, None)
    again, _ = runner.sample(inputs, noise, STEPS, None)
    stages = [runner.sample(inputs, noise, STEPS, None)[1] for _ in range(10)]
    row = {"p50_ms": time_cuda(functools.partial(runner.sample, inputs, noise, STEPS, None))["p50_ms"],
           "prefix_ms": sorted(s["prefix_ms"] for s in stages)[5],
           "denoise_ms": sorted(s["denoise_ms"] for s in stages)[5],
           "vs_fp32": maxdiff(out, ref32), "vs_eager_bf16": maxdiff(out, ref16),
           "repeat_bit_identical": bool(torch.equal(out, again))}
    del runner
    torch.cuda.empty_cache()
    return row


def compare_calls(model, policy_config, batches, defaults: dict, variants: dict, results: dict, save) -> None:
    """Full calls (full_call) at each batch size under the committed `defaults` and under each of
    `variants` ({label: apply(batch)}, which edits kernels.TUNING after it is reset to `defaults`):
    rows in results["calls"][batch][label], each with eager bf16's own error beside it. Leaves
    kernels.TUNING at `defaults`."""
    model32 = copy.deepcopy(model).float()
    results["calls"] = {}
    for b in batches:
        inputs, noise = make_inputs(b, model.vlm.dims.vocab_size, seed=b)
        ref32, ref16 = eager(model32, inputs, noise), eager(model, inputs, noise)
        row = {}
        for label, apply in {"default": lambda _b: None, **variants}.items():
            kernels.TUNING.clear()
            kernels.TUNING.update(copy.deepcopy(defaults))
            apply(b)
            row[label] = {**full_call(model, policy_config, inputs, noise, ref32, ref16),
                          "eager_bf16_vs_fp32": maxdiff(ref16, ref32)}
        log(f"call b={b}:", json.dumps(row))
        results["calls"][b] = row
        save()
    kernels.TUNING.clear()
    kernels.TUNING.update(copy.deepcopy(defaults))


def prefix_attention_sweep(plen: int, heads: int, d: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads * plen, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, plen, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    bias = torch.zeros(1, plen, device="cuda")
    bias[:, plen - 130:] = MASK_VALUE
    configs = [dict(block_m=m, splits=s, block_t=t, warps=w, stages=st)
               for m, s, t, w, st in itertools.product((64, 128), (1, 2), (32, 64, 128), (4, 8), (1, 2))
               if not (m == 128 and w == 4)]
    default = dict(kernels.TUNING["prefix_attention"])
    ref = kernels.mqa_attention(q, k, v, bias, heads, plen, default)
    rows = []
    for c in [default] + configs:
        try:
            out = kernels.mqa_attention(q, k, v, bias, heads, plen, c)
            us = time_graphed(lambda: kernels.mqa_attention(q, k, v, bias, heads, plen, c), iters=30)["p50_ms"] * 1e3
        except Exception as exc:
            log(f"prefix attention {c}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        rows.append({"us": us, "vs_default": maxdiff(out[:, :plen - 130], ref[:, :plen - 130]), "config": c,
                     "default": c is default})
    rows.sort(key=lambda r: r["us"])
    log(f"prefix attention b1: best {rows[0]['us']:.1f} us {rows[0]['config']}, default "
        f"{next(r['us'] for r in rows if r['default']):.1f} us")
    return rows


def main():
    args, results, save = bench_run("tune_batches")
    results["committed"] = copy.deepcopy(kernels.TUNING)
    started = time.time()
    cfg, model, policy_config, fast, bufs, _ = denoise_setup()
    log(f"built ({time.time() - started:.0f}s)")
    defaults = copy.deepcopy(kernels.TUNING)
    default_out = {b: time_denoise(fast, bufs[b]) for b in BATCHES}
    results["default_denoise_ms"] = {b: t for b, (t, _) in default_out.items()}
    log("default denoise:", results["default_denoise_ms"])

    # 1. The expert attention, per batch size (everything else at the defaults).
    best_attention, results["attention"] = {}, {}
    for b in BATCHES:
        def apply(c, b=b):
            if b == 1:
                kernels.TUNING["attention"] = c
            else:
                kernels.TUNING["attention_batched"] = {b: c}
        best, rows = sweep(f"attention b{b}", attention_candidates(b), apply, lambda b=b: time_denoise(fast, bufs[b]),
                           default_out[b][1], default_out[b][0])
        best_attention[b] = best
        results["attention"][b] = rows
        kernels.TUNING["attention"], kernels.TUNING["attention_batched"] = (copy.deepcopy(defaults["attention"]),
                                                                           copy.deepcopy(defaults["attention_batched"]))
        save()
    kernels.TUNING["attention"] = best_attention[1]
    kernels.TUNING["attention_batched"] = {b: best_attention[b] for b in BATCHES if b > 1}

    # 2. The batched GEMMs, per batch size, each family with the best so far.
    best_gemm, results["gemm"] = {}, {}
    for b in (2, 4, 8):
        best_gemm[b] = copy.deepcopy(kernels.batched_config(b * HORIZON))
        for family in ("splitk", "geglu", "qkv"):
            def apply(c, b=b, family=family):  # one table entry: every row count
                kernels.TUNING["batched"] = {1: {**best_gemm[b], family: c}}
            committed = best_gemm[b][family]
            best, rows = sweep(f"{family} b{b}", [committed] + gemm_candidates(family, b), apply,
                               lambda b=b: time_denoise(fast, bufs[b]), default_out[b][1], default_out[b][0])
            best_gemm[b][family] = best
            results["gemm"][f"{family}_b{b}"] = rows
            save()
        kernels.TUNING["batched"] = copy.deepcopy(defaults["batched"])

    # 3. The action kernel at batch 1.
    def apply_action(c):
        kernels.TUNING["action"] = {**defaults["action"], **c}
    action = [dict(unroll=u, block_k=k) for u, k in itertools.product((1, 2, 4, 8, 16), (64, 128))]
    best_action, results["action"] = sweep("action b1", action, apply_action, lambda: time_denoise(fast, bufs[1]),
                                           default_out[1][1], default_out[1][0])
    kernels.TUNING["action"] = {**defaults["action"], **best_action}
    save()

    # 4. The prefix attention at batch 1, alone.
    g = cfg.vlm
    results["prefix_attention_b1"] = prefix_attention_sweep(3 * 256 + TOKENS, g.num_heads, g.head_dim)
    best_prefix = results["prefix_attention_b1"][0]["config"]
    save()

    # 5. Full calls: the committed defaults against each batch's best, with accuracy lines.
    def tuned(b: int) -> None:
        kernels.TUNING["attention"] = best_attention[1]
        kernels.TUNING["attention_batched"] = {s: best_attention[s] for s in BATCHES if s > 1}
        if b > 1:
            kernels.TUNING["batched"] = {1: copy.deepcopy(best_gemm[b])}
        kernels.TUNING["action"] = {**defaults["action"], **best_action}
        kernels.TUNING["prefix_attention"] = best_prefix

    compare_calls(model, policy_config, BATCHES, defaults, {"tuned": tuned}, results, save)
    results["best"] = {"attention": best_attention, "batched": best_gemm, "action": best_action,
                       "prefix_attention": best_prefix}
    results["elapsed_s"] = time.time() - started
    save()
    log(f"done in {results['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
