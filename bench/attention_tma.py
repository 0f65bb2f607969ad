"""The attention's tiles through TMA descriptors against pointer loads (issue 14; runs 70-71).

    python3 bench/attention_tma.py [--out DIR]

Full-size shapes (8 query heads on one K/V head, head_dim 256), bench_gpu.py's ALOHA-3 workload:
1. the prefix attention alone (one layer, 864 tokens = 768 image + the 96 bucket, the last 26
   masked), each variant in its own CUDA graph: our kernel with pointer loads and with TMA at the
   committed configs, every TMA launch config, and SDPA (cuDNN) in the layout the fast path gives it;
2. the denoise graph (10 Euler steps) of full-size Pi0.5 at batch 1, 2, 4, 8: TMA off and on at the
   committed expert-attention configs, then every candidate config with TMA on (tune_batches.py's
   candidates).
Every output is compared with the committed pointer-load kernel's (TMA and pointer loads compute
the same sums: 0.0 expected at the same config). JSON under bench/results/ (attention_tma.json) and --out.
"""

from __future__ import annotations

import copy
import itertools
import time

import torch
import torch.nn.functional as F

from bench_gpu import log, maxdiff, time_graphed
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise
from tune_batches import attention_candidates

from vlaserve.model.gemma import MASK_VALUE
from vlaserve.runtime.fast import kernels

HEADS, HEAD_DIM, PREFIX, PADS = 8, 256, 3 * 256 + 96, 26


def graphed_us(fn) -> float:
    return time_graphed(fn, iters=30)["p50_ms"] * 1e3


def prefix_configs():
    for m, t, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        if not (m == 128 and w == 4):
            yield dict(block_m=m, splits=1, block_t=t, warps=w, stages=st)


def prefix_attention(b: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b)
    q = torch.randn(b, HEADS * PREFIX, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    # k/v as the fast path holds them: views [:, :P] of the longer cache (prefix + the chunk's tail)
    k = torch.randn(b, PREFIX + 64, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)[:, :PREFIX]
    v = torch.randn(b, PREFIX + 64, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)[:, :PREFIX]
    valid = torch.zeros(b, PREFIX, dtype=torch.bool, device="cuda")
    valid[:, :PREFIX - PADS] = True
    bias = torch.where(valid, 0.0, MASK_VALUE).float()
    flop = 4 * b * HEADS * PREFIX * PREFIX * HEAD_DIM
    committed = kernels.prefix_attention_config(b)

    def ours(cfg):
        return lambda: kernels.mqa_attention(q, k, v, bias, HEADS, PREFIX, cfg)

    def valid_delta(out, ref):  # padding queries are treated differently on purpose (model.py)
        return float(((out - ref).float().abs() * valid[:, :, None]).max())

    q_tokens = q.view(b, HEADS, PREFIX, HEAD_DIM).transpose(1, 2).contiguous()
    mask = bias[:, None, None, :].to(q.dtype)

    def sdpa():
        o = F.scaled_dot_product_attention(q_tokens.transpose(1, 2), k[:, None], v[:, None], attn_mask=mask,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(b, PREFIX, HEADS * HEAD_DIM)

    kernels.TUNING["tma"] = False
    reference = ours(committed)()
    row = {"committed": committed, "pointers_us": graphed_us(ours(committed)), "sdpa_us": graphed_us(sdpa),
           "sdpa_vs_pointers": valid_delta(sdpa(), reference), "tma": []}
    kernels.TUNING["tma"] = True
    row["tma_committed_us"] = graphed_us(ours(committed))
    row["tma_committed_vs_pointers"] = valid_delta(ours(committed)(), reference)
    for cfg in prefix_configs():
        entry = dict(cfg)
        try:
            entry["vs_pointers"] = valid_delta(ours(cfg)(), reference)
            entry["us"] = graphed_us(ours(cfg))
        except Exception as exc:  # shared memory or registers: recorded, skipped
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        row["tma"].append(entry)
    kernels.TUNING["tma"] = None
    ok = sorted((e for e in row["tma"] if "us" in e), key=lambda e: e["us"])
    row["best_tma"] = ok[0]
    for key in ("pointers", "sdpa", "tma_committed"):
        row[f"{key}_tflops"] = flop / row[f"{key}_us"] / 1e6
    row["best_tma_tflops"] = flop / ok[0]["us"] / 1e6
    return row


def main():
    args, results, save = bench_run("attention_tma")
    started = time.time()
    results["prefix"] = {}
    for b in BATCHES:
        row = results["prefix"][b] = prefix_attention(b)
        log(f"prefix b{b}: pointers {row['pointers_us']:.1f} us, sdpa {row['sdpa_us']:.1f}, tma at the committed "
            f"config {row['tma_committed_us']:.1f} (vs pointers {row['tma_committed_vs_pointers']}), best tma "
            f"{row['best_tma']}")
        save()

    _, _, _, fast, bufs, _ = denoise_setup()
    committed = {key: copy.deepcopy(kernels.TUNING[key]) for key in ("attention", "attention_batched")}
    results["denoise"] = {}
    for b in BATCHES:
        kernels.TUNING["tma"] = False
        pointers_ms, reference = time_denoise(fast, bufs[b])
        kernels.TUNING["tma"] = True
        tma_ms, out = time_denoise(fast, bufs[b])
        row = results["denoise"][b] = {"pointers_ms": pointers_ms, "tma_ms": tma_ms,
                                       "tma_vs_pointers": maxdiff(out, reference), "candidates": []}
        for cfg in attention_candidates(b):
            if b == 1:
                kernels.TUNING["attention"] = cfg
            else:
                kernels.TUNING["attention_batched"] = {b: cfg}
            try:
                ms, out = time_denoise(fast, bufs[b])
                row["candidates"].append({"config": cfg, "ms": ms, "vs_pointers": maxdiff(out, reference)})
            except Exception as exc:
                row["candidates"].append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            kernels.TUNING.update(copy.deepcopy(committed))
        kernels.TUNING["tma"] = None
        ok = sorted((c for c in row["candidates"] if "ms" in c), key=lambda c: c["ms"])
        row["best"] = ok[0]
        log(f"denoise b{b}: pointers {pointers_ms:.3f} ms, tma {tma_ms:.3f} (vs pointers {row['tma_vs_pointers']}), "
            f"best tma {ok[0]}")
        save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
