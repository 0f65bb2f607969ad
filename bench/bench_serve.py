"""The server on a GPU, as a robot sees it: time to the first served action, then latency per route.

Writes a full-size random Pi0.5 checkpoint in the LeRobot layout (common.write_checkpoint),
starts `vlaserve serve CHECKPOINT --device cuda` as a fresh process, and measures
- process start -> /healthz answering, and -> the first action returned to openpi-client;
- p50/p90 wall latency per route at batch 1 (3 uint8 224x224 cameras): HTTP msgpack,
  /v1/actions/realtime, /openpi/policy through the unmodified openpi-client;
- B observations in one /v1/actions/generations call (the batch form) against B concurrent single
  calls (`--batch B`, default 8): observations a second and p50 wall per call.

`--startup` measures restarts instead (no route latencies): the server is started twice with the
checkpoint evicted from the page cache, first with an empty compile cache, then with the one the
first start filled (`--same-host-restart`: then a third time with the weights left in the page
cache by the second, as a server restarted after a crash on the same machine finds them); each start reports process -> /healthz, -> first action, -> every graph
captured, seconds per graph, and `--robots N` robots (default 16) that start sending back to back
as soon as /healthz answers: errors, wrong answers, captures on the request path, and p99 while
graphs are still being captured against p99 once all are, with the answers a second in each part.

    python bench/bench_serve.py [--checkpoint DIR] [--cold] [--serve-args "..."] [--label L] [--requests N] [--out DIR]
    python bench/bench_serve.py --startup [--robots 16] [--seconds-after 5] [--same-host-restart]

Needs openpi-client (bench/prepare_device.sh's wheels). Writes bench_serve[_LABEL].json; --smoke
serves the golden checkpoint on the CPU.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np

from common import (bench_checkpoint, evict_from_page_cache, log, parser, percentiles, robot_observation, save_json,
                    server_env, start_server, stop_server, wait_until_healthy)
from vlaserve.bytecode import WARN_AT_MODULES, imported_without_bytecode  # noqa: E402  (common puts src/ on the path)


def observation(rng) -> dict:
    return {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.uniform(-1, 1, 14).astype(np.float32), "prompt": "pick up the red block"}


def post_msgpack(port: int, body: dict) -> dict:
    from openpi_client import msgpack_numpy

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/actions/generations", method="POST",
                                 data=msgpack.packb(body, default=msgpack_numpy.pack_array),
                                 headers={"Content-Type": "application/msgpack"})
    return msgpack.unpackb(urllib.request.urlopen(req).read(), object_hook=msgpack_numpy.unpack_array)


def batched_against_single(port: int, request: dict, b: int, rounds: int) -> dict:
    """`rounds` times: b observations in one call (the batch form: a leading dimension of b on every
    array), then b single calls sent at once from b threads. Observations a second over all rounds,
    and p50 wall per call, for each form."""
    from concurrent.futures import ThreadPoolExecutor

    obs = request["input"]["observation"]
    batched = {**request, "input": {**request["input"], "observation": {
        "images": {cam: np.stack([image] * b) for cam, image in obs["images"].items()},
        "state": np.stack([obs["state"]] * b)}}}
    forms = {"one_call": ([batched], 1), "concurrent_single": ([request] * b, b)}
    out: dict = {"batch": b, "rounds": rounds}
    with ThreadPoolExecutor(b) as pool:
        for form, (bodies, threads) in forms.items():
            post_msgpack(port, bodies[0])  # warm: this form's batch shape
            walls, started = [], time.perf_counter()
            for _ in range(rounds):
                def call(body):
                    t0 = time.perf_counter()
                    reply = post_msgpack(port, body)
                    walls.append((time.perf_counter() - t0) * 1e3)
                    return reply
                replies = list(pool.map(call, bodies))
                answered = sum(len(r["data"]) for r in replies)
                assert answered == b and all("action" in item for r in replies for item in r["data"]), replies
            out[form] = {**percentiles(walls), "obs_per_s": b * rounds / (time.perf_counter() - started)}
    out["speedup_obs_per_s"] = out["one_call"]["obs_per_s"] / out["concurrent_single"]["obs_per_s"]
    return out


# A robot's answer further than this from its own answer once every graph is captured is wrong (a
# different batch size changes an answer by bf16 rounding, ~1e-2 at full size; robots differ by ~1).
WRONG_ANSWER = 0.25
# A start where neither a graph is captured nor a robot answered for this long is stalled: the run
# stops there and asks the server for its thread stacks (SIGUSR1) instead of waiting out the bound.
STALL_S = 60.0


def graphs_block(port: int) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata", timeout=10).read())["graphs"]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in values) if values else float("nan")


def startup_run(checkpoint: Path, compile_cache: Path, serve_args: list[str], robots: int, seconds_after: float,
                device: str, log_path: Path, evict: bool = True) -> dict:
    """One start of `vlaserve serve` (page cache evicted, unless `evict` is false): process -> /healthz,
    -> first action, -> every graph captured; `robots` robots back to back from /healthz on, their
    latencies split at the moment the last graph was captured."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    if device == "cuda" and evict:
        evict_from_page_cache(checkpoint)
    out: dict = {"compile_cache_files_before": sum(1 for p in compile_cache.rglob("*") if p.is_file())}
    started = time.perf_counter()
    server, port = start_server("serve", checkpoint, ["--device", device, "--compile-cache", str(compile_cache),
                                                      *serve_args], log_path)
    stop, lock = threading.Event(), threading.Lock()
    answers: list[tuple[float, int, float, np.ndarray]] = []  # (finished at, robot, wall ms, actions)
    errors: list[str] = []
    try:
        wait_until_healthy(server, port, log_path)
        out["process_to_healthz_s"] = time.perf_counter() - started
        meta = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        dims = (meta["state_dim"], meta["action_horizon"], meta["max_action_dim"])
        observations = [robot_observation(i, *dims) for i in range(max(robots, 1))]
        first = WebsocketClientPolicy("127.0.0.1", port).infer(observations[0])
        out["process_to_first_action_s"] = time.perf_counter() - started
        out["graphs_at_first_action"] = graphs_block(port)["captured"]
        log(f"healthz {out['process_to_healthz_s']:.2f} s, first action {out['process_to_first_action_s']:.2f} s "
            f"({out['graphs_at_first_action']} graphs captured)")
        assert first["actions"].shape[0] == dims[1], first["actions"].shape

        def robot(i: int) -> None:
            try:
                client = WebsocketClientPolicy("127.0.0.1", port)
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(repr(e))
                return
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    actions = client.infer(observations[i])["actions"]
                except Exception as e:  # noqa: BLE001 - counted, the robot goes on
                    errors.append(repr(e))
                    continue
                t1 = time.perf_counter()
                with lock:
                    answers.append((t1, i, (t1 - t0) * 1e3, actions))

        threads = [threading.Thread(target=robot, args=(i,), daemon=True) for i in range(robots)]
        for t in threads:
            t.start()
        shown, progress, moved = 0.0, None, time.perf_counter()
        while True:
            block = graphs_block(port)
            if block["pending"] == 0:
                break
            if (block["captured"], len(answers)) != progress:
                progress, moved = (block["captured"], len(answers)), time.perf_counter()
            stalled = time.perf_counter() - moved > STALL_S
            if block.get("error") or server.poll() is not None or stalled or time.perf_counter() - started > 300:
                raise RuntimeError(f"graphs not all captured ({len(answers)} answers, {len(errors)} errors"
                                   f"{f', nothing moved for {STALL_S:.0f} s' if stalled else ''}): "
                                   f"{ {k: v for k, v in block.items() if k != 'per_graph'} }")
            if time.perf_counter() - shown > 10:
                shown = time.perf_counter()
                log(f"{shown - started:.0f} s: {block['captured']} of {block['total']} graphs, {len(answers)} answers, "
                    f"{len(errors)} errors")
            time.sleep(0.05)
        all_captured = time.perf_counter()
        out["process_to_every_graph_s"] = all_captured - started
        # The graphs' memory is measured once the plan is done, just after its last capture (run 235 read it
        # before that, as 0, in both 16-robot starts): wait for "ready" before reading it.
        while block.get("all_captured_after_s") is None and time.perf_counter() - all_captured < 30:
            time.sleep(0.05)
            block = graphs_block(port)
        out["graphs"] = {k: v for k, v in block.items() if not k.endswith("_shapes")}
        out["seconds_per_graph"] = (block["warmup_s"] + block["capture_s"]) / max(block["total"], 1)
        meta = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        out["graph_bytes"] = meta.get("graph_bytes")
        time.sleep(seconds_after)
        stopped = time.perf_counter()
        stop.set()
        for t in threads:
            t.join(timeout=30)
        out["request_path_captures"] = metric(port, "vlaserve_request_path_captures")
        out["uncaptured_calls"] = metric(port, "vlaserve_uncaptured_calls")
    except Exception:
        if server.poll() is None:  # the server's thread stacks into its log (vlaserve's SIGUSR1 handler)
            server.send_signal(signal.SIGUSR1)
            time.sleep(1)
        raise
    finally:
        stop.set()
        out["server_exit_code"], out["server_log_tail"] = stop_server(server, log_path)
    if robots:
        last = {}
        for finished, i, _, actions in answers:
            if finished > all_captured:
                last[i] = actions  # each robot's answer once every graph is captured: its reference
        during = [wall for finished, _, wall, _ in answers if finished <= all_captured]
        after = [wall for finished, _, wall, _ in answers if finished > all_captured]
        wrong = sum(1 for _, i, _, actions in answers if i in last and float(np.abs(actions - last[i]).max()) > WRONG_ANSWER)
        out["fleet"] = {"robots": robots, "answers": len(answers), "errors": len(errors), "error_samples": errors[:3],
                        "wrong": wrong, "during_capture": percentiles(during) if during else None,
                        "after_capture": percentiles(after) if after else None,
                        # answers a second, from /healthz (the robots' start, as the docstring says) to the last
                        # graph and from then to their stop: a longer capture holds more answers, the rate says how
                        # well they were served
                        "answers_per_s_during_capture":
                            len(during) / (all_captured - started - out["process_to_healthz_s"]) if during else None,
                        "answers_per_s_after_capture": len(after) / (stopped - all_captured) if after else None}
        if during and after:
            out["fleet"]["p99_ratio"] = out["fleet"]["during_capture"]["p99_ms"] / out["fleet"]["after_capture"]["p99_ms"]
    log(json.dumps({k: v for k, v in out.items() if k != "server_log_tail"}, indent=1))
    return out


def startup(args, checkpoint: Path, workdir: Path, device: str) -> dict:
    """Two starts: an empty compile cache, then the one the first start filled (page cache evicted before
    each); with --same-host-restart a third, the weights left in the page cache by the second."""
    cache = workdir / "compile-cache"
    results = {}
    starts = ["empty_compile_cache", "warm_compile_cache"] + (["same_host_restart"] if args.same_host_restart else [])
    for label in starts:
        log(f"--- start with {label.replace('_', ' ')} ---")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        results[label] = startup_run(checkpoint, cache, args.serve_args.split(), args.robots, args.seconds_after,
                                     device, Path(args.out) / f"bench_serve_startup_{label}.log",
                                     evict=label != "same_host_restart")
    return results


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--checkpoint", default=None,
                    help="checkpoint directory (default: a full-size random one written to a temp dir; --smoke: "
                         "the golden one)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache, empty Triton cache")
    ap.add_argument("--serve-args", default="", help="more `vlaserve serve` options, e.g. '--prefix-cache 8'")
    ap.add_argument("--label", default="", help="suffix of the result file name")
    ap.add_argument("--batch", type=int, default=None,
                    help="observations in one batched call, and concurrent single calls (default 8; --smoke: 2)")
    ap.add_argument("--startup", action="store_true",
                    help="measure two restarts (empty, then warm compile cache) with robots sending from /healthz on")
    ap.add_argument("--robots", type=int, default=16, help="--startup: robots back to back from /healthz on")
    ap.add_argument("--seconds-after", type=float, default=5.0,
                    help="--startup: how long the robots keep sending once every graph is captured")
    ap.add_argument("--same-host-restart", action="store_true",
                    help="--startup: a third start, the weights still in the page cache (a crash restart on the "
                         "same machine)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.requests = min(args.requests, 3)
    args.batch = args.batch or (2 if args.smoke else 8)

    from openpi_client import msgpack_numpy, websocket_client_policy

    results: dict = {"device": device, "smoke": args.smoke}
    workdir = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    started = time.perf_counter()
    checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(args.smoke, device, workdir)
    results["checkpoint"], results["write_s"] = str(checkpoint), time.perf_counter() - started
    if args.startup:
        if args.smoke:
            args.robots, args.seconds_after = min(args.robots, 2), 0.5
        # Modules the server imports too (torch, vlaserve) with no bytecode are compiled from source at every
        # start, which a pip install or `vlaserve warmup` avoids: the result says how many there were.
        results["modules_without_bytecode"] = len(imported_without_bytecode()[0])
        if results["modules_without_bytecode"] >= WARN_AT_MODULES:
            log(f"warning: {results['modules_without_bytecode']} imported modules have no Python bytecode: each start "
                "below compiles them from source (`vlaserve warmup` or `python -m compileall` writes it)")
        results["startup"] = startup(args, checkpoint, workdir, device)
        save_json(results, args.out, "bench_serve_startup" + (f"_{args.label}" if args.label else ""))
        return
    env = server_env()
    if args.cold:
        # As after a reboot: weights not in the page cache, no compiled Triton kernels.
        evict_from_page_cache(checkpoint)
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    results["cold"] = args.cold
    results["serve_args"] = args.serve_args
    log_path = workdir / "server.log"
    started = time.perf_counter()
    server, port = start_server("serve", checkpoint, ["--device", device, *args.serve_args.split()], log_path, env)
    try:
        wait_until_healthy(server, port, log_path)
        results["process_to_healthz_s"] = time.perf_counter() - started
        rng = np.random.default_rng(0)
        client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
        first = client.infer(observation(rng))
        results["process_to_first_action_s"] = time.perf_counter() - started
        results["first_action_shape"] = list(first["actions"].shape)
        results["first_action_timing"] = {**first.get("server_timing", {}), **first.get("policy_timing", {})}
        log("time to first served action:", round(results["process_to_first_action_s"], 2), "s")
        # The routes are timed once every graph is captured (the default warm-up serves from batch 1's on).
        while graphs_block(port)["pending"] and time.perf_counter() - started < 300:
            time.sleep(0.05)
        results["process_to_every_graph_s"] = time.perf_counter() - started
        log("every CUDA graph captured after:", round(results["process_to_every_graph_s"], 2), "s")

        walls, server_ms = [], []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            out = client.infer(observation(rng))
            walls.append((time.perf_counter() - t0) * 1e3)
            server_ms.append(out["server_timing"]["infer_ms"])
        results["openpi_ws"] = {**percentiles(walls), "server_infer_p50_ms": statistics.median(server_ms)}

        body_obs = observation(rng)
        request = {"input": {"task": "pick up the red block", "observation": {
            "images": {"base_0_rgb": body_obs["observation/image"], "left_wrist_0_rgb": body_obs["observation/wrist_image"]},
            "state": body_obs["observation/state"]}}, "parameters": {"seed": 0}, "runtime": {"return_timing": True}}
        payload = msgpack.packb(request, default=msgpack_numpy.pack_array)
        walls, model_ms = [], []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/actions/generations", data=payload, method="POST",
                                         headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
            reply = msgpack.unpackb(urllib.request.urlopen(req).read(), object_hook=msgpack_numpy.unpack_array)
            walls.append((time.perf_counter() - t0) * 1e3)
            model_ms.append(reply["timings"]["prefix_ms"] + reply["timings"]["denoise_ms"])
        results["http_msgpack"] = {**percentiles(walls), "model_p50_ms": statistics.median(model_ms),
                                   "timings_last": reply["timings"]}

        import websockets.sync.client as ws_client

        walls = []
        with ws_client.connect(f"ws://127.0.0.1:{port}/v1/actions/realtime", max_size=None, compression=None) as ws:
            ws.recv()  # metadata frame
            for _ in range(args.requests):
                t0 = time.perf_counter()
                ws.send(payload)
                msgpack.unpackb(ws.recv(), object_hook=msgpack_numpy.unpack_array)
                walls.append((time.perf_counter() - t0) * 1e3)
        results["realtime_ws"] = percentiles(walls)
        results["batch_request"] = batched_against_single(port, request, args.batch, max(3, args.requests // 3))
        metadata = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        results["metadata"] = {k: metadata.get(k) for k in ("dtype", "device", "fast_path", "parameter_counts")}
    finally:
        results["server_exit_code"], results["server_log_tail"] = stop_server(server, log_path)
        log("--- server log (tail) ---\n" + results["server_log_tail"])

    for route in ("openpi_ws", "http_msgpack", "realtime_ws"):
        if route in results:
            log(f"{route:14s} p50 {results[route]['p50_ms']:.2f} ms  p90 {results[route]['p90_ms']:.2f} ms")
    for form, row in results.get("batch_request", {}).items():
        if isinstance(row, dict):
            log(f"{form:14s} {row['obs_per_s']:.1f} obs/s, p50 {row['p50_ms']:.2f} ms a call")
    log(json.dumps({k: v for k, v in results.items() if k != "server_log_tail"}, indent=1))
    save_json(results, args.out, "bench_serve" + (f"_{args.label}" if args.label else ""))


if __name__ == "__main__":
    main()
