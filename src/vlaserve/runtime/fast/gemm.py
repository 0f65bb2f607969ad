"""A persistent TMA GEMM with the activation in its epilogue, for the prefix's large-M linears.

cuBLAS runs the prefix's GEMMs near the ceiling, but the activation after each is another pass over
the output: Gemma's gate_up output (at batch 8, 6912 x 32768 bf16 = 453 MB a layer) is written,
read back for the GeGLU and half of it written again; SigLIP's fc1 output likewise for its GELU.
Here one program keeps the gate and the up tile of the same output columns side by side, and the
GeGLU (or bias + GELU) runs on the accumulators before the one store. Tiles are visited in
grouped order by one program per SM; operands come in through TMA descriptors.

The rounding points are the eager path's: every GEMM output is rounded to the model dtype before
the activation, whose result is rounded again (the fp32 sums' order differs from cuBLAS's, so an
element can differ by one bf16 unit, as between two GEMM libraries).
"""

from __future__ import annotations

import torch

from . import kernels

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .kernels import gelu_tanh
except ImportError:  # CPU-only installs: the prefix then uses cuBLAS and the separate passes
    triton = None

ACTIVATIONS = {"none": 0, "gelu": 1, "geglu": 2}

if triton is not None:

    @triton.jit
    def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        # GROUP_M row tiles take each column tile in turn, so its weights are read from HBM once
        # per group and from L2 after.
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        rows = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % rows, (tile % per_group) // rows

    @triton.jit
    def _gemm_act(x_desc, w_desc, bias_ptr, out_desc, M, N, K, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PROGRAMS: tl.constexpr, WS_TILES: tl.constexpr, WS_K: tl.constexpr):
        # out[M, N] = act(x[M, K] @ w^T): w [N, K], or for the GeGLU w = [gate; up] [2N, K].
        dt = out_desc.dtype
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True, warp_specialize=WS_TILES):
            pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS_K):
                x = x_desc.load([off_m, k0])
                acc = tl.dot(x, w_desc.load([off_n, k0]).T, acc)
                if ACT == 2:
                    acc_up = tl.dot(x, w_desc.load([N + off_n, k0]).T, acc_up)
            if HAS_BIAS:
                cols = off_n + tl.arange(0, BLOCK_N)
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            if ACT == 0:
                y = acc
            elif ACT == 1:
                y = gelu_tanh(acc.to(dt).to(tl.float32))
            else:
                gate = gelu_tanh(acc.to(dt).to(tl.float32))
                y = gate.to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
            out_desc.store([off_m, off_n], y.to(dt))


def fused_config(act: str) -> dict | None:
    """The launch config of the fused GEMM for `act` where it runs here (TUNING["prefix_gemm"]), else None."""
    cfg = kernels.TUNING["prefix_gemm"].get(act)
    return cfg if cfg is not None and available() else None


def available() -> bool:
    """TMA descriptors: Hopper (sm90) and later, or the interpreter (tests)."""
    if triton is None:
        return False
    if kernels.interpreted():
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def linear_act(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: str, cfg: dict) -> torch.Tensor:
    """act(x @ w^T + bias) in x's dtype: x [M, K]; w [N, K], or for act="geglu" [gate; up] [2N, K]
    (no bias). cfg: block_m, block_n, block_k, group_m, warps, stages."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: one of {sorted(ACTIVATIONS)}")
    if act == "geglu" and bias is not None:
        raise ValueError("the GeGLU GEMM takes no bias")
    m, k = x.shape
    n = w.shape[0] // 2 if act == "geglu" else w.shape[0]
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(tiles, _num_sms(x.device))
    _gemm_act[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        w if bias is None else bias, TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k,
        ACT=ACTIVATIONS[act], HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg["group_m"], PROGRAMS=programs, WS_TILES=cfg.get("ws") == "tiles", WS_K=cfg.get("ws") == "k",
        num_warps=cfg["warps"], num_stages=cfg["stages"])
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each over several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count
