"""Probe (issue 45): SigLIP's LayerNorm quantizing its output for the fp8 GEMMs (q/k/v, fc1).

1. Kernel level at the batch-1 and batch-8 shapes (3 cameras: 768 / 6144 rows of 1152): the LayerNorm then
   fp8_kernels.quantize_rows, against the LayerNorm quantizing its own output; device us a call from a
   CUDA graph, and the bits (e4m3 values, scales, the residual stream). The prefix's GeGLU quantizer
   (864 / 6912 rows of 16384) with its e4m3 row stored 8 values at a time (kernel_code._quantize_row now)
   against a copy of it storing one contiguous run (as at 05f44b8): the same bits, and each one's us.
2. The fp8 fast path at batch 1, 2, 4, 8 with the producers of 05f44b8 (the prefix's RMSNorm and GeGLU)
   and with SigLIP's LayerNorm too (the default now): p50, prefix, and the actions (bit-identical?).

python3 bench/probes/fp8_layer_norm.py   ($OUT/fp8_layer_norm.json)
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
from bench_gpu import CAMERAS, bucketed, served_call, stage_medians  # noqa: E402
from common import bench_model, log, make_inputs, sample, time_ms  # noqa: E402

from vlaserve.model.fp8 import E4M3, convert_to_fp8  # noqa: E402
from vlaserve.runtime.fast import fp8_kernels, kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402
from vlaserve.runtime.fast.kernel_code import _e4m3_scale, _e4m3_values, gelu_tanh  # noqa: E402

BUCKET = 96
VARIANTS = {"rms_norm+geglu": ("rms_norm", "geglu"), "+layer_norm": ("rms_norm", "geglu", "layer_norm")}


@triton.jit
def _geglu_quantized_contiguous(x_ptr, q_ptr, s_ptr, M, BLOCK: tl.constexpr):
    # 05f44b8's _geglu_quantized: its e4m3 row stored as one contiguous run (16 values a thread).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < M
    g = tl.load(x_ptr + row * 2 * M + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * M + M + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gelu_tanh(g).to(x_ptr.dtype.element_ty).to(tl.float32) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = _e4m3_scale(tl.max(tl.where(mask, tl.abs(act), 0.0), axis=0))
    tl.store(s_ptr + row, scale)
    tl.store(q_ptr + row * M + cols, _e4m3_values(act, scale).to(tl.float8e4nv), mask=mask)


def geglu_contiguous(x):
    r, m = x.shape[0], x.shape[1] // 2
    q = torch.empty(r, m, dtype=E4M3, device=x.device)
    s = torch.empty(r, 1, dtype=torch.float32, device=x.device)
    _geglu_quantized_contiguous[(r,)](x, q, s, m, BLOCK=triton.next_power_of_2(m),
                                      num_warps=fp8_kernels.geglu_warps(m), **kernels.launch_options())
    return q, s


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Device time a call, from a CUDA graph of `calls` back-to-back calls."""
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


def same(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def kernel_level(results: dict) -> None:
    for b in (1, 8):
        g = torch.Generator(device="cuda").manual_seed(b)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

        rows, width = b * CAMERAS * 256, 1152
        h, delta = randn(rows, width), randn(rows, width, scale=3.0)
        w = torch.rand(width, device="cuda", generator=g) + 0.5
        bias = torch.randn(width, device="cuda", generator=g) * 0.1

        def norm(quantize):
            return kernels.residual_layer_norm(h, w, bias, 1e-6, delta=delta, quantize=quantize)

        h0 = h.clone()
        plain = fp8_kernels.quantize_rows(norm(False))
        h_plain = h.clone()
        h.copy_(h0)
        fused = norm(True)
        row = {"bits_equal": same((fused.q, fused.scale), plain), "residual_equal": torch.equal(h, h_plain),
               "separate_us": graph_us(lambda: fp8_kernels.quantize_rows(norm(False))),
               "norm_alone_us": graph_us(lambda: norm(False)), "fused_us": graph_us(lambda: norm(True))}
        results["kernels"][f"b{b} layer_norm {rows}x{width}"] = row
        log(f"b{b} layer_norm {rows}x{width}", row)

        rows, width = b * (CAMERAS * 256 + BUCKET), 16384
        x = randn(rows, 2 * width, scale=2.0)
        x[0] = 0
        now = fp8_kernels.geglu_quantized(x)
        row = {"bits_equal": same((now.q, now.scale), geglu_contiguous(x)),
               "runs_of_8_us": graph_us(lambda: fp8_kernels.geglu_quantized(x)),
               "contiguous_us": graph_us(lambda: geglu_contiguous(x))}
        results["kernels"][f"b{b} geglu {rows}x{width}"] = row
        log(f"b{b} geglu {rows}x{width}", row)


def calls(results: dict) -> None:
    model, cfg = bench_model(False, "cuda")
    convert_to_fp8(model)
    engines = {}
    for name, producers in VARIANTS.items():
        engines[name] = FastRunner(model, cfg)
        engines[name].fast.quantizing_producers = frozenset(producers)
    for b in (1, 2, 4, 8):
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        short = bucketed(inputs, BUCKET)
        row = {}
        for name, engine in engines.items():
            actions = sample(engine, short, noise, vision_slots=CAMERAS)[0].cpu()  # captures this size
            t = time_ms(lambda: served_call(engine, short, noise), "cuda", warmup=3, iters=20)
            row[name] = {"p50_ms": t["p50_ms"], **stage_medians(engine, short, noise), "actions": actions}
        base = row["rms_norm+geglu"]["actions"]
        for name in VARIANTS:
            a = row[name].pop("actions")
            row[name]["bit_identical"] = bool(torch.equal(a, base))
            row[name]["max_abs_diff"] = float((a - base).abs().max())
        results["calls"][b] = row
        log(f"b{b}", json.dumps(row))
    for b in (1, 8):  # the two again, in the other order: the p50s' drift
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        short = bucketed(inputs, BUCKET)
        again = {name: time_ms(lambda: served_call(engines[name], short, noise), "cuda", warmup=3, iters=20)["p50_ms"]
                 for name in reversed(VARIANTS)}
        results["calls"][f"b{b} again"] = again
        log(f"b{b} again", again)


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(), "kernels": {}, "calls": {}}
    out = Path(os.environ.get("OUT", "."))
    try:
        kernel_level(results)
        calls(results)
    finally:
        (out / "fp8_layer_norm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
