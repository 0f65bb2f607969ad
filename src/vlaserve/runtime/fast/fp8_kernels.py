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
    from .kernel_code import _quantize_rows


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
