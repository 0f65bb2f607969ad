"""Host and device overlap in the batcher, in one process (no network, no codec): what enqueueing the
next batch while the device runs this one buys, and that it changes no answer.

    python bench/bench_overlap.py [--device cuda] [--checkpoint DIR] [--seconds 5] [--robots 1,2,16] [--out DIR]

On a full-size random checkpoint (cuda; the golden one on a CPU), bf16, bench_fleet's robot
observations (3 uint8 224x224 cameras, each robot its own noise):
- exactness: two batches of one size enqueued back to back (`Policy.launch` twice, then `finish`)
  against each run alone, at batch 1 and 8: bitwise equal expected (same kernels, same inputs);
- the host time of one `Policy.launch` with the device idle and while a batch of 8 runs (if a copy
  waited for the device it would take the running batch's time), and where it goes (cProfile);
- N in-process robots (asyncio tasks: prepare on a thread, then submit, back to back) through the
  Batcher: observations per second, batch sizes, the device's busy share
  (sum of device time over wall time), and each answer against its robot's reference taken alone.
Writes bench_overlap.json. --smoke: the golden checkpoint on the CPU, 1 and 2 robots for a second.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import bench_checkpoint, log, parser, robot_observation, save_json
from vlaserve import Policy
from vlaserve.batcher import Batcher


def requests_for(policy: Policy, observations: list[dict]) -> list:
    return [policy.request(obs) for obs in observations]


def exactness(policy: Policy, observations: list[dict], size: int) -> dict:
    first, second = requests_for(policy, observations[:size]), requests_for(policy, observations[size:2 * size])
    serial = [policy.run(first), policy.run(second)]
    launched = [policy.launch(first), policy.launch(second)]
    overlapped = [batch.finish() for batch in launched]
    return {"bitwise_equal": all(np.array_equal(a.actions, b.actions) for s, o in zip(serial, overlapped)
                                 for a, b in zip(s, o)),
            "max_abs_diff": max(float(np.abs(a.actions - b.actions).max()) for s, o in zip(serial, overlapped)
                                for a, b in zip(s, o))}


def launch_host_ms(policy: Policy, observations: list[dict], calls: int = 20) -> dict:
    """p50 host time of Policy.launch at batch 1, the device idle vs busy with a batch of 8."""
    one, eight = requests_for(policy, observations[:1]), requests_for(policy, observations[:8])
    idle, busy, running_ms = [], [], []
    for _ in range(calls):
        started = time.perf_counter()
        batch = policy.launch(one)
        idle.append((time.perf_counter() - started) * 1e3)
        batch.finish()
        running = policy.launch(eight)
        started = time.perf_counter()
        batch = policy.launch(one)
        busy.append((time.perf_counter() - started) * 1e3)
        running_ms.append(running.finish()[0].timings["device_ms"])
        batch.finish()
    return {"idle_p50_ms": statistics.median(idle), "busy_p50_ms": statistics.median(busy),
            "running_batch8_device_ms": statistics.median(running_ms)}


def launch_profile(policy: Policy, observations: list[dict], calls: int = 50, top: int = 25) -> list[dict]:
    """Where Policy.launch's host time goes at batch 1 (cProfile around the launches only): the
    functions with the most own time, in microseconds per launch."""
    import cProfile
    import pstats

    one = requests_for(policy, observations[:1])
    profile = cProfile.Profile()
    for _ in range(calls):
        profile.enable()
        batch = policy.launch(one)
        profile.disable()
        batch.finish()
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_launch": nc / calls,
             "own_us_per_launch": tt / calls * 1e6, "cumulative_us_per_launch": ct / calls * 1e6}
            for (f, line, name), (cc, nc, tt, ct, _) in rows]


def fleet(policy: Policy, observations: list[dict], references: list[np.ndarray], robots: int,
          seconds: float) -> dict:
    batches: list[int] = []
    batcher = Batcher(policy, max_batch_size=8, on_batch=batches.append)
    latencies: list[float] = []
    device: dict[int, float] = {}  # id(result timings) -> device ms per batch, counted once per batch
    worst = 0.0

    async def robot(i: int, until: float) -> None:
        nonlocal worst
        while time.perf_counter() < until:
            started = time.perf_counter()
            request = policy.request(observations[i])
            request.client = i
            await asyncio.to_thread(policy.prepare, request)
            result = await batcher.submit(request)
            latencies.append((time.perf_counter() - started) * 1e3)
            device[round(result.timings["done_at"], 9)] = result.timings["device_ms"]
            worst = max(worst, float(np.abs(result.actions - references[i]).max()))

    async def drive() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(robot(i, started + seconds) for i in range(robots)))
        return time.perf_counter() - started

    try:
        wall = asyncio.run(drive())
    finally:
        batcher.close()
    return {"robots": robots, "obs_per_s": len(latencies) / wall,
            "p50_ms": statistics.median(latencies), "p99_ms": float(np.percentile(latencies, 99)),
            "mean_batch": statistics.fmean(batches), "device_busy_share": sum(device.values()) / 1e3 / wall,
            "max_dev_from_alone": worst}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--checkpoint", default=None,
                    help="default: a full-size random checkpoint (cuda) or the golden one (cpu, --smoke)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per fleet level")
    ap.add_argument("--robots", default="1,2,16", help="fleet levels: in-process robots")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.seconds, args.robots = "cpu", 1.0, "1,2"
    calls = 3 if args.smoke else 20

    checkpoint = (Path(args.checkpoint) if args.checkpoint
                  else bench_checkpoint(args.smoke, args.device, Path(tempfile.mkdtemp(prefix="bench_overlap-"))))
    policy = Policy.from_pretrained(checkpoint, device=args.device, warmup="blocking", progress=False)
    c = policy.config
    observations = [robot_observation(i, c.state_dim, c.action_horizon, c.model.max_action_dim) for i in range(16)]
    results: dict = {"device": args.device, "smoke": args.smoke, "checkpoint": str(checkpoint),
                     "dtype": str(policy.runtime.dtype)}
    results["exactness"] = {b: exactness(policy, observations, b) for b in (1, 8)}
    log("exactness", results["exactness"])
    results["launch_host"] = launch_host_ms(policy, observations, calls)
    log("launch host time", results["launch_host"])
    results["launch_profile"] = launch_profile(policy, observations, 3 if args.smoke else 50)
    for row in results["launch_profile"][:12]:
        log(row)
    references = [policy.infer(obs).actions for obs in observations]
    results["fleet"] = []
    for robots in (int(n) for n in args.robots.split(",")):
        level = fleet(policy, observations, references, robots, args.seconds)
        log(level)
        results["fleet"].append(level)
    save_json(results, args.out, "bench_overlap")


if __name__ == "__main__":
    main()
