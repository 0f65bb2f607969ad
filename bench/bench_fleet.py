"""A fleet of robots against one `vlaserve serve`, as the robots see it.

Each robot runs the unmodified openpi-client over its own websocket, with its own observation (3 uint8
224x224 cameras, LeRobot keys) and its own fixed noise, so every answer is checkable: its reference
answer is taken alone first, then every answer under load is compared with it (and counted as crossed
when it lies closer to another robot's reference). Levels: N robots back to back, and paced at --hz.

    python bench/bench_fleet.py [--device cuda] [--robots 1,2,4,8,16,32] [--hz 4] [--seconds 8]
                                [--checkpoint DIR] [--serve-args "..."] [--out DIR]
    python bench/bench_fleet.py --command serve-ray --serve-args "--replicas 2" ...   # the Ray Serve app

Reports per level: throughput, p50/p90/p99/max latency, the batch-size histogram and graph counters
from /metrics (captures after ready must stay flat; through Ray's proxy a scrape reaches one replica,
so with several replicas these cover one of them), errors and crossed answers, and each server stage
(policy_timing) p50 and p99; and, from the same run, the device time at batch 1 and the server's own
share around it (the OpenPI socket's prev_total_ms, frame received -> reply sent, minus the device
time), each stage p50 and p99. Per level, where its slowest 1% of answers spent their time, and the
device time per batch size; per paced level, the floor an ideal batcher would reach on this run's
batch times and these robots' phases (fleet_model.py): a p99 above it is the server's, a floor above
a target the device's. Writes bench_fleet[_LABEL].json and .png; --smoke serves the golden
checkpoint on the CPU to 1 and 2 robots for a second each.

    python bench/bench_fleet.py --chaos [--robots 16] [--hz 4] [--seconds 8] ...

--chaos (fleet_chaos.py): the robots run ActionChunkExecutor at --hz (the first of each list) for --seconds,
the server is SIGKILLed and restarted on the same port, then stopped with SIGTERM. Reports each robot's
gap without fresh actions (p50, max), the restart time, the first fresh chunk after ready, the ages of
the observations sent, leftover processes and close() times; writes bench_fleet_chaos[_LABEL].json and
.png. With --smoke: the demo checkpoint on the CPU, 4 robots at 20 Hz.

    python bench/bench_fleet.py --swap-weights [--robots 16] [--hz 4] [--seconds 8] ...

--swap-weights (fleet_swap.py): the robots (the first of --robots) at --hz for --seconds while the server's
weights are updated in place to a perturbed copy of the checkpoint and back; reports each update's time against
the checkpoint's read time, failed requests, every answer attributed to the old or the new weights by its
distance to each version's answer alone, and p99 before vs during the updates; writes
bench_fleet_swap[_LABEL].json and .png. With --smoke: the golden checkpoint on the CPU, 2 robots at 2 Hz.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from common import (bench_checkpoint, free_port, log, parser, percentiles, pyplot, robot_observation, save_json,
                    save_png, start_server, stop_server, wait_until_healthy)
from fleet_model import batch_times, ideal_latencies, other_fleets_p99

# Batched and single answers of one robot differ by bf16 rounding (~1e-2 at full size); different robots'
# answers differ by ~1 and more. An answer further than this from its own reference is wrong.
WRONG_ANSWER = 0.25


def scrape(port: int) -> dict:
    """Counters from /metrics (a serve-ray replica labels its samples with replica="...")."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    out = {"batch_size_count": {}}
    for name in ("vlaserve_graph_captures", "vlaserve_uncaptured_calls", "vlaserve_padded_calls"):
        values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
        out[name] = sum(float(v) for v in values) if values else 0.0
    for le, count in re.findall(r'^vlaserve_batch_size_bucket\{(?:[^}]*,)?le="([0-9.]+)"[^}]*\} ([0-9.e+]+)$', text, re.M):
        out["batch_size_count"][le] = out["batch_size_count"].get(le, 0.0) + float(count)
    return out


def batch_histogram(before: dict, after: dict) -> dict:
    """Batches per size in a level (the histogram's buckets are cumulative: le=1, le=2, ...)."""
    cumulative = {float(k): after["batch_size_count"][k] - before["batch_size_count"].get(k, 0.0)
                  for k in after["batch_size_count"]}
    sizes = sorted(cumulative)
    out, previous = {}, 0.0
    for size in sizes:
        if size == int(size):
            out[int(size)] = int(cumulative[size] - previous)
            previous = cumulative[size]
    return {k: v for k, v in out.items() if v}


def run_level(port: int, observations: list[dict], references: list[np.ndarray], seconds: float, hz: float) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    n = len(observations)
    latencies: list[list[float]] = [[] for _ in range(n)]
    server_totals: list[float] = []
    stages: dict[str, list[float]] = {}
    answers: list[dict] = []  # each answer's latency and server stages
    errors, wrong, crossed = [0], [0], [0]
    start_barrier = threading.Barrier(n)
    lock = threading.Lock()

    def robot(i: int) -> None:
        client = WebsocketClientPolicy("127.0.0.1", port)
        client.infer(observations[i])  # connect and warm this socket before timing
        start_barrier.wait()
        started = time.perf_counter()
        phase = robot_phase(i, hz)
        tick = 0
        while time.perf_counter() - started < seconds:
            if hz:
                next_at = started + phase + tick / hz
                tick += 1
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            t0 = time.perf_counter()
            try:
                out = client.infer(observations[i])
            except Exception:  # noqa: BLE001 - counted, the level goes on
                with lock:
                    errors[0] += 1
                continue
            latencies[i].append((time.perf_counter() - t0) * 1e3)
            answers.append({"latency_ms": latencies[i][-1], **out.get("policy_timing", {}),
                            "infer_ms": out.get("server_timing", {}).get("infer_ms")})
            deltas = [float(np.abs(out["actions"] - ref).max()) for ref in references]
            with lock:
                if deltas[i] > WRONG_ANSWER:
                    wrong[0] += 1
                if int(np.argmin(deltas)) != i:
                    crossed[0] += 1
                if "prev_total_ms" in out.get("server_timing", {}):
                    server_totals.append(out["server_timing"]["prev_total_ms"])
                for k, v in out.get("policy_timing", {}).items():
                    stages.setdefault(k, []).append(v)

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(n)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    flat = [x for per in latencies for x in per]
    spread = percentiles(flat)
    return {"robots": n, "hz": hz, "answers": len(flat), "obs_per_s": len(flat) / max(seconds, 1e-9),
            "wall_s": elapsed, "p50_ms": spread["p50_ms"], "p90_ms": spread["p90_ms"],
            "p99_ms": spread["p99_ms"], "max_ms": spread["max_ms"], "errors": errors[0], "wrong": wrong[0],
            "crossed": crossed[0], "server_total_p50_ms": statistics.median(server_totals) if server_totals else None,
            "server_total_p99_ms": p99(server_totals) if server_totals else None,
            # Each stage of the server (policy_timing: host stages and device), p50 and p99.
            "stages_p50_ms": {k: statistics.median(v) for k, v in stages.items()},
            "stages_p99_ms": {k: p99(v) for k, v in stages.items()},
            "slowest": slowest(answers), "device_ms_by_batch": device_by_batch(answers)}


def robot_phase(robot: int, hz: float) -> float:
    """A paced robot's offset in its period, seconds, fixed per robot as in a fleet (in lockstep they
    would all send on the same tick and measure the batch, not the fleet)."""
    return float(np.random.default_rng(robot).uniform(0, 1 / hz)) if hz else 0.0


def slowest(answers: list[dict]) -> dict:
    """Where the slowest 1% of a level's answers (those at or above its p99) spent their time, mean ms:
    the server's stages (prepare, queue: waiting for the device and for the batch to form, run: the
    batch's launch, device time and completion, hand-back) and what lies outside them (decoding the
    frame, encoding and sending the reply, the network and the client); and the device's idle time
    before their batches, of those launched behind a running one (launch_gap_ms)."""
    if not answers:
        return {}
    cut = p99([a["latency_ms"] for a in answers])
    tail = [a for a in answers if a["latency_ms"] >= cut]
    keys = ("latency_ms", "prepare_ms", "queue_ms", "run_ms", "device_ms", "handback_ms", "infer_ms")
    out = {k: statistics.fmean(a[k] for a in tail) for k in keys if all(a.get(k) is not None for a in tail)}
    if "infer_ms" in out:
        out["outside_ms"] = out["latency_ms"] - out["infer_ms"]
    gaps = [a["launch_gap_ms"] for a in tail if a.get("launch_gap_ms") is not None]
    if gaps:  # only batches launched behind a running one measure it
        out["launch_gap_ms"] = statistics.fmean(gaps)
    out["answers"] = len(tail)
    return out


def device_by_batch(answers: list[dict]) -> dict[int, float]:
    """Median device ms per batch size, the size read from each answer's own stages (batch_size)."""
    by: dict[int, list[float]] = {}
    for a in answers:
        if a.get("batch_size") and a.get("device_ms") is not None:
            by.setdefault(int(a["batch_size"]), []).append(a["device_ms"])
    return {b: statistics.median(v) for b, v in sorted(by.items())}


def p99(values: list[float]) -> float:
    return percentiles(values)["p99_ms"]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--checkpoint", default=None,
                    help="default: a full-size random checkpoint (cuda) or the golden one (cpu, --smoke)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--robots", default="1,2,4,8,16,32")
    ap.add_argument("--hz", default="4", help="paced levels at this rate per robot (comma list; 0: none)")
    ap.add_argument("--paced-robots", default="8,16")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--serve-args", default="--max-batch-size 8")
    ap.add_argument("--command", default="serve", choices=("serve", "serve-ray"),
                    help="the server: vlaserve serve, or the Ray Serve app (vlaserve[ray])")
    ap.add_argument("--frame", default="224x224", help="camera frame HxW (other than 224x224: resized by the server)")
    ap.add_argument("--label", default="")
    ap.add_argument("--chaos", action="store_true", help="kill, restart and stop the server under robots (see above)")
    ap.add_argument("--swap-weights", action="store_true",
                    help="update the server's weights in place under robots, and back (see above)")
    args = ap.parse_args()
    if args.chaos:
        return chaos(args)
    if args.swap_weights:
        return swap_weights(args)
    if args.smoke:
        args.device, args.robots, args.hz, args.paced_robots, args.seconds = "cpu", "1,2", "2", "2", 1.0
    alone_calls = 3 if args.smoke else 40

    results: dict = {"device": args.device, "smoke": args.smoke, "command": args.command,
                     "serve_args": args.serve_args, "seconds": args.seconds, "frame": args.frame}
    workdir = Path(tempfile.mkdtemp(prefix="bench_fleet-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(args.smoke, args.device, workdir)
    log_path = workdir / "server.log"
    server, port = start_server(args.command, checkpoint, ["--device", args.device, "--warmup", "blocking",
                                                           *args.serve_args.split()], log_path)
    started = time.perf_counter()
    try:
        wait_until_healthy(server, port, log_path)
        results["ready_s"] = time.perf_counter() - started
        meta = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        results["metadata"] = {k: meta.get(k) for k in ("dtype", "device", "fast_path", "graph_captures", "graph_bytes",
                                                       "graph_batches", "max_batch_size")}
        log("ready after", round(results["ready_s"], 1), "s:", results["metadata"])
        dims = (meta["state_dim"], meta["action_horizon"], meta["max_action_dim"])
        most = max(int(n) for n in args.robots.split(",") + args.paced_robots.split(","))
        frame = tuple(int(v) for v in args.frame.lower().split("x"))
        observations = [robot_observation(i, *dims, frame=frame) for i in range(most)]

        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        alone = WebsocketClientPolicy("127.0.0.1", port)
        references, stages, totals, infer, walls = [], {}, [], [], []
        for obs in observations:  # each robot's answer alone: the reference
            references.append(alone.infer(obs)["actions"])
        for _ in range(alone_calls):  # device time and where the server's own share goes, at batch 1, same run
            t0 = time.perf_counter()
            out = alone.infer(observations[0])
            walls.append((time.perf_counter() - t0) * 1e3)
            for k, v in out["policy_timing"].items():
                stages.setdefault(k, []).append(v)
            infer.append(out["server_timing"]["infer_ms"])
            if "prev_total_ms" in out["server_timing"]:
                totals.append(out["server_timing"]["prev_total_ms"])
        med = {k: statistics.median(v) for k, v in stages.items()}
        total, device = statistics.median(totals), med["device_ms"]
        results["batch1"] = {
            "client_wall_p50_ms": statistics.median(walls), "device_p50_ms": device,
            "server_total_p50_ms": total, "server_share_p50_ms": total - device,
            # infer_ms: handler's submit -> result (prepare on a worker thread, queue, batch); the rest of
            # the total is decoding the frame, building the request, encoding and sending the reply.
            "breakdown_p50_ms": {**med, "infer": statistics.median(infer),
                                 "decode_and_encode": total - statistics.median(infer)},
            "breakdown_p99_ms": {**{k: p99(v) for k, v in stages.items()}, "infer": p99(infer),
                                 "server_total": p99(totals)}}
        spread = min(float(np.abs(a - b).max()) for i, a in enumerate(references) for b in references[i + 1:])
        results["min_distance_between_robots"] = spread
        log("batch 1:", results["batch1"], "robots differ by >=", round(spread, 3))
        after_ready = scrape(port)
        results["captures_at_ready"] = after_ready["vlaserve_graph_captures"]

        levels = [(int(n), 0.0) for n in args.robots.split(",")]
        levels += [(int(n), float(hz)) for hz in args.hz.split(",") if float(hz) for n in args.paced_robots.split(",")]
        results["levels"] = []
        for n, hz in levels:
            before = scrape(port)
            level = run_level(port, observations[:n], references[:n], args.seconds, hz)
            after = scrape(port)
            level["batches"] = batch_histogram(before, after)
            level["captures_during"] = after["vlaserve_graph_captures"] - before["vlaserve_graph_captures"]
            level["uncaptured_during"] = after["vlaserve_uncaptured_calls"] - before["vlaserve_uncaptured_calls"]
            level["padded_during"] = after["vlaserve_padded_calls"] - before["vlaserve_padded_calls"]
            results["levels"].append(level)
            log(f"{n:3d} robots {'back to back' if not hz else f'at {hz:g} Hz':>12}: {level['obs_per_s']:.1f} obs/s, "
                f"p50 {level['p50_ms']:.1f} p99 {level['p99_ms']:.1f} max {level['max_ms']:.1f} ms, batches "
                f"{level['batches']}, errors {level['errors']}, wrong {level['wrong']}, crossed {level['crossed']}, "
                f"captures {level['captures_during']}, uncaptured {level['uncaptured_during']}")
        add_floors(results, int(meta["max_batch_size"]), args.seconds)
    finally:
        _, results["server_log_tail"] = stop_server(server, log_path)
    stem = f"bench_fleet{'_' + args.label if args.label else ''}"
    save_json(results, args.out, stem)
    plot(results, args.out, stem)


def chaos(args) -> None:
    from fleet_chaos import plot_chaos, run_chaos

    if args.smoke:
        args.device, args.robots, args.hz, args.seconds = "cpu", "4", "20", 2.0
        args.checkpoint = args.checkpoint or "demo-pi05"
    workdir = Path(tempfile.mkdtemp(prefix="bench_fleet_chaos-"))
    checkpoint = args.checkpoint or bench_checkpoint(args.smoke, args.device, workdir)
    port, logs = free_port(), []

    def start():
        logs.append(workdir / f"server{len(logs)}.log")
        return start_server(args.command, checkpoint, ["--device", args.device, "--warmup", "blocking",
                                                       *args.serve_args.split()], logs[-1], port=port)[0]

    results = {"device": args.device, "smoke": args.smoke, "command": args.command, "serve_args": args.serve_args,
               "checkpoint": str(checkpoint), "seconds": args.seconds}
    results["chaos"] = run_chaos(start, port, int(args.robots.split(",")[0]), float(args.hz.split(",")[0]), args.seconds)
    stem = f"bench_fleet_chaos{'_' + args.label if args.label else ''}"
    save_json(results, args.out, stem)
    save_png(plot_chaos(results, pyplot()), args.out, stem)


def swap_weights(args) -> None:
    from fleet_swap import perturbed_copy, plot_swap, read_time_s, run_swap

    if args.smoke:
        args.device, args.robots, args.hz, args.seconds = "cpu", "2", "2", 6.0
    workdir = Path(tempfile.mkdtemp(prefix="bench_fleet_swap-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(args.smoke, args.device, workdir)
    copy = perturbed_copy(checkpoint, workdir / "perturbed")
    results = {"device": args.device, "smoke": args.smoke, "serve_args": args.serve_args, "checkpoint": str(checkpoint),
               "read_s": min(read_time_s(copy) for _ in range(3))}  # (the page cache's: the copy was just written)
    log_path = workdir / "server.log"
    server, port = start_server("serve", checkpoint, ["--device", args.device, "--warmup", "blocking",
                                                      *args.serve_args.split()], log_path)
    try:
        wait_until_healthy(server, port, log_path)
        meta = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        dims = (meta["state_dim"], meta["action_horizon"], meta["max_action_dim"])
        frame = tuple(int(v) for v in args.frame.lower().split("x"))
        robots = int(args.robots.split(",")[0])
        observations = [robot_observation(i, *dims, frame=frame) for i in range(robots)]
        results["swap"] = swap = run_swap(port, observations, {"original": checkpoint, "perturbed": copy},
                                          float(args.hz.split(",")[0]), args.seconds, WRONG_ANSWER)
        for u in swap["updates"]:
            log(f"update to {u['to']}: {u['load_ms']:.0f} ms (read {u['read_ms']:.0f} ms, waited {u['wait_ms']:.0f} ms "
                f"for a batch, batches held {u['swap_ms']:.1f} ms; client {u['client_wall_ms']:.0f} ms) vs the "
                f"checkpoint's read "
                f"{results['read_s'] * 1e3:.0f} ms")
        p99 = {part: "none" if swap[part] is None else f"{swap[part]['p99_ms']:.1f} ms" for part in ("before", "during")}
        log(f"{swap['answers']} answers {swap['answers_by_version']}, stale {swap['stale_answers']}, failed "
            f"{swap['failed_requests']}; p99 before {p99['before']}, during {p99['during']}; the versions' answers "
            f"apart by {swap['references_apart']:.3f}")
    finally:
        _, results["server_log_tail"] = stop_server(server, log_path)
        shutil.rmtree(workdir / "perturbed", ignore_errors=True)
    stem = f"bench_fleet_swap{'_' + args.label if args.label else ''}"
    save_json(results, args.out, stem)
    save_png(plot_swap(results, pyplot()), args.out, stem)


def add_floors(results: dict, max_batch: int, seconds: float) -> None:
    """Each paced level's floor (fleet_model.py): its robots' schedule against an ideal batcher with
    this run's device time per batch size (medians over every level's answers) and the lone robot's
    host time (client wall minus device at batch 1, half before the device, half after); and the same
    batcher's p99 over 30 other fleets of that size and rate (their phases drawn at random)."""
    measured: dict[int, list[float]] = {}
    for level in results["levels"]:
        for b, ms in level["device_ms_by_batch"].items():
            measured.setdefault(int(b), []).append(ms)
    measured.setdefault(1, []).append(results["batch1"]["device_p50_ms"])
    device_ms = batch_times({b: statistics.median(v) for b, v in measured.items()}, max_batch)
    host = results["batch1"]["client_wall_p50_ms"] - results["batch1"]["device_p50_ms"]
    results["floor_inputs"] = {"device_ms": device_ms, "host_ms": host}
    for level in results["levels"]:
        if level["hz"]:
            phases = [robot_phase(i, level["hz"]) for i in range(level["robots"])]
            ideal = ideal_latencies(phases, level["hz"], seconds, device_ms, host / 2, host / 2)
            level["floor"] = {k: v for k, v in percentiles(ideal).items() if k in ("p50_ms", "p99_ms", "max_ms")}
            others = percentiles(other_fleets_p99(level["robots"], level["hz"], seconds, device_ms, host / 2, host / 2))
            level["floor_other_fleets"] = {"fleets": others["n"], "p99_median_ms": others["p50_ms"],
                                           "p99_p90_ms": others["p90_ms"], "p99_max_ms": others["max_ms"]}
            log(f"{level['robots']:3d} robots at {level['hz']:g} Hz: p99 {level['p99_ms']:.1f} ms against "
                f"{level['floor']['p99_ms']:.1f} for an ideal batcher on these batch times (other fleets' phases: "
                f"median {level['floor_other_fleets']['p99_median_ms']:.1f}, worst "
                f"{level['floor_other_fleets']['p99_max_ms']:.1f}); slowest 1%: "
                + ", ".join(f"{k} {v:.1f}" for k, v in level["slowest"].items()))


def plot(results: dict, out: str, stem: str) -> None:
    plt = pyplot()
    back = [lv for lv in results["levels"] if not lv["hz"]]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    robots = [lv["robots"] for lv in back]
    for key in ("p50_ms", "p99_ms", "max_ms"):
        lat.plot(robots, [lv[key] for lv in back], marker="o", label=key.replace("_ms", ""))
    lat.set(xscale="log", yscale="log", xlabel="robots (back to back)", ylabel="latency (ms)")
    lat.legend()
    thr.plot(robots, [lv["obs_per_s"] for lv in back], marker="o")
    thr.set(xscale="log", xlabel="robots (back to back)", ylabel="observations / s")
    fig.suptitle(f"vlaserve fleet, {results['device']}, openpi-client")
    save_png(fig, out, stem)


if __name__ == "__main__":
    main()
