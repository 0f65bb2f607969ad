"""Probe: the expert's split-K o/down GEMM as a CUDA C++ kernel whose weights are in flight
before the PDL wait (issue 14, run 95).

Runs 91-94 found that an early weight read saves ~0.9 ms of o/down at batch 1 on one-tile grids,
and that Triton cannot keep the committed grid while doing it (registers, a pipeliner that starts
after the wait, TMA copies waited one by one). This kernel keeps the committed grid (32-column
tiles x 4 K splits: 128 programs, each 512 (o) or 1024 (down) of K) and:
1. before `griddepcontrol.wait`: cp.async of the program's whole weight slice into shared memory
   (32 or 64 KB, one commit group, nothing in registers);
2. after it: x (the previous kernel's output) in 256-wide commit groups, rows past R zero-filled;
3. tensor-core products (WMMA bf16 -> fp32) chunk by chunk as each x group lands (run 95: one
   warp per 16 rows, 2 accumulators each; run 96: every warp on all rows, 8 accumulators, the
   warps' sums added at the end; run 100: copy loops with compile-time strides, and 8 warps as
   well as 4);
4. fp32 partial sums [4, R, N], as `kernels.splitk_partials` writes them (the norm reduces them).
Built with nvcc to a cubin at start, launched through the driver (cuLaunchKernelEx, with the
programmatic-serialization attribute, so it pairs with the Triton kernels' PDL).

Checks: partial sums against torch's fp32 product; the 360 o/down GEMMs of a call alone, back to
back in one graph (run 97); then the denoise graph at batch 1 with
`kernels.splitk_partials` replaced for 50 rows: committed, CUDA (weights before the wait), CUDA
with the weights after it (the control), and without PDL; actions against the committed ones.

    python3 bench/cuda_splitk.py [--out DIR] [--carveout]

--carveout (run 98): both kernels ask for the largest shared-memory carveout.
--ncu (run 99): only a few eager launches of both kernels, for Nsight Compute.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from cuda_driver import CudaModule  # noqa: E402
from bench_gpu import STEPS, TOKENS, log, make_inputs, maxdiff, time_graphed  # noqa: E402
from kernel_ladder import CAMERA_NAMES, bench_run, time_denoise  # noqa: E402

from vlaserve.checkpoint.weights import random_model  # noqa: E402
from vlaserve.config import ModelConfig, PolicyConfig  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

SOURCE = r"""
#include <mma.h>
#include <cuda_bf16.h>
using namespace nvcuda;

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void wait_pending(int n) {  // at most n newest groups still in flight
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
  }
}

template <int KS, bool PRELOAD, int WARPS>
__device__ void splitk(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                       float* __restrict__ out, int R, int N, int sx, int sw) {
  constexpr int BN = 32, LD = KS + 8, XG = 256, GROUPS = KS / XG, THREADS = 32 * WARPS;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* ws = reinterpret_cast<__nv_bfloat16*>(smem);  // [BN][LD]
  __nv_bfloat16* xs = ws + BN * LD;                              // [64][LD]
  const int col0 = blockIdx.x * BN, split = blockIdx.y, k0 = split * KS, tid = threadIdx.x;
  // Copy loops with compile-time trip counts and strides (run 100): each thread's row and column
  // follow from tid by constants, so the loops unroll into address increments.
  if (!PRELOAD) asm volatile("griddepcontrol.wait;" ::: "memory");
#pragma unroll
  for (int it = 0; it < BN * KS / 8 / THREADS; ++it) {
    const int i = tid + it * THREADS, r = i / (KS / 8), c = (i % (KS / 8)) * 8;
    cp_async16(ws + r * LD + c, w + (size_t)(col0 + r) * sw + k0 + c, 16);
  }
  commit();
  if (PRELOAD) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
    for (int it = 0; it < 64 * XG / 8 / THREADS; ++it) {
      const int i = tid + it * THREADS, r = i / (XG / 8), c = g * XG + (i % (XG / 8)) * 8;
      const bool live = r < R;
      cp_async16(xs + r * LD + c, live ? (const void*)(x + (size_t)r * sx + k0 + c) : (const void*)x, live ? 16 : 0);
    }
    commit();
  }
  // Each warp covers every row (4 x 16) and both 16-column halves over every WARPS-th 16-wide K
  // step: 8 independent accumulators a warp, so the tensor cores' latency overlaps; the warps'
  // sums are added in warp order at the end.
  const int warp = tid / 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i) { wmma::fill_fragment(acc[i][0], 0.0f); wmma::fill_fragment(acc[i][1], 0.0f); }
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) {
    wait_pending(GROUPS - 1 - g);  // the weights and x groups 0..g have landed
    __syncthreads();
#pragma unroll
    for (int step = 0; step < XG / 16 / WARPS; ++step) {
      const int kk = g * XG + (step * WARPS + warp) * 16;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b0, b1;
      wmma::load_matrix_sync(b0, ws + kk, LD);
      wmma::load_matrix_sync(b1, ws + 16 * LD + kk, LD);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::load_matrix_sync(a, xs + i * 16 * LD + kk, LD);
        wmma::mma_sync(acc[i][0], a, b0, acc[i][0]);
        wmma::mma_sync(acc[i][1], a, b1, acc[i][1]);
      }
    }
  }
  __syncthreads();  // every warp is done with ws / xs: stage the warps' tiles there
  float* stage = reinterpret_cast<float*>(smem);  // [WARPS][64][BN]
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    wmma::store_matrix_sync(stage + (warp * 64 + i * 16) * BN, acc[i][0], BN, wmma::mem_row_major);
    wmma::store_matrix_sync(stage + (warp * 64 + i * 16) * BN + 16, acc[i][1], BN, wmma::mem_row_major);
  }
  __syncthreads();
  for (int i = tid; i < R * BN; i += THREADS) {
    const int r = i / BN, c = i % BN;
    float v = stage[r * BN + c];
#pragma unroll
    for (int q = 1; q < WARPS; ++q) v += stage[(q * 64 + r) * BN + c];
    out[((size_t)split * R + r) * N + col0 + c] = v;
  }
}

#define KERNEL(KS, PRE, WARPS, NAME) \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) NAME(const __nv_bfloat16* x, const __nv_bfloat16* w, \
      float* out, int R, int N, int sx, int sw) { splitk<KS, PRE, WARPS>(x, w, out, R, N, sx, sw); }
KERNEL(512, true, 4, splitk512_pre_w4)
KERNEL(1024, true, 4, splitk1024_pre_w4)
KERNEL(512, false, 4, splitk512_post_w4)
KERNEL(1024, false, 4, splitk1024_post_w4)
KERNEL(512, true, 8, splitk512_pre_w8)
KERNEL(1024, true, 8, splitk1024_pre_w8)
KERNEL(512, false, 8, splitk512_post_w8)
KERNEL(1024, false, 8, splitk1024_post_w8)
"""

SPLITS, BLOCK_N = 4, 32


class CudaSplitK:
    """The kernels above, built and loaded into the current CUDA context."""

    def __init__(self, carveout: int | None = None):
        self.module = CudaModule(SOURCE)
        self.build_log, self.build_s = self.module.build_log, self.module.build_s
        self.funcs, self.shared = {}, {}
        for ks, mode, warps in itertools.product((512, 1024), ("pre", "post"), (4, 8)):
            # the operands, or the warps' staged sums once they are consumed
            shared = max((BLOCK_N + 64) * (ks + 8) * 2, warps * 64 * BLOCK_N * 4)
            # carveout (run 98): one shared-memory carveout for both sizes
            self.funcs[ks, mode, warps] = self.module.function(f"splitk{ks}_{mode}_w{warps}", shared, carveout)
            self.shared[ks, warps] = shared
        self.mode, self.pdl, self.warps = "pre", True, 4

    def supports(self, x2d: torch.Tensor, w: torch.Tensor) -> bool:
        r, k = x2d.shape
        return (r <= 64 and w.shape[0] % BLOCK_N == 0 and k % SPLITS == 0 and k // SPLITS in (512, 1024)
                and x2d.stride(1) == 1 and w.stride(1) == 1 and x2d.dtype == w.dtype == torch.bfloat16)

    def partials(self, x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        r, k = x2d.shape
        n, ks = w.shape[0], k // SPLITS
        out = torch.empty(SPLITS, r, n, dtype=torch.float32, device=x2d.device)
        args = [ctypes.c_void_p(x2d.data_ptr()), ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int(r), ctypes.c_int(n), ctypes.c_int(x2d.stride(0)), ctypes.c_int(w.stride(0))]
        self.module.launch(self.funcs[ks, self.mode, self.warps], (n // BLOCK_N, SPLITS, 1), 32 * self.warps,
                           self.shared[ks, self.warps], args, pdl=self.pdl)
        return out


def ncu_target():
    """--ncu (run 99): three eager launches each of Triton's and this split-K kernel at o's and down's
    shapes, for `ncu -k regex:splitk` to profile (nothing timed, nothing saved)."""
    ops = CudaSplitK()
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1024, 2048), (1024, 4096)):
        x = torch.randn(50, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        for _ in range(3):
            kernels.splitk_partials(x, w)
            ops.partials(x, w)
    torch.cuda.synchronize()


def main():
    started = time.time()
    args, results, save = bench_run("cuda_splitk", {
        "carveout": "both kernels ask for the largest shared-memory carveout (run 98)",
        "ncu": "only a few eager launches of both kernels, for Nsight Compute (run 99); nothing saved"})
    if args.ncu:
        return ncu_target()
    carveout = 100 if args.carveout else None
    results["carveout"] = carveout
    ops = CudaSplitK(carveout)
    results["build_s"], results["ptxas"] = ops.build_s, ops.build_log[-2000:]
    log(f"built in {ops.build_s:.1f}s\n{ops.build_log[-1200:]}")

    # 1. Partial sums against torch's fp32 product (fresh random inputs; the outputs are not
    # poisoned, so an unwritten element shows only as a wrong sum: the denoise graph below checks too).
    g = torch.Generator(device="cuda").manual_seed(0)
    checks = {}
    for name, (n, k) in {"o": (1024, 2048), "down": (1024, 4096)}.items():
        x = torch.randn(50, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        ref = x.float() @ w.float().T
        for mode, warps in itertools.product(("pre", "post"), (4, 8)):
            ops.mode, ops.warps = mode, warps
            out = ops.partials(x, w)
            torch.cuda.synchronize()
            checks[f"{name}_{mode}_w{warps}"] = {"rel_vs_fp32": float((out.sum(0) - ref).norm() / ref.norm()),
                                        "max_vs_triton": float((out.sum(0) - kernels.splitk_partials(x, w).sum(0)).abs().max()),
                                        "finite": bool(torch.isfinite(out).all())}
    ops.mode, ops.warps = "pre", 4
    results["checks"] = checks
    log("checks:", checks)
    save()

    # 1b. (run 97) The GEMMs alone: a call's 360 o/down launches (18 layers of random weights, so
    # that they stream from HBM), in one graph, back to back: Triton's kernel against this one.
    ws = [((torch.randn(1024, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
           (torch.randn(1024, 4096, device="cuda", generator=g) * 0.02).to(torch.bfloat16)) for _ in range(18)]
    xo = torch.randn(50, 2048, device="cuda", generator=g).to(torch.bfloat16)
    xd = torch.randn(50, 4096, device="cuda", generator=g).to(torch.bfloat16)

    def chain(partials):
        for _ in range(STEPS):
            for wo, wd in ws:
                partials(xo, wo)
                partials(xd, wd)

    alone = results["gemms_alone_ms"] = {"triton": time_graphed(lambda: chain(kernels.splitk_partials))["p50_ms"]}
    for mode, pdl, warps in (("pre", True, 4), ("post", True, 4), ("pre", False, 4), ("pre", True, 8),
                             ("post", True, 8)):
        ops.mode, ops.pdl, ops.warps = mode, pdl, warps
        alone[f"cuda_{mode}_pdl{int(pdl)}_w{warps}"] = time_graphed(lambda: chain(ops.partials))["p50_ms"]
    ops.mode, ops.pdl, ops.warps = "pre", True, 4
    weight_bytes = sum(t.numel() * t.element_size() for pair in ws for t in pair)
    results["gemms_alone_floor_ms"] = STEPS * weight_bytes / 4.1e9  # the weights once at 4.1 TB/s
    log("the 360 o/down GEMMs alone, ms:", alone)
    save()

    # 2. The denoise graph at batch 1, split-K through the CUDA kernel where it applies.
    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    runner = FastRunner(model, PolicyConfig(cfg, CAMERA_NAMES, 14, 14), use_graphs=False)
    inputs, noise = make_inputs(1, cfg.vlm.vocab_size, seed=1)
    runner.sample(inputs, noise, STEPS, None)
    fast, buf = runner.fast, runner.buffers(1, TOKENS)
    triton_partials = kernels.splitk_partials

    def through_cuda(x2d, w):
        return ops.partials(x2d, w) if ops.supports(x2d, w) else triton_partials(x2d, w)

    base_ms, base_out = time_denoise(fast, buf)
    rows = results["denoise_b1"] = [{"label": "committed (Triton split-K)", "ms": base_ms}]
    log(f"committed denoise b1 {base_ms:.3f} ms")
    kernels.splitk_partials = through_cuda
    try:
        for label, mode, pdl, warps in (("CUDA, weights before the wait", "pre", True, 4),
                                        ("CUDA, weights after the wait", "post", True, 4),
                                        ("CUDA, weights before the wait, no PDL attribute", "pre", False, 4),
                                        ("CUDA, 8 warps, weights before the wait", "pre", True, 8),
                                        ("CUDA, 8 warps, weights after the wait", "post", True, 8),
                                        ("CUDA, weights before the wait (again)", "pre", True, 4)):
            ops.mode, ops.pdl, ops.warps = mode, pdl, warps
            ms, out = time_denoise(fast, buf)
            rows.append({"label": label, "ms": ms, "vs_committed": maxdiff(out, base_out),
                         "finite": bool(torch.isfinite(out).all())})
            log(f"{label}: {ms:.3f} ms (committed {base_ms:.3f}), vs committed {rows[-1]['vs_committed']:.2e}")
            save()
    finally:
        kernels.splitk_partials = triton_partials
    again_ms, _ = time_denoise(fast, buf)
    rows.append({"label": "committed again", "ms": again_ms})
    results["elapsed_s"] = time.time() - started
    log(f"committed again {again_ms:.3f} ms; done in {results['elapsed_s']:.0f}s")
    save()


if __name__ == "__main__":
    main()
