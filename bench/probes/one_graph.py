"""Probe (issue 44): a call's prefix and Euler steps as one CUDA graph against the served two (prefix graph,
then denoise graph), bf16, on the same static buffers: the actions' bits and the call's time, device (CUDA
events) and wall (host clock, launch to synchronized), p50 over alternating rounds.

python3 bench/probes/one_graph.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import CAMERAS, STEPS, bucketed  # noqa: E402
from common import bench_model, log, make_inputs, sample  # noqa: E402

from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

BUCKET = 96


def timed(fn, iters: int) -> tuple[list[float], list[float]]:
    device, wall = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        device.append(start.elapsed_time(end))
    return device, wall


@torch.no_grad()
def main() -> None:
    model, cfg = bench_model(False, "cuda")
    engine = FastRunner(model, cfg)
    out = {}
    for b in (1, 2, 8):
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        short = bucketed(inputs, BUCKET)
        served = sample(engine, short, noise, STEPS, vision_slots=CAMERAS)[0]  # captures both graphs
        length = short.tokens.shape[1]
        buf = engine.buffers(b, length)
        prefix_graph = engine._prefix_graphs[(b, length, CAMERAS)]
        denoise_graph = engine._denoise_graphs[(b, length, STEPS, False)]
        prefix_fn, denoise_fn = engine._prefix_fn(buf, CAMERAS), engine._denoise_fn(buf, STEPS, None)
        result = {}

        def both():
            prefix_fn()
            result["actions"] = denoise_fn()

        one = engine._new_graph(both)
        two_out = {}

        def two():
            prefix_graph.replay()
            two_out["actions"] = denoise_graph.replay()

        two()
        torch.cuda.synchronize()
        two_actions = two_out["actions"].clone()
        one.replay()
        torch.cuda.synchronize()
        bits = bool(torch.equal(result["actions"], two_actions)) and bool(torch.equal(two_actions, served))
        runs = {"two graphs": ([], []), "one graph": ([], [])}
        for _ in range(4):
            for name, fn in (("two graphs", two), ("one graph", one.replay)):
                d, w = timed(fn, 20)
                runs[name][0].extend(d)
                runs[name][1].extend(w)
        out[b] = {"bit_identical": bits, **{name: {"device_p50_ms": round(statistics.median(d), 4),
                                                   "wall_p50_ms": round(statistics.median(w), 4)}
                                            for name, (d, w) in runs.items()}}
        log(f"b{b}", json.dumps(out[b]))
    log("one_graph", json.dumps(out))


if __name__ == "__main__":
    main()
