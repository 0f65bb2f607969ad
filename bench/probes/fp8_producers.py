"""Probe (issue 45): fp8 GEMM inputs quantized by the kernels that produce them, one producer at a time.

1. Kernel level, at the batch-1 and batch-8 shapes (3 cameras, 96-token bucket): the prefix's RMSNorm
   (2048) and GeGLU (16384): the producer then fp8_kernels.quantize_rows, against the producer quantizing
   its own output (the GeGLU at several warp counts); device us a call from a CUDA graph, and the bits.
2. The fp8 fast path at batch 1, 2, 4, 8 with no producer quantizing, the norms, the GeGLU, and both
   (the default): p50, prefix, and the actions against the first (bit-identical?).
3. A kernel profile of the fp8 call at batch 1 and 8, both producers quantizing.

Run 254 (the first version, at the parent commit's tree) also had SigLIP's LayerNorm and GELU quantize
theirs: the LayerNorm's bits differed from the separate quantizer's, and the GELU's one pass was no faster.

python3 bench/probes/fp8_producers.py   ($OUT/fp8_producers.json)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import CAMERAS, bucketed, profile_kernels, served_call, stage_medians  # noqa: E402
from common import bench_model, log, make_inputs, sample, time_ms  # noqa: E402

from vlaserve.model.fp8 import convert_to_fp8  # noqa: E402
from vlaserve.runtime.fast import fp8_kernels, kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

BUCKET = 96
VARIANTS = {"none": (), "rms_norm": ("rms_norm",), "geglu": ("geglu",), "both": ("rms_norm", "geglu")}


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


def same(fused, ref) -> bool:
    return torch.equal(fused.q.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(fused.scale, ref[1])


def kernel_level(results: dict) -> None:
    for b in (1, 8):
        gemma = b * (CAMERAS * 256 + BUCKET)
        g = torch.Generator(device="cuda").manual_seed(b)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

        rows, width = gemma, 2048  # the prefix's RMSNorm, with a residual delta as in the layers
        h, delta, w = randn(rows, width), randn(rows, width, scale=3.0), randn(width).abs() + 0.5

        def norm(quantize):
            return kernels.residual_norm(h, w, delta=delta, eps=1e-6, quantize=quantize)

        h0 = h.clone()  # the bits from the same h: the residual add is in place
        plain = fp8_kernels.quantize_rows(norm(False))
        h.copy_(h0)
        bits = same(norm(True), plain)
        row = {"separate_us": graph_us(lambda: fp8_kernels.quantize_rows(norm(False))),
               "norm_alone_us": graph_us(lambda: norm(False)), "fused_us": graph_us(lambda: norm(True)),
               "bits_equal": bits}
        results["kernels"][f"b{b} rms_norm {rows}x{width}"] = row
        log(f"b{b} rms_norm {rows}x{width}", row)
        width = 16384
        x = randn(rows, 2 * width, scale=2.0)
        x[0] = 0
        plain = fp8_kernels.quantize_rows(kernels.geglu(x))
        row = {"separate_us": graph_us(lambda: fp8_kernels.quantize_rows(kernels.geglu(x))),
               "geglu_alone_us": graph_us(lambda: kernels.geglu(x)), "default_warps": fp8_kernels.geglu_warps(width)}
        for warps in (8, 16, 32):
            row[f"fused_w{warps}"] = {"us": graph_us(lambda: fp8_kernels.geglu_quantized(x, warps)),
                                     "bits_equal": same(fp8_kernels.geglu_quantized(x, warps), plain)}
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
        base = row["none"]["actions"]
        for name in VARIANTS:
            a = row[name].pop("actions")
            row[name]["bit_identical"] = bool(torch.equal(a, base))
            row[name]["max_abs_diff"] = float((a - base).abs().max())
        results["calls"][b] = row
        log(f"b{b}", json.dumps(row))
    for b in (1, 8):
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        log(f"profile b{b}, both producers quantizing")
        results[f"profile_b{b}"] = profile_kernels(engines["both"], bucketed(inputs, BUCKET), noise)


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(), "kernels": {}, "calls": {}}
    out = Path(os.environ.get("OUT", "."))
    try:
        kernel_level(results)
        if "--kernels-only" not in sys.argv:
            calls(results)
    finally:
        (out / "fp8_producers.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
