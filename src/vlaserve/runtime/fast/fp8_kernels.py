"""The fast path's fp8 activation quantization as one Triton kernel.

model/fp8.py's `quantize_rows` in torch makes five passes over the activations (|x|, the row amax,
an fp32 copy, the division, the clamp) before the cast; at batch 8 the prefix's GEMM inputs are
~170 M values per layer, so those passes would cost more than the fp8 GEMMs save. Here a program
takes a row: its amax, then its scale and rounding, from registers when the row fits a block (else
read twice, the second time mostly from L2), and writes the e4m3 row and its scale once: the same
numbers, bit for bit (fp32 division rounded to nearest, then rounded to e4m3 to nearest even,
subnormals kept, saturating at 448, as torch's cast). The rounding is done in fp32 arithmetic, so
the cast itself is exact: Triton's interpreter (the CPU tests) rounds fp8 casts otherwise than the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.fp8 import E4M3, E4M3_MAX
from .kernels import launch_options, triton

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
    def _quantize_rows(x_ptr, q_ptr, s_ptr, static_ptr, M, K, stride_x, STATIC: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
        cols = tl.arange(0, BLOCK)[None, :]
        if STATIC:
            scale = tl.zeros([ROWS], dtype=tl.float32) + tl.load(static_ptr).to(tl.float32)
        if ONE_PASS:  # K <= BLOCK: the rows stay in registers from their amax to their rounding
            mask = row_ok[:, None] & (cols < K)
            v = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            if not STATIC:
                row_max = tl.max(tl.abs(v), axis=1)
                scale = tl.where(row_max > 0, tl.math.div_rn(row_max, 448.0), 1.0)
            tl.store(s_ptr + rows, scale, mask=row_ok)
            q = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -448.0), 448.0))
            tl.store(q_rows + cols, q.to(tl.float8e4nv), mask=mask)
        else:  # a wide row: its amax, then its rounding, reading it again (mostly from L2)
            if not STATIC:
                amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
                for k0 in range(0, K, BLOCK):
                    mask = row_ok[:, None] & (k0 + cols < K)
                    v = tl.load(x_rows + k0 + cols, mask=mask, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(v))
                row_max = tl.max(amax, axis=1)
                scale = tl.where(row_max > 0, tl.math.div_rn(row_max, 448.0), 1.0)
            tl.store(s_ptr + rows, scale, mask=row_ok)
            for k0 in range(0, K, BLOCK):
                mask = row_ok[:, None] & (k0 + cols < K)
                v = tl.load(x_rows + k0 + cols, mask=mask, other=0.0).to(tl.float32)
                q = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -448.0), 448.0))
                tl.store(q_rows + k0 + cols, q.to(tl.float8e4nv), mask=mask)


@dataclass(frozen=True)
class QuantizerConfig:
    """How `_quantize_rows` splits [M, K]: ROWS rows a program, BLOCK columns a step, one pass over
    the row (K <= BLOCK) or two."""

    rows: int
    block: int
    one_pass: bool
    num_warps: int


# Rows up to which a quantization is latency-bound (batch 1-2 of the prefix: 768-1728 rows), where
# more warps a row pay; past it (batch 4-8) fewer, and more rows resident at once.
FEW_ROWS = 2048


def quantizer_config(m: int, k: int) -> QuantizerConfig:
    """The split for [M, K] (every split computes the same bits). Measured on the H200 inside CUDA
    graphs, the way the fast path runs them (run 172, `7bbc5e0:bench/probes/fp8_quantizer.py`), for
    SigLIP's widths 1152 / 4304 and Gemma's 2048 / 16384 at batch 1 and 8: one pass for rows up to
    2048 wide; 1024-column steps for 4304 (a 4096 step computes a mostly empty second block: 48.7
    against 88.4 us at 6144 rows); a 16384-wide row in one pass only while rows are few."""
    block = triton.next_power_of_2(k)
    few = m <= FEW_ROWS
    if block <= 2048:
        return QuantizerConfig(rows=1, block=block, one_pass=True, num_warps=8 if few else 2)
    if block <= 8192:
        return QuantizerConfig(rows=1, block=1024, one_pass=False, num_warps=8 if few else 4)
    if few and block <= 16384:
        return QuantizerConfig(rows=1, block=block, one_pass=True, num_warps=16)
    return QuantizerConfig(rows=1, block=4096, one_pass=False, num_warps=8)


def quantize_rows(x2d: torch.Tensor, static_scale: torch.Tensor | None = None,
                  config: QuantizerConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """model.fp8.quantize_rows in one kernel: [M, K] (rows contiguous) -> (e4m3 [M, K], fp32 [M, 1]).
    `config`: the split (default quantizer_config's; every one gives the same bits)."""
    assert E4M3_MAX == 448.0  # the kernel's constant
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    config = config or quantizer_config(m, k)
    q = torch.empty(m, k, dtype=E4M3, device=x2d.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2d.device)
    static = scale if static_scale is None else static_scale
    _quantize_rows[(triton.cdiv(m, config.rows),)](
        x2d, q, scale, static, m, k, x2d.stride(0), STATIC=static_scale is not None, ROWS=config.rows,
        BLOCK=config.block, ONE_PASS=config.one_pass, num_warps=config.num_warps, **launch_options())
    return q, scale
