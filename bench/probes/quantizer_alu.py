"""Probe (issue 45): is the fp8 GeGLU quantizer bound by its arithmetic rather than its bytes?

At batch 8 `_geglu_quantized` takes ~272 us a layer on an H100 (run 255), against ~169 us for its bytes (566 MB
at 3.35 TB/s). Variants with the same loads and stores, each dropping part of the arithmetic (their bits differ
on purpose; only their times matter), in CUDA graphs at 864 and 6912 rows of 16384:
  now          the kernel as served (GELU with an IEEE division, the quantizer's IEEE division v / scale)
  mul_recip    v * (1 / scale) instead of the division (one reciprocal a row)
  markstein    v * r corrected by one FMA step (r = 1 / scale correctly rounded): q + (v - q * scale) * r
  fast_gelu    GELU's 2 / (1 + e) as an approximate division
  no_gelu      act = g * u
  no_quantize  act stored as a plain cast to e4m3 (the amax still taken)
The served kernels (this tree) divide by Markstein's correction (kernel_code._e4m3_values); `now` and `div_rn`
are the IEEE division they replace, so their bits_equal is the exactness check on the GPU; then the
quantize_rows kernel at SigLIP's / Gemma's widths, and every bfloat16 value at many row scales (adversarial).

python3 bench/probes/quantizer_alu.py   ($OUT/quantizer_alu.json)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import log  # noqa: E402

from vlaserve.model.fp8 import E4M3  # noqa: E402
from vlaserve.runtime.fast import fp8_kernels  # noqa: E402
from vlaserve.runtime.fast.kernel_code import _e4m3_scale, _round_e4m3, gelu_tanh  # noqa: E402

VARIANTS = {"now": 0, "mul_recip": 1, "markstein": 2, "fast_gelu": 3, "no_gelu": 4, "no_quantize": 5,
            "markstein_abs": 6}


@triton.jit
def _values(v, scale, DIVISION: tl.constexpr):
    if DIVISION == 1:
        q = v * (1.0 / scale)
    elif DIVISION == 2:
        r = tl.math.div_rn(1.0, scale)
        q0 = v * r
        q = tl.math.fma(tl.math.fma(-q0, scale, v), r, q0)
    elif DIVISION == 3:  # Markstein on |v| (the sign put back by bits: -0 stays -0), scale >= 2^-60 assumed
        a = tl.abs(v)
        r = tl.math.div_rn(1.0, scale)
        q0 = a * r
        q_abs = tl.math.fma(tl.math.fma(-q0, scale, a), r, q0)
        sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
        q = (q_abs.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        q = tl.math.div_rn(v, scale)
    return _round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))


@triton.jit
def _geglu_variant(x_ptr, q_ptr, s_ptr, M, BLOCK: tl.constexpr, VARIANT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < M
    g = tl.load(x_ptr + row * 2 * M + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * M + M + cols, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 4:
        act = g * u
    elif VARIANT == 3:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = tl.fdiv(2.0, 1.0 + tl.exp(-2.0 * inner)) - 1.0
        act = (0.5 * g * (1.0 + t)).to(x_ptr.dtype.element_ty).to(tl.float32) * u
    else:
        act = gelu_tanh(g).to(x_ptr.dtype.element_ty).to(tl.float32) * u
    y = act.to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = _e4m3_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
    tl.store(s_ptr + row, scale)
    runs_of_8 = cols // 8 * 8 + cols % 8
    if VARIANT == 5:
        out = y.to(tl.float8e4nv)
    else:
        out = _values(y, scale, 1 if VARIANT == 1 else (2 if VARIANT == 2 else (3 if VARIANT == 6 else 0))).to(
            tl.float8e4nv)
    tl.store(q_ptr + row * M + runs_of_8, out, mask=mask)


@triton.jit
def _quantize_variant(x_ptr, q_ptr, s_ptr, K, BLOCK: tl.constexpr, DIVISION: tl.constexpr):
    # one row a program, one pass (K <= BLOCK)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    v = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    scale = _e4m3_scale(tl.max(tl.abs(v), axis=0))
    tl.store(s_ptr + row, scale)
    tl.store(q_ptr + row * K + cols, _values(v, scale, DIVISION).to(tl.float8e4nv), mask=mask)


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(), "geglu": {}, "quantize": {}}
    out = Path(os.environ.get("OUT", "."))
    g = torch.Generator(device="cuda").manual_seed(0)
    width = 16384
    for rows in (864, 6912):
        x = (torch.randn(rows, 2 * width, device="cuda", generator=g) * 2).to(torch.bfloat16)
        x[:, :7] *= 1e-20  # tiny values: subnormal e4m3 and zeros
        q = torch.empty(rows, width, dtype=E4M3, device="cuda")
        s = torch.empty(rows, 1, device="cuda")
        served = fp8_kernels.geglu_quantized(x)
        row = {"served_us": graph_us(lambda: fp8_kernels.geglu_quantized(x))}
        for name, variant in VARIANTS.items():
            def run(variant=variant):
                _geglu_variant[(rows,)](x, q, s, width, BLOCK=width, VARIANT=variant, num_warps=16)
            row[f"{name}_us"] = graph_us(run)
            run()
            row[f"{name}_bits_equal"] = bool(torch.equal(q.view(torch.uint8), served.q.view(torch.uint8))
                                             and torch.equal(s, served.scale))
        results["geglu"][rows] = row
        log(f"geglu {rows}x{width}", row)
    for rows, width, warps in ((768, 1152, 8), (6144, 1152, 2), (864, 2048, 8), (6912, 2048, 2)):
        x = (torch.randn(rows, width, device="cuda", generator=g) * 3).to(torch.bfloat16)
        q = torch.empty(rows, width, dtype=E4M3, device="cuda")
        s = torch.empty(rows, 1, device="cuda")
        ref_q, ref_s = fp8_kernels.quantize_rows(x)
        row = {"served_us": graph_us(lambda: fp8_kernels.quantize_rows(x))}
        for name, division in (("div_rn", 0), ("mul_recip", 1), ("markstein", 2), ("markstein_abs", 3)):
            def run(division=division):
                _quantize_variant[(rows,)](x, q, s, width, BLOCK=triton.next_power_of_2(width), DIVISION=division,
                                           num_warps=warps)
            row[f"{name}_us"] = graph_us(run)
            run()
            row[f"{name}_bits_equal"] = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)))
        results["quantize"][f"{rows}x{width}"] = row
        log(f"quantize {rows}x{width}", row)
    results["adversarial"] = adversarial()
    log("adversarial", results["adversarial"])
    (out / "quantizer_alu.json").write_text(json.dumps(results, indent=1))


def adversarial() -> dict:
    """Every finite bfloat16 value (sign, subnormals, -0) in each row, scaled so that a row's amax is m * 2^e
    (e from -133 to 127, m random in [1, 2)): the served fp8_kernels.quantize_rows (kernel_code._e4m3_values,
    Markstein's division in this tree) against the IEEE division (division 0) and the plain Markstein
    variant (3); values whose bits differ."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    finite = bits[torch.isfinite(bits)]
    base = finite / finite.abs().max()  # |v| <= 1
    g = torch.Generator().manual_seed(1)
    powers = [(1 + torch.rand((), generator=g).item()) * 2.0 ** e for e in range(-133, 128, 2)]
    randoms = (torch.rand(64, generator=g) * 8 - 4).exp2().tolist()
    out = {}
    for division in (0, 3):
        mismatched_rows, mismatched_values = 0, 0
        for amax in powers + randoms:
            x = (base.double() * amax).to(torch.bfloat16).cuda().reshape(1, -1)
            width = x.shape[1]
            ref_q, ref_s = fp8_kernels.quantize_rows(x)
            q = torch.empty_like(ref_q)
            s = torch.empty_like(ref_s)
            _quantize_variant[(1,)](x, q, s, width, BLOCK=triton.next_power_of_2(width), DIVISION=division, num_warps=16)
            bad = int((q.view(torch.uint8) != ref_q.view(torch.uint8)).sum())
            mismatched_rows += bad > 0
            mismatched_values += bad
        out[f"division_{division}"] = {"rows": len(powers) + len(randoms), "values_a_row": int(base.numel()),
                                       "rows_mismatched": mismatched_rows, "values_mismatched": mismatched_values}
    return out


if __name__ == "__main__":
    main()
