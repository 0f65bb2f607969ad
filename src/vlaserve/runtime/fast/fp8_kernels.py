"""The fast path's fp8 activation quantization as one Triton kernel.

model/fp8.py's `quantize_rows` in torch makes five passes over the activations (|x|, the row amax,
an fp32 copy, the division, the clamp) before the cast; at batch 8 the prefix's GEMM inputs are
~170 M values per layer, so those passes would cost more than the fp8 GEMMs save. Here one program
per row reads it twice (amax, then scale and cast; the second read mostly from L2) and writes the
e4m3 row and its scale once: the same numbers, bit for bit (fp32 division rounded to nearest, then
rounded to e4m3 to nearest even, subnormals kept, saturating at 448, as torch's cast). The rounding
is done in fp32 arithmetic, so the cast itself is exact: Triton's interpreter (the CPU tests) rounds
fp8 casts otherwise than the GPU.
"""

from __future__ import annotations

import torch

from ...model.fp8 import E4M3, E4M3_MAX
from .kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _round_e4m3(y):
        """fp32 y, |y| <= 448 -> the nearest e4m3 value (ties to even), as fp32, its sign kept (-0
        too, as torch's cast). The step is 2^(e - 3) for |y| in [2^e, 2^(e+1)), and 2^-9 below 2^-6
        (subnormals); |y| / step is then below 16, where adding and subtracting 1.5 * 2^23 rounds it
        to an integer, ties to even."""
        bits = y.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
        rounded = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
        # y's sign bit onto |result| by bits: on the H200 `where(bits < 0, -rounded, rounded)` gave +0
        # for negatives that round to zero, where torch's cast gives -0 (2026-12-04).
        sign = (bits >> 31) << 31
        return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_rows(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, STATIC: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * K
        cols = tl.arange(0, BLOCK)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                v = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            row_max = tl.max(amax, axis=0)
            scale = tl.where(row_max > 0, tl.math.div_rn(row_max, 448.0), 1.0)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            v = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            q = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))
            tl.store(q_row + k0 + cols, q.to(tl.float8e4nv), mask=mask)


def quantize_rows(x2d: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """model.fp8.quantize_rows in one kernel: [M, K] (rows contiguous) -> (e4m3 [M, K], fp32 [M, 1])."""
    assert E4M3_MAX == 448.0  # the kernel's constant
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    q = torch.empty(m, k, dtype=E4M3, device=x2d.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2d.device)
    static = scale if static_scale is None else static_scale
    _quantize_rows[(m,)](x2d, q, scale, static, k, x2d.stride(0), STATIC=static_scale is not None,
                         BLOCK=min(4096, triton.next_power_of_2(k)), num_warps=4)
    return q, scale
