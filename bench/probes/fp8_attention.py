"""Probe (issue 45): the prefix's attention quantizing its output for the fp8 o projection.

1. Kernel level at the batch-1 and batch-8 shapes (864 / 6912 query tokens of 8 heads x 256, the default
   bucket with 3 cameras): kernels.mqa_attention then fp8_kernels.quantize_rows, against the attention
   quantizing its own output (q token-major, each program every head of its tokens); device us a call
   from a CUDA graph, and the bits (e4m3 values and scales). (Run 263 ran this with the head-major q
   given to both, which made its bits_equal false by construction; its timings are the same work.)
2. The fp8 fast path at batch 1, 2, 4, 8 with the producers before (RMSNorm, GeGLU, LayerNorm) and with the
   attention too (the default now): p50, stages, and the actions (bit-identical?).

python3 bench/probes/fp8_attention.py   ($OUT/fp8_attention.json)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import CAMERAS, bucketed, served_call, stage_medians  # noqa: E402
from common import bench_model, log, make_inputs, sample, time_ms  # noqa: E402

from vlaserve.model.fp8 import convert_to_fp8  # noqa: E402
from vlaserve.runtime.fast import fp8_kernels, kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

BUCKET = 96
VARIANTS = {"norms+geglu": ("rms_norm", "geglu", "layer_norm"),
            "+attention": ("rms_norm", "geglu", "layer_norm", "attention")}


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


def kernel_level(results: dict) -> None:
    heads, d = 8, 256
    tokens = CAMERAS * 256 + BUCKET
    for b in (1, 8):
        g = torch.Generator(device="cuda").manual_seed(b)
        q = torch.randn(b, heads * tokens, d, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(b, tokens, d, device="cuda", generator=g).to(torch.bfloat16)
        v = (torch.randn(b, tokens, d, device="cuda", generator=g) * 2).to(torch.bfloat16)
        bias = torch.zeros(b, tokens, device="cuda")
        bias[:, tokens - 26:] = -3.0e38  # the prompt's padding
        cfg = kernels.prefix_attention_config(b)

        token_major = q.unflatten(1, (heads, tokens)).transpose(1, 2).reshape(q.shape)  # q_token_major's q

        def attention(quantize):
            return kernels.mqa_attention(token_major if quantize else q, k, v, bias, heads, tokens, cfg,
                                         quantize=quantize)

        plain = fp8_kernels.quantize_rows(attention(False).view(b * tokens, -1))
        fused = attention(True)
        row = {"bits_equal": bool(torch.equal(fused.q.view(torch.uint8), plain[0].view(torch.uint8))
                                  and torch.equal(fused.scale, plain[1])),
               "separate_us": graph_us(lambda: fp8_kernels.quantize_rows(attention(False).view(b * tokens, -1))),
               "attention_alone_us": graph_us(lambda: attention(False)), "fused_us": graph_us(lambda: attention(True))}
        results["kernels"][f"b{b} attention {b * tokens} tokens"] = row
        log(f"b{b} attention", row)


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
        base = row["norms+geglu"]["actions"]
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
        (out / "fp8_attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
