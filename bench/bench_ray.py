"""The Ray Serve fleet against `vlaserve serve`, as robots see them: the proxy's added latency, and
throughput and p99 with 1..N replicas.

Starts each server as a fresh process on 127.0.0.1, one at a time: `vlaserve serve` (the baseline),
then `vlaserve serve-ray --replicas R` for each R. Against each it measures, sequentially:
- metadata: GET /v1/actions/metadata, no model: the serving stack's own round trip;
- http_1step: POST /v1/actions/generations (msgpack, one 224x224 camera, num_inference_steps=1);
- openpi: one openpi-client robot on / (the checkpoint's default steps);
then `--robots` concurrent robots, each on its own HTTP client with its own X-Robot-Id, for
`--seconds`: requests per second and p50/p99 latency.

    python3 bench/bench_ray.py                                    # CPU: golden checkpoint, replicas 1 and 2
    python3 bench/bench_ray.py --device cuda --replicas 1         # one GPU: Ray vs vlaserve serve
    python3 bench/bench_ray.py --checkpoint DIR --replicas 1,2,4 --robots 16

Writes JSON to --out (default bench/results/bench_ray_<device>.json) and prints it. On CUDA without
--checkpoint it writes a full-size random checkpoint (as bench_serve.py). Needs vlaserve[ray] and openpi-client.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "client" / "src"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(ms: list[float]) -> dict:
    ms = sorted(ms)
    at = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731 - nearest rank
    return {"p50_ms": round(statistics.median(ms), 3), "p90_ms": round(at(0.9), 3), "p99_ms": round(at(0.99), 3),
            "n": len(ms)}


class Server:
    """A `vlaserve serve` or `serve-ray` process, ready once /healthz answers."""

    def __init__(self, command: str, checkpoint: Path, args: list[str], env: dict, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.started = time.perf_counter()
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "vlaserve.cli", command, str(checkpoint),
                                          "--port", str(self.port), *args], env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def wait_ready(self, bound_s: float = 900) -> float:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            if time.perf_counter() - self.started > bound_s:
                raise RuntimeError(f"not ready after {bound_s} s:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def generation_body(rng, state_dim: int, steps: int | None) -> bytes:
    from openpi_client import msgpack_numpy

    body = {"input": {"task": "pick up the red block", "observation": {
        "images": {"base_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)},
        "state": rng.uniform(-1, 1, state_dim).astype(np.float32)}}}
    if steps is not None:
        body["parameters"] = {"num_inference_steps": steps}
    return msgpack_numpy.packb(body)


MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def timed(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure(url: str, port: int, args) -> dict:
    from openpi_client import websocket_client_policy

    rng = np.random.default_rng(0)
    results = {}
    with httpx.Client(base_url=url, timeout=120) as http:
        metadata = http.get("/v1/actions/metadata").json()
        state_dim = metadata["state_dim"]
        body = generation_body(rng, state_dim, steps=1)

        def post(client=http, robot="robot-0", payload=body):
            r = client.post("/v1/actions/generations", content=payload, headers={**MSGPACK, "x-robot-id": robot})
            r.raise_for_status()

        timed(lambda: http.get("/v1/actions/metadata"), 5)  # warm connections and caches
        timed(post, 3)
        results["metadata"] = percentiles(timed(lambda: http.get("/v1/actions/metadata").raise_for_status(),
                                                args.requests * 4))
        results["http_1step"] = percentiles(timed(post, args.requests))
    robot = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
    frame = {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
             "observation/state": rng.uniform(-1, 1, state_dim).astype(np.float32), "prompt": "pick up the red block"}
    robot.infer(frame)
    results["openpi"] = percentiles(timed(lambda: robot.infer(frame), args.requests))
    robot._ws.close()
    results["fleet"] = concurrent_robots(url, state_dim, args)
    return results


def concurrent_robots(url: str, state_dim: int, args) -> dict:
    """`args.robots` robots, each one sequential HTTP request after another (its own id and client),
    for `args.seconds`: what a fleet of robots gets from the server."""
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + args.seconds
    errors = []

    def robot(i: int) -> None:
        rng = np.random.default_rng(100 + i)
        payload = generation_body(rng, state_dim, steps=None)
        with httpx.Client(base_url=url, timeout=120) as http:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                r = http.post("/v1/actions/generations", content=payload, headers={**MSGPACK, "x-robot-id": f"r{i}"})
                if r.status_code != 200:
                    errors.append(r.status_code)
                with lock:
                    latencies.append((time.perf_counter() - t0) * 1e3)

    started = time.perf_counter()
    threads = [threading.Thread(target=robot, args=(i,)) for i in range(args.robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {"robots": args.robots, "seconds": round(elapsed, 2), "requests_per_s": round(len(latencies) / elapsed, 3),
            "errors": len(errors), **percentiles(latencies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--checkpoint", default=None, help="default: the golden checkpoint on CPU, a random "
                                                       "full-size one (written to a temp dir) on CUDA")
    ap.add_argument("--replicas", default="1,2", help="replica counts to run through Ray, e.g. 1 or 1,2")
    ap.add_argument("--requests", type=int, default=20, help="sequential requests per route")
    ap.add_argument("--robots", type=int, default=4, help="concurrent robots for the throughput phase")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of the throughput phase")
    ap.add_argument("--cpus-per-replica", type=float, default=None,
                    help="CPUs per Ray replica, and torch threads of both servers (default: 1 on CPU, 8 on CUDA)")
    ap.add_argument("--serve-args", default="", help="more options for both servers, e.g. '--dtype float32'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is None and args.device == "cpu":
        from fixtures import fixture_dir

        checkpoint = fixture_dir("pi05_golden") / "checkpoint"
    elif checkpoint is None:
        from bench_memory import write_checkpoint
        from fixtures import fixture_dir
        from vlaserve.config import ModelConfig

        checkpoint = Path(tempfile.mkdtemp()) / "pi05-random-full"
        checkpoint.mkdir(parents=True)
        write_checkpoint(checkpoint, fixture_dir("pi05_golden") / "checkpoint", ModelConfig.full_size(), args.device)
    if args.cpus_per_replica is None:
        args.cpus_per_replica = 1.0 if args.device == "cpu" else 8.0
    # Blocking warm-up for the baseline too: /healthz then means the CUDA graphs are captured, as a
    # Ray replica's readiness does, so no eager call is timed.
    common = ["--device", args.device, "--warmup", "blocking", *args.serve_args.split()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "client" / "src"), os.environ.get("PYTHONPATH")]))}
    # The same torch threads in the baseline as in a Ray replica (Ray sets a replica's
    # OMP_NUM_THREADS to its CPUs unless set), so the difference is the serving path, not the arithmetic.
    env["OMP_NUM_THREADS"] = str(max(1, int(args.cpus_per_replica)))
    logs = Path(tempfile.mkdtemp(prefix="bench_ray-"))
    results = {"device": args.device, "checkpoint": str(checkpoint), "cpu_count": os.cpu_count(),
               "omp_num_threads": env.get("OMP_NUM_THREADS"), "args": vars(args), "runs": {}}
    import ray

    results["ray_version"] = ray.__version__
    gpus = [] if args.device == "cpu" else ["--gpus-per-replica", "1"]
    plan = [("vlaserve_serve", "serve", [])] + [
        (f"ray_{r}_replicas", "serve-ray", ["--replicas", str(r), "--cpus-per-replica", str(args.cpus_per_replica),
                                            *gpus]) for r in map(int, args.replicas.split(","))]
    for label, command, extra in plan:
        log(f"== {label}")
        server = Server(command, checkpoint, common + extra, env, logs / f"{label}.log")
        try:
            ready_s = server.wait_ready()
            run = {"ready_s": round(ready_s, 1), **measure(server.url, server.port, args)}
        finally:
            run_exit = server.stop()
        run["exit_code"] = run_exit
        results["runs"][label] = run
        log(json.dumps(run))
    base, one = results["runs"]["vlaserve_serve"], results["runs"].get("ray_1_replicas")
    if one:
        results["ray_added_p50_ms"] = {route: round(one[route]["p50_ms"] - base[route]["p50_ms"], 3)
                                       for route in ("metadata", "http_1step", "openpi")}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"bench_ray_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
