"""What a paced fleet's latency would be with no cost but the device's and a lone robot's host time.

bench_fleet.py's paced robots send on their own fixed phase every 1/hz seconds, or at once when the
previous answer came after their next tick. This replays that schedule against an ideal continuous
batcher (the contract of vlaserve/batcher.py without its host costs): a request runs at once on an idle
device; requests that arrive while a batch runs go together, up to the batch limit, the moment it
ends. Each request pays `host_in_ms` before it can be batched and `host_out_ms` after its batch, the
device the measured time of its batch size. The latencies this gives are the floor the device's batch
times and the robots' phases set: a measured p99 above it is the server's; the floor above a target
is the device's.

Standard library only (bench_fleet.py's analysis, and its test).
"""

from __future__ import annotations

import heapq
import random


def batch_times(measured_ms: dict[int, float], max_batch: int) -> list[float]:
    """Device ms for batch sizes 1..max_batch: the measured ones as they are; a size not measured
    from the least-squares line through the measured ones (a call's time grows ~linearly with its
    batch: benchmarks.md), or the one measured time when only one size was seen."""
    if not measured_ms:
        raise ValueError("no measured batch time")
    sizes = sorted(measured_ms)
    if len(sizes) == 1:
        slope, intercept = 0.0, measured_ms[sizes[0]]
    else:
        mean_b = sum(sizes) / len(sizes)
        mean_t = sum(measured_ms[b] for b in sizes) / len(sizes)
        slope = (sum((b - mean_b) * (measured_ms[b] - mean_t) for b in sizes)
                 / sum((b - mean_b) ** 2 for b in sizes))
        intercept = mean_t - slope * mean_b
    return [measured_ms.get(b, intercept + slope * b) for b in range(1, max_batch + 1)]


def ideal_latencies(phases_s: list[float], hz: float, seconds: float, device_ms: list[float],
                    host_in_ms: float, host_out_ms: float) -> list[float]:
    """Each answer's latency (ms, robot send -> answer received) of paced robots (`phases_s`: each
    robot's offset in its period) over `seconds` against the ideal batcher; `device_ms[b - 1]`: a
    batch of b (its length is the batch limit)."""
    period = 1.0 / hz
    max_batch = len(device_ms)
    arrivals = [(phase + host_in_ms / 1e3, robot, phase) for robot, phase in enumerate(phases_s)]  # (at, robot, sent)
    heapq.heapify(arrivals)
    ticks = [0] * len(phases_s)
    queued: list[tuple[float, int, float]] = []
    device_free, latencies = 0.0, []
    while arrivals or queued:
        if not queued:
            queued.append(heapq.heappop(arrivals))
        start = max(device_free, queued[0][0])
        while arrivals and arrivals[0][0] <= start:
            queued.append(heapq.heappop(arrivals))
        batch, queued = queued[:max_batch], queued[max_batch:]
        device_free = start + device_ms[len(batch) - 1] / 1e3
        for _, robot, sent in batch:
            answered = device_free + host_out_ms / 1e3
            latencies.append((answered - sent) * 1e3)
            ticks[robot] += 1
            next_send = max(phases_s[robot] + ticks[robot] * period, answered)
            if next_send < seconds:
                heapq.heappush(arrivals, (next_send + host_in_ms / 1e3, robot, next_send))
    return latencies


def other_fleets_p99(robots: int, hz: float, seconds: float, device_ms: list[float], host_in_ms: float,
                     host_out_ms: float, fleets: int = 30, seed: int = 0) -> list[float]:
    """The ideal batcher's p99 (nearest rank, ms) for `fleets` other fleets of `robots` robots at
    `hz`, each robot's phase drawn uniformly from its period: how much of a level's floor is its
    particular phases' luck."""
    draw = random.Random(seed)
    out = []
    for _ in range(fleets):
        phases = [draw.uniform(0.0, 1.0 / hz) for _ in range(robots)]
        latencies = sorted(ideal_latencies(phases, hz, seconds, device_ms, host_in_ms, host_out_ms))
        out.append(latencies[round(0.99 * (len(latencies) - 1))])
    return out
