"""What one request costs the server's host, stage by stage, back to back, after the process sat idle and
after it was busy with other work.

    python bench/bench_prepare.py [--idle-ms 10] [--calls 200] [--device-ms 14.3] [--robot-ms 1.2] [--out DIR]

A robot's next request comes after its reply went out and its controller thought for a while, so the
server handles each request on a CPU that has been idle. This times, for bench_fleet's robot
observation (3 uint8 224x224 cameras, LeRobot keys, sent by openpi-client) on the golden checkpoint,
each host stage of the OpenPI socket's path outside the device: decoding the frame, building the
Request (validation), Policy.prepare (images, state, prompt tokens, noise) and its sub-steps,
encoding the reply and recording its metrics; back to back, with `--idle-ms` of sleep before each
call, and with as long of busy work instead (a loop on the clock, as a thread spinning on the GPU
does): if the busy CPU is as slow as the idle one, the cost is the request's state displaced from
the core, not the core's sleep, and keeping cores awake (busy polling, /dev/cpu_dma_latency) cannot
remove it. Then the thread hops a request takes (event loop -> worker -> launch thread -> completion
thread -> event loop), each alone, and the path from the event loop to the launch thread with a
prepare in between: back through the event loop, or queued by the worker itself (the server's path
for a lone request). Every stage: p50 and p99, ms; writes bench_prepare.json. --smoke: 5 calls each.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from openpi_client import msgpack_numpy

import vlaserve.processing.prepare as prepare_module
from common import golden_checkpoint, log, parser, robot_observation, save_json
from vlaserve import Policy
from vlaserve.server.codec import packb, unpackb
from vlaserve.server.openpi import request_from_openpi
from vlaserve.server.replies import policy_timing
from vlaserve.server.service import ServerSettings, Service


def spread(ms: list[float]) -> dict:
    """p50 and p99 (nearest rank) of a stage, ms."""
    ms = sorted(ms)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--idle-ms", type=float, default=10.0,
                    help="sleep (after_idle), or busy work (after_busy), before each call")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    if args.smoke:
        args.calls = min(args.calls, 5)
    policy = Policy.from_pretrained(golden_checkpoint(), device="cpu", dtype="float32", progress=False)
    torch.set_num_threads(1)  # host ops as a GPU server runs them (Runtime.limit_host_threads)
    service = Service(policy, ServerSettings())
    c = policy.config
    raw = robot_observation(0, c.state_dim, c.action_horizon, c.model.max_action_dim)
    frame = msgpack_numpy.packb(raw)  # what openpi-client sends

    steps: dict = collections.defaultdict(list)

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            steps[name].append((time.perf_counter() - t) * 1e3)
            return out
        return wrapper

    pre = policy.preprocessor
    prepare_module.prepare_image = timed("prepare_image (x3)", prepare_module.prepare_image)
    tokenizer_type = type(pre.tokenizer)
    tokenizer_type.__call__ = timed("tokenizer", tokenizer_type.__call__)
    # (Absent from older trees, which this script can time too: PYTHONPATH=OLD/src.)
    if hasattr(prepare_module, "_stacked_frames"):
        prepare_module._stacked_frames = timed("stack_frames", prepare_module._stacked_frames)
    if hasattr(tokenizer_type, "state_prompt"):
        tokenizer_type.state_prompt = timed("tokenizer", tokenizer_type.state_prompt)
    type(pre.state_norm).normalize = timed("state_normalize", type(pre.state_norm).normalize)
    pre.family = dataclasses.replace(pre.family, prompt=timed("prompt (state bins, text)", pre.family.prompt))

    results: dict = {"idle_ms": args.idle_ms, "calls": args.calls, "smoke": args.smoke, "frame_bytes": len(frame)}
    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    pause = args.idle_ms / 1e3
    for label, between in (("back_to_back", lambda: None), ("after_idle", lambda: time.sleep(pause)),
                           ("after_busy", lambda: spin(pause))):
        steps.clear()
        stages: dict = collections.defaultdict(list)
        for _ in range(args.calls):
            t0 = time.perf_counter()
            decoded = unpackb(frame, 1024)
            t1 = time.perf_counter()
            request = request_from_openpi(decoded, service)
            t2 = time.perf_counter()
            policy.prepare(request)
            t3 = time.perf_counter()
            actions = np.zeros((c.action_horizon, c.action_dim), dtype=np.float32)
            timings = {"prepare_ms": t3 - t2, "device_ms": 1.0}
            reply = packb({"actions": actions, "server_timing": {"infer_ms": 1.0},
                           "policy_timing": policy_timing(timings)})
            t4 = time.perf_counter()
            service.metrics.observe_stages({"decode_ms": 1.0, **timings, "encode_ms": 1.0})
            t5 = time.perf_counter()
            for name, a, b in (("decode", t0, t1), ("request", t1, t2), ("prepare", t2, t3), ("encode", t3, t4),
                               ("metrics", t4, t5), ("total", t0, t5)):
                stages[name].append((b - a) * 1e3)
            assert len(reply) > 0
            between()
        results[label] = {"stages": {k: spread(v) for k, v in stages.items()},
                          "prepare_steps": {k: spread(v) for k, v in steps.items()}}
        log(label, json.dumps(results[label]))

    results["hops_after_idle"] = asyncio.run(hops(policy, raw, args))
    log("hops, after idle", json.dumps(results["hops_after_idle"]))
    save_json(results, args.out, "bench_prepare")


async def hops(policy: Policy, raw: dict, args) -> dict:
    """Each thread hop of a request's way through the server, alone (a no-op on either side), and the
    way from the event loop to the launch thread around a real prepare, by the two routes."""
    loop, pool = asyncio.get_running_loop(), ThreadPoolExecutor(4)
    idle = args.idle_ms / 1e3
    out: dict = collections.defaultdict(list)
    launch_queue: queue.Queue = queue.Queue()
    arrived: queue.Queue = queue.Queue()

    def launch_thread():  # stands for the batcher's launch (or completion) thread, blocked on its queue
        while launch_queue.get() is not None:
            arrived.put(time.perf_counter())

    thread = threading.Thread(target=launch_thread)
    thread.start()
    obs = {"images": {k.removeprefix("observation.images."): v for k, v in raw.items() if "images" in k},
           "state": raw["observation.state"], "task": raw["prompt"]}

    def prepare_and_queue(request):
        policy.prepare(request)
        launch_queue.put(request)

    for _ in range(args.calls):
        t0 = time.perf_counter()
        t1, t2 = await loop.run_in_executor(pool, lambda: (time.perf_counter(), time.perf_counter()))
        t3 = time.perf_counter()
        out["event_loop_to_worker"].append(t1 - t0)
        out["worker_to_event_loop"].append(t3 - t2)
        await asyncio.sleep(idle)

        t0 = time.perf_counter()
        launch_queue.put(0)
        out["queue_to_waiting_thread"].append(arrived.get() - t0)
        await asyncio.sleep(idle)

        future, sent = loop.create_future(), []

        def settle():
            sent.append(time.perf_counter())
            loop.call_soon_threadsafe(future.set_result, None)
        threading.Thread(target=settle).start()
        await future
        out["thread_to_event_loop"].append(time.perf_counter() - sent[0])
        await asyncio.sleep(idle)

        request = policy.request(obs, noise=raw["noise"])
        t0 = time.perf_counter()
        await loop.run_in_executor(pool, policy.prepare, request)
        launch_queue.put(request)
        out["prepare_to_launch_via_event_loop"].append(arrived.get() - t0)
        await asyncio.sleep(idle)

        request = policy.request(obs, noise=raw["noise"])
        t0 = time.perf_counter()
        await loop.run_in_executor(pool, prepare_and_queue, request)
        out["prepare_to_launch_from_worker"].append(arrived.get() - t0)
        await asyncio.sleep(idle)
    launch_queue.put(None)
    thread.join()
    pool.shutdown()
    return {k: spread([x * 1e3 for x in v]) for k, v in out.items()}


if __name__ == "__main__":
    main()
