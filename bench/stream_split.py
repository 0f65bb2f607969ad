"""Probe (issue 14, run 127 on): a batch's items split into parts that run on concurrent streams
inside one CUDA graph.

At batch 8 the expert's kernels are latency-bound (400 rows: ~2x their own floors, run 122), and
the items of a batch are independent until the actions come out. So the batch can run as parts
(2 x 4, 4 x 2 items) on their own streams, each part with its own batch size's kernels, and the
parts' kernels fill each other's gaps. The price: every part reads the weights again (the expert
reads ~0.62 GB a step at batch 8: 0.15 ms at HBM speed, per extra part).

Modes, each one CUDA graph of a whole call (prefix + 10 Euler steps), or of the denoise alone:
- serial: today's call, one stream;
- denoise_split: the prefix for the whole batch, then the parts' Euler steps on their streams;
- parallel: each part's prefix and Euler steps on its own stream, all at once;
- staggered: part i's prefix waits for part i-1's prefix, so one part's Euler steps (latency-bound)
  overlap the next part's prefix (compute-bound);
- staggered_priority: staggered, with the Euler steps' streams at high priority.

    python3 bench/stream_split.py [--no-pdl] [--out DIR]

Full-size Pi0.5, random weights, bench_gpu.py's ALOHA-3 inputs in the default 96-token bucket,
default (cuBLAS) GEMMs. Each row: p50 ms of 20 replays, max|Δ| from the serial graph's actions and
from fp32 eager, and whether a second replay repeats the first bit for bit.
JSON: stream_split.json under bench/results and --out.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import STEPS, bucketed, default_bucket, eager, log, make_inputs, maxdiff, time_cuda  # noqa: E402
from kernel_ladder import CAMERA_NAMES, bench_run, capture  # noqa: E402

from vlaserve.checkpoint.weights import random_model  # noqa: E402
from vlaserve.config import ModelConfig, PolicyConfig  # noqa: E402
from vlaserve.runtime.fast.buffers import BufferSpec  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

CASES = [(2, 2), (4, 2), (8, 2), (8, 4)]  # (batch, parts)
MODES = ("denoise_split", "parallel", "staggered", "staggered_priority")


def part_slices(b: int, parts: int) -> list[slice]:
    n = b // parts
    return [slice(i * n, (i + 1) * n) for i in range(parts)]


class Call:
    """One call's work over static buffers, by part: prefix(sl) and denoise(sl)."""

    def __init__(self, fast, buf, slots: int):
        self.fast, self.buf, self.slots = fast, buf, slots
        self.sched = fast.schedule(STEPS)

    def prefix(self, sl: slice) -> None:
        buf = self.buf
        pad = self.fast.prefix(buf["images"][sl], buf["image_masks"][sl], buf["tokens"][sl], buf["token_mask"][sl],
                               buf["k_cache"][:, sl], buf["v_cache"][:, sl], self.slots)
        buf["pad"][sl].copy_(pad)

    def denoise(self, sl: slice) -> torch.Tensor:
        buf = self.buf
        return self.fast.denoise(buf["pad"][sl], buf["noise"][sl], self.sched, buf["k_cache"][:, sl],
                                 buf["v_cache"][:, sl], None)


def fork(s: torch.cuda.Stream, after) -> None:
    """s waits for `after` (a stream or an event), then runs one plain kernel, so that the part's
    first PDL kernel follows a kernel of its own stream (run 129 ran so; runs 127-128 failed on the
    join below, not on this, and a fork without it was not tried again)."""
    if isinstance(after, torch.cuda.Event):
        s.wait_event(after)
    else:
        s.wait_stream(after)
    with torch.cuda.stream(s):
        torch.ones(1, device="cuda").mul_(2)


def make_fn(call: Call, b: int, mode: str, streams: list, hi_streams: list, with_prefix: bool = True):
    whole = slice(0, b)
    if mode == "serial":
        def fn():
            if with_prefix:
                call.prefix(whole)
            return call.denoise(whole).clone()
        return fn
    slices = part_slices(b, len(streams))

    def fn():
        main = torch.cuda.current_stream()
        outs = []
        if mode == "denoise_split":
            if with_prefix:
                call.prefix(whole)
            for s, sl in zip(streams, slices):
                fork(s, main)
                with torch.cuda.stream(s):
                    outs.append(call.denoise(sl))
        elif mode == "parallel":
            for s, sl in zip(streams, slices):
                fork(s, main)
                with torch.cuda.stream(s):
                    call.prefix(sl)
                    outs.append(call.denoise(sl))
        else:  # staggered: part i's prefix after part i-1's, its Euler steps on a (high-priority) stream
            euler = hi_streams if mode == "staggered_priority" else streams
            done = None
            for s, e, sl in zip(streams, euler, slices):
                fork(s, main if done is None else done)
                with torch.cuda.stream(s):
                    call.prefix(sl)
                    done = torch.cuda.Event()
                    done.record(s)
                if e is not s:
                    fork(e, done)
                with torch.cuda.stream(e):
                    outs.append(call.denoise(sl))
        used = streams + (hi_streams if mode == "staggered_priority" else [])
        for s in used:  # only streams forked from the capture: waiting on any other invalidates it
            main.wait_stream(s)
        return torch.cat(outs)
    return fn


def row(graph, out, serial_out, ref32) -> dict:
    graph.replay()
    first = out.clone()
    graph.replay()
    result = {"p50_ms": time_cuda(graph.replay, warmup=3, iters=20)["p50_ms"],
              "repeat_bit_identical": bool(torch.equal(first, out))}
    if serial_out is not None:
        result["vs_serial"] = maxdiff(first, serial_out)
    if ref32 is not None:
        result["vs_fp32"] = maxdiff(first, ref32)
    return result, first


def main():
    args, results, save = bench_run("stream_split", {"no-pdl": "programmatic dependent launch off"})
    if args.no_pdl:
        kernels.TUNING["pdl"] = False
    results["pdl"] = kernels.pdl_enabled()
    started = time.time()
    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    model32 = copy.deepcopy(model).float()
    policy_config = PolicyConfig(cfg, CAMERA_NAMES, 14, 14)
    fast = FastRunner(model, policy_config, use_graphs=False).fast
    bucket = default_bucket()
    capture_stream = torch.cuda.Stream()
    streams = [torch.cuda.Stream() for _ in range(4)]
    hi_streams = [torch.cuda.Stream(priority=-1) for _ in range(4)]
    results.update(bucket=bucket, cases={})
    log(f"built ({time.time() - started:.0f}s), bucket {bucket}")
    for b in sorted({b for b, _ in CASES}):
        inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=b)
        ref32 = eager(model32, inputs, noise)  # the checkpoint's 200 tokens: padding changes no action
        inputs = bucketed(inputs, bucket)
        buf = BufferSpec.of(policy_config, b, torch.bfloat16, bucket).allocate("cuda")
        for name in ("images", "image_masks", "tokens", "token_mask"):
            buf[name].copy_(getattr(inputs, name))
        buf["noise"].copy_(noise)
        call = Call(fast, buf, slots=len(CAMERA_NAMES))
        case = results["cases"][f"b{b}"] = {}
        for with_prefix in (True, False):
            kind = "call" if with_prefix else "denoise"
            graph, out = capture(make_fn(call, b, "serial", [], [], with_prefix), capture_stream)
            case[f"{kind}_serial"], serial_out = row(graph, out, None, ref32)
            log(f"b{b} {kind} serial {case[f'{kind}_serial']}")
            del graph, out
            for cb, parts in CASES:
                if cb != b:
                    continue
                for mode in MODES if with_prefix else ("denoise_split",):
                    name = f"{kind}_{mode}_x{parts}"
                    try:
                        fn = make_fn(call, b, mode, streams[:parts], hi_streams[:parts], with_prefix)
                        graph, out = capture(fn, capture_stream)
                        case[name], _ = row(graph, out, serial_out, ref32)
                        del graph, out
                    except Exception as e:  # a probe: record and go on
                        case[name] = {"error": repr(e)[:300], "trace": traceback.format_exc()[-1500:]}
                        torch.cuda.synchronize()
                    log(f"b{b} {name} {case[name]}")
                    save()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    results["seconds"] = time.time() - started
    save()
    log(f"done ({results['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
