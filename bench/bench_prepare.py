"""What one request's host preparation costs, back to back and after the process sat idle.

    python bench/bench_prepare.py [--idle-ms 10] [--calls 60] [--out DIR]

A robot's next request comes after its reply went out and its controller thought for a while, so
the server prepares each request on a CPU that has been idle. This times, for bench_fleet's robot
observation (3 uint8 224x224 cameras, LeRobot keys) on the golden checkpoint: building the Request
(validation), Policy.prepare (images, state, prompt, tokenizer, noise) and its sub-steps, back to
back and with `--idle-ms` of sleep before each call; and the thread-pool hop the server takes to
prepare off the event loop, with a no-op. p50 ms; writes bench_prepare.json. --smoke: 5 calls each.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import vlaserve.processing.prepare as prepare_module
from common import golden_checkpoint, parser, robot_observation, save_json
from vlaserve import Policy


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--idle-ms", type=float, default=10.0, help="sleep before each call (after_idle)")
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    if args.smoke:
        args.calls = min(args.calls, 5)
    policy = Policy.from_pretrained(golden_checkpoint(), device="cpu", dtype="float32", progress=False)
    raw = robot_observation(0, policy.config.state_dim, policy.config.action_horizon, policy.config.model.max_action_dim)
    obs = {"images": {k.removeprefix("observation.images."): v for k, v in raw.items() if "images" in k},
           "state": raw["observation.state"], "task": raw["prompt"]}

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
    type(pre.tokenizer).__call__ = timed("tokenizer", type(pre.tokenizer).__call__)
    type(pre.state_norm).normalize = timed("state_normalize", type(pre.state_norm).normalize)

    results: dict = {"idle_ms": args.idle_ms, "calls": args.calls, "smoke": args.smoke}
    for label, idle in (("back_to_back", 0.0), ("after_idle", args.idle_ms / 1e3)):
        steps.clear()
        request_ms, prepare_ms = [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            request = policy.request(obs, noise=raw["noise"])
            t1 = time.perf_counter()
            policy.prepare(request)
            request_ms.append((t1 - t0) * 1e3)
            prepare_ms.append((time.perf_counter() - t1) * 1e3)
            time.sleep(idle)
        per_call = {name: statistics.median(v) * len(v) / args.calls for name, v in steps.items()}
        results[label] = {"request_p50_ms": statistics.median(request_ms),
                          "prepare_p50_ms": statistics.median(prepare_ms), "steps_p50_ms": per_call}
        print(label, json.dumps(results[label]))

    async def hops() -> dict:
        loop, pool = asyncio.get_running_loop(), ThreadPoolExecutor(4)
        out = {}
        for name, fn in (("noop", lambda r: None), ("prepare", policy.prepare)):
            times = []
            for _ in range(args.calls):
                request = policy.request(obs, noise=raw["noise"])
                t = time.perf_counter()
                await loop.run_in_executor(pool, fn, request)
                times.append((time.perf_counter() - t) * 1e3)
                await asyncio.sleep(args.idle_ms / 1e3)
            out[f"{name}_in_thread_pool_p50_ms"] = statistics.median(times)
        pool.shutdown()
        return out

    results["thread_pool_after_idle"] = asyncio.run(hops())
    print("thread pool, after idle", json.dumps(results["thread_pool_after_idle"]))
    save_json(results, args.out, "bench_prepare")


if __name__ == "__main__":
    main()
