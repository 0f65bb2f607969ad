"""The expert's norms inside its GEMMs, cuBLAS for the batched expert GEMMs, and prompt buckets at
every batch size, measured in one run (issue 14).

    python3 bench/expert_fusion.py [--out DIR]

Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 workload.
1. The denoise graph (10 Euler steps) at batch 1, 2, 4, 8 with the AdaRMS norms as kernels of their
   own (`fused_norms` off: a norm kernel after each split-K GEMM) and inside the GEMMs (on: each
   output tile's last K split adds the residual, the next GEMM normalizes as it loads); actions
   against the fp32 eager model, on vs off, and on twice (must be bit-identical).
2. The same graph with the expert's GEMMs through cuBLAS from batch 2 on (F.linear, then the RoPE /
   GeGLU / residual-norm kernels on its bf16 outputs: the same rounding points), against ours.
3. Full calls (prefix + denoise graphs) at each batch size with the prompt padded to the
   checkpoint's 200 tokens and to a 96-token bucket (70 valid tokens), both against the fp32 eager
   model on the 200-token prompt.
JSON under bench/results/ (expert_fusion.json) and --out.
"""

from __future__ import annotations

import copy
import json
import time
import types

import torch
import torch.nn.functional as F

from bench_gpu import STEPS, eager, log, maxdiff, time_cuda
from kernel_ladder import BATCHES, bench_run, denoise_setup, time_denoise

from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.graphs import FastRunner
from vlaserve.types import ModelInputs

BUCKET = 96


def _expert_cublas(self, h, step, sched, geometry, k_cache, v_cache, plen):
    """FastPi05._expert_triton with the GEMMs through cuBLAS and our kernels on their outputs."""
    dims = self.expert_dims
    bias, cos, sin, _ = geometry
    b, horizon, width = h.shape
    half = dims.head_dim // 2
    cos_half = cos[:, 0, :, :half].float().reshape(b * horizon, half)
    sin_half = sin[:, 0, :, :half].float().reshape(b * horizon, half)
    eps, layers = dims.rms_norm_eps, len(self.w.expert)
    h2d = h.reshape(b * horizon, width).contiguous()
    y = kernels.residual_norm(h2d, sched.scale1p[step, 0, 0], sched.shift[step, 0, 0], eps=eps)
    for i, lw in enumerate(self.w.expert):
        tail = (k_cache[i, :, plen:plen + horizon], v_cache[i, :, plen:plen + horizon])
        q = kernels.qkv_rope_into_cache(F.linear(y, lw.qkv), cos_half, sin_half, *tail, dims.num_heads, horizon)
        attn = kernels.mqa_attention(q, k_cache[i], v_cache[i], bias, dims.num_heads, horizon,
                                     kernels.attention_config(b)).view(b * horizon, -1)
        y = kernels.residual_norm(h2d, sched.scale1p[step, i, 1], sched.shift[step, i, 1], delta=F.linear(attn, lw.o),
                                  gate=sched.gate[step, i, 0], eps=eps)
        act = kernels.geglu(F.linear(y, lw.gate_up))
        if i + 1 < layers:
            scale1p, shift = sched.scale1p[step, i + 1, 0], sched.shift[step, i + 1, 0]
        else:
            scale1p, shift = sched.final_scale1p[step], sched.final_shift[step]
        y = kernels.residual_norm(h2d, scale1p, shift, delta=F.linear(act, lw.down), gate=sched.gate[step, i, 1],
                                  eps=eps)
    return y.view(b, horizon, width)


def bucketed(inputs: ModelInputs, length: int) -> ModelInputs:
    return ModelInputs(inputs.images, inputs.image_masks, inputs.tokens[:, :length].contiguous(),
                       inputs.token_mask[:, :length].contiguous(), inputs.state, inputs.pending)


def main():
    args, results, save = bench_run("expert_fusion")
    started = time.time()
    cfg, model, policy_config, fast, bufs, calls = denoise_setup()
    model32 = copy.deepcopy(model).float()
    refs32 = {b: eager(model32, *calls[b]) for b in BATCHES}
    refs16 = {b: eager(model, *calls[b]) for b in BATCHES}
    log(f"built ({time.time() - started:.0f}s)")

    # 1. Norm kernels vs norms inside the GEMMs.
    results["denoise"] = {}
    outs = {}
    for fused in (False, True, "again"):
        kernels.TUNING["fused_norms"] = bool(fused)
        row = {}
        for b in BATCHES:
            t, outs[(fused, b)] = time_denoise(fast, bufs[b])
            row[b] = {"ms": t, "vs_fp32": maxdiff(outs[(fused, b)], refs32[b]),
                      "vs_eager_bf16": maxdiff(outs[(fused, b)], refs16[b])}
        results["denoise"][f"fused_norms={fused}"] = row
        log(f"fused_norms={fused}", json.dumps(row))
        save()
    results["fused_vs_unfused"] = {b: maxdiff(outs[(True, b)], outs[(False, b)]) for b in BATCHES}
    results["fused_repeat_bit_identical"] = {b: bool(torch.equal(outs[(True, b)], outs[("again", b)]))
                                             for b in BATCHES}
    log("fused vs unfused:", results["fused_vs_unfused"], "repeat identical:", results["fused_repeat_bit_identical"])
    kernels.TUNING["fused_norms"] = True

    # 2. cuBLAS for the expert's GEMMs from batch 2 on.
    ours = fast._expert_triton
    fast._expert_triton = types.MethodType(_expert_cublas, fast)
    results["cublas_expert"] = {}
    for b in BATCHES[1:]:
        t, out = time_denoise(fast, bufs[b])
        results["cublas_expert"][b] = {"ms": t, "vs_fp32": maxdiff(out, refs32[b]),
                                       "vs_ours": maxdiff(out, outs[(True, b)])}
    fast._expert_triton = ours
    log("cuBLAS expert GEMMs:", json.dumps(results["cublas_expert"]))
    save()

    # 3. Full calls: the checkpoint's prompt length against a bucket.
    runner = FastRunner(model, policy_config)
    results["calls"] = {}
    for b in BATCHES:
        inputs, noise = calls[b]
        row = {}
        for label, x in (("tokens_200", inputs), (f"bucket_{BUCKET}", bucketed(inputs, BUCKET))):
            out, _ = runner.sample(x, noise, STEPS, None)
            again, _ = runner.sample(x, noise, STEPS, None)
            stages = [runner.sample(x, noise, STEPS, None)[1] for _ in range(10)]
            row[label] = {"p50_ms": time_cuda(lambda x=x: runner.sample(x, noise, STEPS, None))["p50_ms"],
                          "prefix_ms": sorted(s["prefix_ms"] for s in stages)[5],
                          "denoise_ms": sorted(s["denoise_ms"] for s in stages)[5],
                          "vs_fp32": maxdiff(out, refs32[b]), "vs_eager_bf16": maxdiff(out, refs16[b]),
                          "repeat_bit_identical": bool(torch.equal(out, again))}
        log(f"call b={b}:", json.dumps(row))
        results["calls"][b] = row
        save()
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
