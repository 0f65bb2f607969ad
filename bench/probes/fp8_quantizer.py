"""Probe (issue 45): the fp8 activation quantizer's split per shape, and what it is worth in a call.

1. Every [M, K] the prefix and SigLIP quantize at batch 1 and 8 (default bucket 96): the kernel as it
   was (one row a program, two passes) against candidate splits, each checked bit for bit.
   (--sweep; run 172)
2. The fp8 fast path at batch 1, 2, 4, 8 with the quantizer kernel before every fp8 GEMM and with
   the producing kernels quantizing (FastPi05.fused_quantization): p50, prefix, actions bit-identical.
   (Run 173 compared the old split with quantizer_config's the same way.)
3. A kernel profile of the fp8 call at batch 1 and 8 (fused).

python3 bench/probes/fp8_quantizer.py [--sweep]   (H200)
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
from vlaserve.runtime.fast import fp8_kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

Config = fp8_kernels.QuantizerConfig
BUCKET = 96
NEW = fp8_kernels.quantizer_config


def legacy(m: int, k: int) -> Config:
    return Config(1, min(4096, 1 << (k - 1).bit_length()), False, 4)


def candidates(k: int) -> list[Config]:
    block = 1 << (k - 1).bit_length()
    out = []
    for rows in (1, 2, 4, 8, 16):
        if rows * block <= 16384:
            for warps in (2, 4, 8, 16, 32):
                if block // (32 * warps) <= 64:  # at most 64 values a thread
                    out.append(Config(rows, block, True, warps))
    for b in (1024, 2048, 4096):
        for rows in (1, 2, 4):
            for warps in (4, 8):
                out.append(Config(rows, b, False, warps))
    return out


def kernel_us(x, config, calls: int = 20, replays: int = 10) -> float:
    """Device time a call, from a CUDA graph of `calls` back-to-back calls (a lone launch measures the host)."""
    fp8_kernels.quantize_rows(x, None, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fp8_kernels.quantize_rows(x, None, config)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def sweep(results: dict) -> None:
    vision, gemma = CAMERAS * 256, CAMERAS * 256 + BUCKET
    for b in (1, 8):
        for m, k in ((b * vision, 1152), (b * vision, 4304), (b * gemma, 2048), (b * gemma, 16384)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
            q0, s0 = fp8_kernels.quantize_rows(x, None, legacy(m, k))
            rows = []
            for config in [legacy(m, k), NEW(m, k), *candidates(k)]:
                q, s = fp8_kernels.quantize_rows(x, None, config)
                same = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
                rows.append({"config": config.__dict__, "us": kernel_us(x, config), "bits_equal": same})
            best = min(rows[2:], key=lambda r: r["us"])
            key = f"{m}x{k}"
            results["sweep"][key] = {"legacy_us": rows[0]["us"], "default_us": rows[1]["us"], "best": best,
                                     "all_bits_equal": all(r["bits_equal"] for r in rows), "rows": rows}
            log(key, "legacy", round(rows[0]["us"], 1), "default", round(rows[1]["us"], 1), "best",
                round(best["us"], 1), best["config"], "bits equal:", results["sweep"][key]["all_bits_equal"])


def engines_of(model, cfg, variants: dict) -> dict:
    """{name: FastRunner} with each variant's setup applied before its graphs are captured."""
    engines = {}
    for name, setup in variants.items():
        engines[name] = FastRunner(model, cfg)
        setup(engines[name])
        for b in (1, 2, 4, 8):
            inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
            sample(engines[name], bucketed(inputs, BUCKET), noise, vision_slots=CAMERAS)  # captures now
    return engines


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(), "sweep": {}, "calls": {}}
    out = Path(os.environ.get("OUT", "."))
    if "--sweep" in sys.argv:
        sweep(results)
    model, cfg = bench_model(False, "cuda")
    convert_to_fp8(model)

    def unfused(engine):
        engine.fast.fused_quantization = False

    # run 173 compared the quantizer's splits (legacy vs quantizer_config); this, the fused producers
    engines = engines_of(model, cfg, {"unfused": unfused, "fused": lambda engine: None})
    for b in (1, 2, 4, 8):
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        short = bucketed(inputs, BUCKET)
        row = {}
        for name, engine in engines.items():
            t = time_ms(lambda: served_call(engine, short, noise), "cuda", warmup=3, iters=20)
            row[name] = {"p50_ms": t["p50_ms"], **stage_medians(engine, short, noise),
                         "actions": sample(engine, short, noise, vision_slots=CAMERAS)[0].cpu()}
        a, b_ = row["unfused"].pop("actions"), row["fused"].pop("actions")
        row["bit_identical"], row["max_abs_diff"] = torch.equal(a, b_), float((a - b_).abs().max())
        results["calls"][b] = row
        log(f"b{b}", json.dumps(row))
    for b in (1, 8):
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        log(f"profile b{b}")
        results[f"profile_b{b}"] = profile_kernels(engines["fused"], bucketed(inputs, BUCKET), noise)
    (out / "fp8_quantizer.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
