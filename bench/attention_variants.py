"""The attention kernels' variants, and SigLIP's attention on our kernel (issue 14; run 79).

    python3 bench/attention_variants.py [--out DIR]

Full-size shapes, bench_gpu.py's ALOHA-3 workload. Each variant in its own CUDA graph:
1. the prefix attention alone (one layer, 864 tokens, the last 26 masked) and the expert's (400
   query rows = 8 heads x 50, keys = 864 prefix + 50 chunk, its key splits and their merge) at batch
   1 and 8: the committed kernel against scores in log2 units ("exp2"), a lazy rescale ("lazy":
   the running max is kept unless a row's grows by more than 2^8) and Triton's warp
   specialization of the key loop ("ws"), each against the float32 attention;
2. the expert's attention at batch 4 and 8 as two cuBLAS batched GEMMs (fp32 scores) with torch's
   softmax between them (the reference's own rounding point: probabilities rounded to bf16);
3. SigLIP's attention (16 heads of 72, 256 patches an image; 3 and 24 images) on our
   `kernels.patch_attention` at several launch configs against SDPA (cuDNN), both against float32;
4. the prefix graph (SDPA vs ours for SigLIP) and the denoise graph (the variants of 1) of
   full-size Pi0.5 at batch 1 and 8.
JSON under bench/results/ (attention_variants.json) and --out.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from bench_gpu import log, time_graphed
from kernel_ladder import bench_run, denoise_setup, time_denoise

from vlaserve.model.gemma import MASK_VALUE
from vlaserve.runtime.fast import kernels

HEADS, HEAD_DIM, PREFIX, PADS, CHUNK = 8, 256, 3 * 256 + 96, 26, 50
FLAGS = {"base": {}, "exp2": {"exp2": True}, "lazy": {"lazy": True}}


def graphed_us(fn) -> float:
    return time_graphed(fn, iters=30)["p50_ms"] * 1e3


def attempt(entry: dict, fn):
    try:
        entry.update(fn())
    except Exception as exc:  # shared memory, registers, a compiler that refuses: recorded, skipped
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return entry


def mqa_inputs(b: int, queries: int, keys: int, valid_keys, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, HEADS * queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    # k/v as the fast path holds them: views of the longer cache
    k = torch.randn(b, keys + 64, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)[:, :keys]
    v = torch.randn(b, keys + 64, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)[:, :keys]
    valid = torch.zeros(b, keys, dtype=torch.bool, device="cuda")
    valid[:, valid_keys] = True
    bias = torch.where(valid, 0.0, MASK_VALUE).float()
    s = q.float().view(b, HEADS, queries, HEAD_DIM) @ k.float()[:, None].transpose(-1, -2) * HEAD_DIM**-0.5
    ref = ((s + bias[:, None, None]).softmax(-1) @ v.float()[:, None]).transpose(1, 2)
    return q, k, v, bias, ref.reshape(b, queries, HEADS * HEAD_DIM)


def kernel_variants(name: str, b: int, queries: int, keys: int, valid_keys, committed: dict, ws_configs) -> dict:
    q, k, v, bias, ref = mqa_inputs(b, queries, keys, valid_keys, seed=b)
    rows = slice(None) if name == "expert" else slice(0, PREFIX - PADS)  # padding queries: model.py
    flop = 4 * b * HEADS * queries * keys * HEAD_DIM
    base = kernels.mqa_attention(q, k, v, bias, HEADS, queries, committed)
    out = {"committed": committed, "variants": []}
    configs = [(label, {**committed, **flags}) for label, flags in FLAGS.items()]
    configs += [(f"ws {c}", {**c, "ws": True, "exp2": True}) for c in ws_configs]
    for label, cfg in configs:
        def run(cfg=cfg):
            fn = lambda: kernels.mqa_attention(q, k, v, bias, HEADS, queries, cfg)  # noqa: E731
            got = fn()
            us = graphed_us(fn)
            return {"us": us, "tflops": flop / us / 1e6,
                    "vs_fp32": float((got.float() - ref)[:, rows].abs().max()),
                    "vs_committed": float((got.float() - base.float())[:, rows].abs().max())}
        e = attempt({"label": label, "config": cfg}, run)
        out["variants"].append(e)
        log(f"{name} b{b} {label}: {e}")
    return out


def cublas_attention(b: int) -> dict:
    """The expert's attention as bmm (fp32 scores) -> softmax -> bf16 probabilities -> bmm, with q
    token-major (row = token * heads + head), so that the output is [B, 50, heads * D] as it comes."""
    valid = list(range(PREFIX - PADS)) + list(range(PREFIX, PREFIX + CHUNK))
    q, k, v, bias, ref = mqa_inputs(b, CHUNK, PREFIX + CHUNK, valid, seed=b)
    q_tok = q.view(b, HEADS, CHUNK, HEAD_DIM).transpose(1, 2).reshape(b, CHUNK * HEADS, HEAD_DIM).contiguous()
    scale = HEAD_DIM**-0.5

    def fn():
        s = torch.bmm(q_tok, k.transpose(1, 2), out_dtype=torch.float32)
        p = (s * scale + bias[:, None, :]).softmax(-1).to(q.dtype)
        return torch.bmm(p, v).view(b, CHUNK, HEADS * HEAD_DIM)

    committed = kernels.attention_config(b)
    ours = lambda: kernels.mqa_attention(q, k, v, bias, HEADS, CHUNK, committed)  # noqa: E731
    row = {"ours_us": graphed_us(ours), "ours_vs_fp32": float((ours().float() - ref).abs().max())}
    attempt(row, lambda: {"cublas_us": graphed_us(fn), "cublas_vs_fp32": float((fn().float() - ref).abs().max())})
    log(f"expert attention b{b} through cuBLAS: {row}")
    return row


PATCH_CONFIGS = [dict(block_m=m, block_t=t, warps=w, stages=s)
                 for m, t, w, s in ((32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2),
                                    (128, 64, 8, 2), (128, 128, 8, 2), (64, 256, 4, 2))]


def patch_attention(images: int, heads: int = 16, d: int = 72, patches: int = 256) -> dict:
    g = torch.Generator(device="cuda").manual_seed(images)
    qkv = torch.randn(images * patches, 3 * heads * d, device="cuda", dtype=torch.bfloat16, generator=g)

    def split(x):
        return x.view(images, patches, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)

    def sdpa(x=qkv):
        q, k, v = split(x)
        out = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)
        return out.transpose(1, 2).reshape(images * patches, heads * d)

    ref = sdpa(qkv.float())
    flop = 4 * images * heads * patches * patches * d
    row = {"sdpa_us": graphed_us(sdpa), "sdpa_vs_fp32": float((sdpa().float() - ref).abs().max()), "ours": []}
    committed = copy.deepcopy(kernels.TUNING["patch_attention"])
    for cfg in PATCH_CONFIGS:
        kernels.TUNING["patch_attention"] = cfg
        fn = lambda: kernels.patch_attention(qkv, images, patches, heads, d)  # noqa: E731
        row["ours"].append(attempt(dict(cfg), lambda: {"us": graphed_us(fn),
                                                        "vs_fp32": float((fn().float() - ref).abs().max()),
                                                        "vs_sdpa": float((fn() - sdpa()).float().abs().max())}))
    kernels.TUNING["patch_attention"] = committed
    ok = sorted((e for e in row["ours"] if "us" in e), key=lambda e: e["us"])
    row["best"] = ok[0] if ok else None
    row["sdpa_tflops"] = flop / row["sdpa_us"] / 1e6
    log(f"patch attention, {images} images: sdpa {row['sdpa_us']:.1f} us ({row['sdpa_vs_fp32']:.2e}), best ours "
        f"{row['best']}")
    return row


def graphs(results: dict, save) -> None:
    """The prefix graph with SigLIP's attention on SDPA vs ours, the denoise graph per variant."""
    _, _, _, fast, bufs, _ = denoise_setup()
    ours = kernels.patch_attention

    def sdpa(qkv, n, p, heads, d):
        return fast._vision_attention(qkv, n, p)

    committed = {key: copy.deepcopy(kernels.TUNING[key]) for key in ("attention", "attention_batched")}
    for b in (1, 8):
        buf = bufs[b]

        def prefix():
            return fast.prefix(buf["images"], buf["image_masks"], buf["tokens"], buf["token_mask"], buf["k_cache"],
                               buf["v_cache"], buf["images"].shape[1])
        row = results["graphs"][b] = {}
        for label, fn in (("sdpa", sdpa), ("ours", ours)):
            kernels.patch_attention = fn
            row[f"prefix_{label}_ms"] = time_graphed(prefix, iters=20)["p50_ms"]
            row[f"k_cache_{label}"] = buf["k_cache"].clone()
        kernels.patch_attention = ours
        row["prefix_k_ours_vs_sdpa"] = float((row.pop("k_cache_ours") - row.pop("k_cache_sdpa")).float().abs().max())
        prefix()
        reference = None
        for label, flags in FLAGS.items():
            cfg = {**kernels.attention_config(b), **flags}
            if b == 1:
                kernels.TUNING["attention"] = cfg
            else:
                kernels.TUNING["attention_batched"] = {**kernels.TUNING["attention_batched"], b: cfg}
            e = attempt({}, lambda: dict(zip(("ms", "out"), time_denoise(fast, buf))))
            kernels.TUNING.update(copy.deepcopy(committed))
            if "out" in e:
                out = e.pop("out")
                reference = out if reference is None else reference
                e["vs_base"] = float((out - reference).abs().max())
            row[f"denoise_{label}"] = e
        log(f"graphs b{b}: {row}")
        save()


def main():
    args, results, save = bench_run("attention_variants")
    started = time.time()
    prefix_valid = list(range(PREFIX - PADS))
    expert_valid = list(range(PREFIX - PADS)) + list(range(PREFIX, PREFIX + CHUNK))
    results["prefix"], results["expert"], results["cublas"], results["patch"], results["graphs"] = {}, {}, {}, {}, {}
    for b in (1, 8):
        ws = [dict(block_m=64, splits=1, block_t=32, warps=4, stages=2), dict(block_m=64, splits=1, block_t=32,
              warps=4, stages=3), dict(block_m=128, splits=1, block_t=64, warps=8, stages=2)]
        results["prefix"][b] = kernel_variants("prefix", b, PREFIX, PREFIX, prefix_valid,
                                               kernels.prefix_attention_config(b), ws)
        splits = kernels.attention_config(b)["splits"]
        ws = [dict(block_m=64, splits=splits, block_t=32, warps=4, stages=2),
              dict(block_m=128, splits=splits, block_t=64, warps=8, stages=2)]
        results["expert"][b] = kernel_variants("expert", b, CHUNK, PREFIX + CHUNK, expert_valid,
                                               kernels.attention_config(b), ws)
        save()
    for b in (4, 8):
        results["cublas"][b] = cublas_attention(b)
    for images in (3, 24):
        results["patch"][images] = patch_attention(images)
    save()
    graphs(results, save)
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
