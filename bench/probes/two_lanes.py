"""Probe (issue 44, two robots): does one call's prefix beside another's Euler steps beat alternation
and batching? Two FastRunners over one model (each its own buffers, graph pool) run batch-1 calls on
their own streams at once; against them, batch 1 alone and batch 2, back to back on one stream.
Variants: both lanes at one priority; the Euler steps on a high-priority stream (they are latency-
bound, the prefix is compute-bound). Every output is compared to the serial one of the same inputs.

python3 bench/probes/two_lanes.py   (H200, full-size random Pi0.5, ALOHA-3 at the default bucket 96)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CAMERA_NAMES, HORIZON, STEPS, bench_model, log, random_prefix_inputs  # noqa: E402

from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402
from vlaserve.types import ModelInputs  # noqa: E402

TOKENS = 96
N = 40


def inputs_of(b: int, seed: int, vocab: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    prefix = random_prefix_inputs(g, b, vocab, tokens=TOKENS, valid=70)
    return ModelInputs(*prefix), torch.randn(b, HORIZON, 32, device="cuda", generator=g)


def call(runner, inputs, noise):
    out, times = runner.launch(inputs, noise, STEPS)
    return out, times


def split_call(runner, inputs, noise, pre_stream, den_stream):
    """runner._launch's steps with the prefix on one stream and the Euler steps on another."""
    b, token_len = inputs.tokens.shape
    buf = runner.buffers(b, token_len)
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with torch.cuda.stream(pre_stream):
        for name in ("images", "image_masks", "tokens", "token_mask"):
            buf[name].copy_(getattr(inputs, name))
        buf["noise"].copy_(noise)
        start.record()
        runner._prefix(buf, len(CAMERA_NAMES), True)
        mid.record()
    den_stream.wait_event(mid)
    with torch.cuda.stream(den_stream):
        out = runner._denoise(buf, STEPS, None, True)
        end.record()
    pre_stream.wait_event(end)  # the next call's inputs overwrite this one's buffers
    return out, (start, mid, end)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, cfg = bench_model(False, "cuda")
    vocab = model.vlm.embed_tokens.weight.shape[0]
    lanes = [FastRunner(model, cfg), FastRunner(model, cfg)]
    x1 = [inputs_of(1, s, vocab) for s in range(2)]
    x2 = inputs_of(2, 7, vocab)
    # Serial references (and the graphs: a runner without a plan captures on its first call).
    ref = []
    for i, lane in enumerate(lanes):
        out, _ = call(lane, *x1[i])
        ref.append(out.clone())
    torch.cuda.synchronize()
    results = {"tokens": TOKENS, "n": N, "gpu": torch.cuda.get_device_name()}

    def timed(name, body, obs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        spans = body()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        per_call = sorted(s.elapsed_time(e) for s, e in spans)
        results[name] = {"obs_per_s": obs / wall, "wall_ms": wall * 1e3,
                         "call_p50_ms": per_call[len(per_call) // 2], "call_max_ms": per_call[-1]}
        log(name, json.dumps(results[name]))

    def serial_b1():
        spans = []
        for _ in range(N):
            _, t = call(lanes[0], *x1[0])
            spans.append((t.start, t.end))
        return spans

    def serial_b2():
        spans = []
        for _ in range(N):
            _, t = call(lanes[0], *x2)
            spans.append((t.start, t.end))
        return spans

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]

    def two_lanes():
        spans = []
        for _ in range(N):
            for i in range(2):
                with torch.cuda.stream(streams[i]):
                    out, t = call(lanes[i], *x1[i])
                    outs[i].append(out.clone())
                spans.append((t.start, t.end))
        return spans

    high = [torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)]
    low = [torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=0)]
    outs_p = [[], []]

    def two_lanes_priority():
        spans = []
        for _ in range(N):
            for i in range(2):
                out, (s, m, e) = split_call(lanes[i], *x1[i], low[i], high[i])
                with torch.cuda.stream(high[i]):
                    outs_p[i].append(out.clone())
                spans.append((s, e))
        return spans

    for _ in range(2):  # the second round is the one kept
        timed("serial_b1", serial_b1, N)
        timed("serial_b2", serial_b2, 2 * N)
        outs[0].clear(), outs[1].clear(), outs_p[0].clear(), outs_p[1].clear()
        timed("two_lanes", two_lanes, 2 * N)
        timed("two_lanes_euler_high_priority", two_lanes_priority, 2 * N)
    torch.cuda.synchronize()
    results["bit_identical"] = all(torch.equal(o, ref[i]) for i in range(2) for o in outs[i] + outs_p[i])
    results["two_lanes_vs_b1"] = results["two_lanes"]["obs_per_s"] / results["serial_b1"]["obs_per_s"]
    results["priority_vs_b1"] = (results["two_lanes_euler_high_priority"]["obs_per_s"]
                                 / results["serial_b1"]["obs_per_s"])
    results["b2_vs_b1"] = results["serial_b2"]["obs_per_s"] / results["serial_b1"]["obs_per_s"]
    log(json.dumps(results, indent=1))
    out = Path(os.environ.get("OUT", "."))
    (out / "two_lanes.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
