"""Does forming the next batch earlier (a launch lead L before the device frees) change a paced fleet's
p99? Not maintained (docs/benchmarks.md, run 181). The ideal batcher of bench/fleet_model.py, except
that the next batch takes only the requests that arrived L ms before the running one ends; 16 robots
at 4 Hz, 25 s, run 179's device ms per batch of 1-8, 3.4 ms of host time a request (half each way);
fleet 0 is bench_fleet's (phases seeded by robot number), fleets 1-29 drawn with other seeds.
    python3 bench/probes/launch_lead.py
"""
import heapq

import numpy as np

DEVICE_MS = [14.3, 21.7, 30.6, 36.2, 45.6, 52.4, 59.1, 67.5]


def p99(phases, lead_ms, host_ms=3.4, seconds=25.0, hz=4.0):
    period, half = 1 / hz, host_ms / 2e3
    arrivals = [(p + half, i, p) for i, p in enumerate(phases)]
    heapq.heapify(arrivals)
    ticks, queued, free, latencies = [0] * len(phases), [], 0.0, []
    while arrivals or queued:
        if not queued:
            queued.append(heapq.heappop(arrivals))
        formed = max(free - lead_ms / 1e3, queued[0][0])
        while arrivals and arrivals[0][0] <= formed:
            queued.append(heapq.heappop(arrivals))
        batch, queued = queued[:8], queued[8:]
        free = max(free, formed) + DEVICE_MS[len(batch) - 1] / 1e3
        for _, robot, sent in batch:
            answered = free + half
            latencies.append((answered - sent) * 1e3)
            ticks[robot] += 1
            nxt = max(phases[robot] + ticks[robot] * period, answered)
            if nxt < seconds:
                heapq.heappush(arrivals, (nxt + half, robot, nxt))
    latencies.sort()
    return latencies[int(0.99 * (len(latencies) - 1))]


def main():
    fleets = [[float(np.random.default_rng(i if f == 0 else 1000 * f + i).uniform(0, 0.25)) for i in range(16)]
              for f in range(30)]
    for lead in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0):
        v = np.array([p99(phases, lead) for phases in fleets])
        print(f"lead {lead} ms: bench's fleet {v[0]:.1f} ms; 30 fleets median {np.median(v):.1f}, "
              f"worst {v.max():.1f}, within 45 ms {int((v <= 45).sum())}")


if __name__ == "__main__":
    main()
