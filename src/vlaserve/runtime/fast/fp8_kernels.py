"""The fast path's fp8 activation quantization in one Triton kernel a GEMM input.

model/fp8.py's `quantize_rows` in torch makes five passes over the activations (|x|, the row amax,
an fp32 copy, the division, the clamp) before the cast; at batch 8 the prefix's GEMM inputs are
~170 M values per layer, so those passes would cost more than the fp8 GEMMs save. Here a program
takes a row: its amax, then its scale and rounding, from registers when the row fits a block (else
read twice, the second time mostly from L2), and writes the e4m3 row and its scale once: the same
numbers, bit for bit (fp32 division rounded to nearest, then rounded to e4m3 to nearest even,
subnormals kept, saturating at 448, as torch's cast). The rounding is done in fp32 arithmetic, so
the cast itself is exact: Triton's interpreter (the CPU tests) rounds fp8 casts otherwise than the GPU.

Where the kernel producing a GEMM's input can hold its row, it quantizes the row itself with the same
rounding (kernel_code._quantize_row): the prefix's RMSNorm (kernels.residual_norm(quantize=True)), its
GeGLU (`geglu_quantized`, below) and SigLIP's LayerNorm (kernels.residual_layer_norm(quantize=True));
backends.Fp8Gemm.quantizes says for which GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.fp8 import E4M3, E4M3_MAX, QuantizedRows
from .kernels import launch_options, triton

if triton is not None:
    from .kernel_code import _geglu_quantized, _quantize_rows


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
    """The split for [M, K] (every split computes the same bits), chosen inside CUDA graphs for SigLIP's
    widths 1152 / 4304 and Gemma's 2048 / 16384 at batch 1 and 8: one pass for rows up to 2048 wide;
    1024-column steps for 4304 (a 4096 step computes a mostly empty second block); a 16384-wide row in
    one pass only while rows are few."""
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


# The widest GeGLU row quantized in one pass from registers (Gemma 2B's MLP: 16384).
GEGLU_MAX_WIDTH = 16384


def geglu_warps(width: int) -> int:
    """Warps a row for `_geglu_quantized`: 32 values a thread (at Gemma 2B's 16384, 16 warps: fewer
    leave the row's loads latency-bound, 32 contend for the row's reduction)."""
    return max(4, min(32, triton.next_power_of_2(width) // 1024))


def geglu_quantized(gate_up: torch.Tensor, num_warps: int | None = None) -> QuantizedRows:
    """gelu_tanh(gate) * up of gate_up [R, 2M] = [gate | up], quantized per row for the fp8 GEMM that
    takes it, in one kernel: e4m3 [R, M] and fp32 scales [R, 1], the bits quantize_rows gives
    kernels.geglu's output. M <= GEGLU_MAX_WIDTH; gate_up contiguous. `num_warps`: the split (every
    one gives the same bits)."""
    r, two_m = gate_up.shape
    m = two_m // 2
    if m > GEGLU_MAX_WIDTH:
        raise ValueError(f"a one-pass GeGLU quantizer takes rows up to {GEGLU_MAX_WIDTH} wide, not {m}")
    if not gate_up.is_contiguous():
        raise ValueError("a one-pass GeGLU quantizer takes contiguous rows, not strided ones")
    q = torch.empty(r, m, dtype=E4M3, device=gate_up.device)
    scale = torch.empty(r, 1, dtype=torch.float32, device=gate_up.device)
    _geglu_quantized[(r,)](gate_up, q, scale, m, BLOCK=triton.next_power_of_2(m),
                           num_warps=num_warps or geglu_warps(m), **launch_options())
    return QuantizedRows(q, scale, gate_up.dtype)
