"""SigLIP's GEMMs at the vision encoder's shapes (M = 256 patches x cameras x batch), cuBLAS against
tiled Triton GEMMs: does another tiling fill the H200 better at M = 768 (batch 1) and 6144 (batch 8)?

    python3 bench/vision_gemm.py [--out DIR]

For each linear of a SigLIP So400m layer (qkv 1152->3456, out 1152->1152, fc1 1152->4304, fc2
4304->1152, all with bias, bf16 in and out, fp32 accumulation): cuBLAS through F.linear (torch's
default library, and cuBLASLt preferred), and a grouped-order Triton GEMM + bias over a few tile
shapes. Times are triton.testing.do_bench medians with the L2 flushed between runs (every layer's
weights are new to the cache in the model). Each Triton result is checked against F.linear (bf16
rounding of a different summation order: max |diff| relative to the output's scale). JSON in
bench/results/vision_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"qkv": (3456, 1152), "out": (1152, 1152), "fc1": (4304, 1152), "fc2": (1152, 4304)}  # (N, K)
CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
    (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 3),
]


@triton.jit
def linear_bias_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T + b[N]; tiles visited in groups of GROUP_M rows (L2 reuse)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k * BLOCK_K + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * K + kk[:, None], mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def triton_linear(x, w, b, config):
    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    linear_bias_kernel[grid](x, w, b, y, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                             num_warps=warps, num_stages=stages)
    return y


def padded() -> dict:
    """fc1 (N = 4304) and fc2 (K = 4304) with the MLP width zero-padded to 4352 / 4608 (the padded
    columns' GELU is 0 and meets zero weights: the same sums), and the GELU between them: torch's
    kernel against the fast path's one Triton pass (kernels.gelu), at M = 768 and 6144."""
    sys.path.insert(0, str(ROOT / "src"))
    from vlaserve.runtime.fast import kernels

    out = {}
    for m in (768, 6144):
        x = torch.randn(m, 1152, device="cuda", dtype=torch.bfloat16)
        fc1 = torch.randn(4304, 1152, device="cuda", dtype=torch.bfloat16) * 1152**-0.5
        fc2 = torch.randn(1152, 4304, device="cuda", dtype=torch.bfloat16) * 4304**-0.5
        b1 = torch.randn(4304, device="cuda", dtype=torch.bfloat16)
        b2 = torch.randn(1152, device="cuda", dtype=torch.bfloat16)
        for width in (4304, 4352, 4608):
            w1 = torch.zeros(width, 1152, device="cuda", dtype=torch.bfloat16)
            w1[:4304] = fc1
            bias1 = F.pad(b1, (0, width - 4304))
            w2 = torch.zeros(1152, width, device="cuda", dtype=torch.bfloat16)
            w2[:, :4304] = fc2
            h = F.gelu(F.linear(x, w1, bias1), approximate="tanh")
            row = {"fc1_us": triton.testing.do_bench(lambda: F.linear(x, w1, bias1)) * 1e3,
                   "fc2_us": triton.testing.do_bench(lambda: F.linear(h, w2, b2)) * 1e3,
                   "y": F.linear(h, w2, b2)}
            out[(m, width)] = row
        ref = out[(m, 4304)]["y"]
        for width in (4304, 4352, 4608):
            row = out[(m, width)]
            row["vs_4304"] = float((row.pop("y") - ref).float().abs().max())
        g = F.linear(x, fc1, b1)
        scratch = g.clone()  # kernels.gelu works in place: timed on a scratch copy (same bytes moved)
        out[(m, "gelu")] = {"torch_us": triton.testing.do_bench(lambda: F.gelu(g, approximate="tanh")) * 1e3,
                            "triton_us": triton.testing.do_bench(lambda: kernels.gelu(scratch)) * 1e3,
                            "triton_vs_torch": float((kernels.gelu(g.clone()) - F.gelu(g, approximate="tanh"))
                                                     .float().abs().max())}
        for key in [k for k in out if k[0] == m]:
            print("padded", key, out[key], flush=True)
    return {f"{m}_{w}": v for (m, w), v in out.items()}


def attention_backends() -> dict:
    """SigLIP's attention (16 heads of 72 over 256 patches; 3 and 24 images) through each SDPA backend,
    on q/k/v as the fast path hands them over (strided views of the fused qkv rows) and as contiguous
    copies: us (do_bench), and max |diff| against the float32 attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for n in (3, 24):
        qkv = torch.randn(n * 256, 3 * 16 * 72, device="cuda", dtype=torch.bfloat16)
        views = qkv.view(n, 256, 3, 16, 72).permute(2, 0, 3, 1, 4).unbind(0)
        dense = [t.contiguous() for t in views]
        ref = F.scaled_dot_product_attention(*[t.float() for t in views], scale=72**-0.5)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for layout, args in (("views", views), ("contiguous", dense)):
                key = f"{n}_{backend.name.lower()}_{layout}"
                try:
                    with sdpa_kernel(backend):
                        fn = lambda: F.scaled_dot_product_attention(*args, scale=72**-0.5)  # noqa: E731
                        out[key] = {"us": triton.testing.do_bench(fn) * 1e3,
                                    "vs_fp32": float((fn().float() - ref).abs().max())}
                except RuntimeError as exc:  # a backend that does not take these shapes
                    out[key] = {"error": str(exc)[:160]}
                print("attention", key, out[key], flush=True)
    return out


def end_to_end() -> dict:
    """The full-size fast path (random weights, graphs captured under each library preference):
    p50 per call at batch 1 and 8, stage times, and how far the two libraries' actions lie apart."""
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]
    from bench_gpu import STEPS, make_inputs, random_model, time_cuda
    from vlaserve.config import ModelConfig, PolicyConfig
    from vlaserve.runtime.fast.graphs import FastRunner

    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    policy_config = PolicyConfig(cfg, ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), 14, 14)
    out, actions = {}, {}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        runner = FastRunner(model, policy_config)
        runner.warmup((1, 8), STEPS)
        for b in (1, 8):
            inputs, noise = make_inputs(b, cfg.vlm.vocab_size)
            actions[(library, b)], _ = runner.sample(inputs, noise, STEPS, None)
            stages = [runner.sample(inputs, noise, STEPS, None)[1] for _ in range(10)]
            out[f"{library}_b{b}"] = {**time_cuda(lambda: runner.sample(inputs, noise, STEPS, None)),
                                      "prefix_ms": sorted(s["prefix_ms"] for s in stages)[5],
                                      "denoise_ms": sorted(s["denoise_ms"] for s in stages)[5]}
            print(library, b, out[f"{library}_b{b}"], flush=True)
        del runner
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    out["actions_max_abs_diff"] = {b: float((actions[("cublas", b)] - actions[("cublaslt", b)]).abs().max())
                                   for b in (1, 8)}
    print("actions cublas vs cublaslt:", out["actions_max_abs_diff"])
    return out


def patch_embedding() -> dict:
    """SigLIP's fp32 patch embedding (a 14x14 stride-14 convolution, 3 -> 1152 channels) at 3 and 24
    images: the convolution (cuDNN) against the same sums as one GEMM over unfolded patches (cuBLAS
    sgemm, TF32 off), both against a float64 convolution."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for n in (3, 24):
        x = torch.rand(n, 3, 224, 224, device="cuda") * 2 - 1
        w = torch.randn(1152, 3, 14, 14, device="cuda") * 588**-0.5
        bias = torch.randn(1152, device="cuda")

        def conv():
            return F.conv2d(x, w, bias, stride=14).flatten(2).transpose(1, 2)

        def gemm():
            patches = x.view(n, 3, 16, 14, 16, 14).permute(0, 2, 4, 1, 3, 5).reshape(n, 256, 588)
            return F.linear(patches, w.view(1152, 588), bias)

        truth = F.conv2d(x.double(), w.double(), bias.double(), stride=14).flatten(2).transpose(1, 2)
        out[n] = {"conv_us": triton.testing.do_bench(conv) * 1e3, "gemm_us": triton.testing.do_bench(gemm) * 1e3,
                  "conv_vs_fp64": float((conv() - truth).abs().max()), "gemm_vs_fp64": float((gemm() - truth).abs().max())}
        print("patch embedding", n, "images:", out[n], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--end-to-end", action="store_true", help="also the whole fast path with either library")
    ap.add_argument("--patch-embedding", action="store_true", help="only the patch embedding: convolution vs GEMM")
    ap.add_argument("--padded", action="store_true", help="only fc1/fc2 with the MLP width padded, and the GELU")
    ap.add_argument("--attention", action="store_true", help="only SigLIP's attention through each SDPA backend")
    args = ap.parse_args()

    def save(name: str, result: dict) -> None:
        for d in filter(None, [ROOT / "bench" / "results", Path(args.out) if args.out else None]):
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{name}.json").write_text(json.dumps(result, indent=1))

    # The single-probe options: (flag, its result key and file name, the probe)
    for flag, name, probe in ((args.attention, "vision_attention", attention_backends),
                              (args.padded, "vision_padded", padded),
                              (args.patch_embedding, "patch_embedding", patch_embedding)):
        if flag:
            save(name, {"device": torch.cuda.get_device_name(), name.removeprefix("vision_"): probe()})
            return
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "shapes": []}
    totals = {}
    for batch in (1, 8):
        m = 768 * batch
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w, b)
            flops = 2 * m * n * k
            row = {"batch": batch, "name": name, "M": m, "N": n, "K": k}
            torch.backends.cuda.preferred_blas_library("cublas")
            row["cublas_us"] = triton.testing.do_bench(lambda: F.linear(x, w, b)) * 1e3
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["cublaslt_us"] = triton.testing.do_bench(lambda: F.linear(x, w, b)) * 1e3
            torch.backends.cuda.preferred_blas_library("cublas")
            row["addmm_us"] = triton.testing.do_bench(lambda: torch.addmm(b, x, w.t())) * 1e3
            row["addmm_activation_us"] = triton.testing.do_bench(
                lambda: torch._addmm_activation(b, x, w.t(), use_gelu=False)) * 1e3
            best = None
            for config in CONFIGS:
                y = triton_linear(x, w, b, config)
                err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                us = triton.testing.do_bench(lambda: triton_linear(x, w, b, config)) * 1e3
                row.setdefault("triton", []).append({"config": config, "us": us, "rel_err": err})
                if best is None or us < best["us"]:
                    best = {"config": config, "us": us, "rel_err": err}
            row["triton_best"] = best
            for key, us in (("cublas", row["cublas_us"]), ("cublaslt", row["cublaslt_us"]), ("triton", best["us"])):
                row[f"{key}_tflops"] = flops / us / 1e6
                totals[(batch, key)] = totals.get((batch, key), 0.0) + us
            print(f"b{batch} {name:4s} M={m} N={n} K={k}: cublas {row['cublas_us']:.1f} us "
                  f"({row['cublas_tflops']:.0f} TF/s), cublasLt {row['cublaslt_us']:.1f}, addmm {row['addmm_us']:.1f}, "
                  f"_addmm_activation {row['addmm_activation_us']:.1f}, triton best "
                  f"{best['us']:.1f} us {best['config']} ({row['triton_tflops']:.0f} TF/s, rel err {best['rel_err']:.1e})",
                  flush=True)
            results["shapes"].append(row)
    # Per call: 27 layers, each with the four GEMMs.
    results["per_call_ms"] = {f"b{b}_{key}": us * 27 / 1e3 for (b, key), us in totals.items()}
    print("per call (27 layers):", json.dumps(results["per_call_ms"]))
    if args.end_to_end:
        results["end_to_end"] = end_to_end()
    save("vision_gemm", results)


if __name__ == "__main__":
    sys.exit(main())
