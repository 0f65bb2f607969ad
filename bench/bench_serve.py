"""The server on a GPU, as a robot sees it: time to the first served action, then latency per route.

Writes a full-size random Pi0.5 checkpoint in the LeRobot layout (bench_memory.write_checkpoint),
starts `vlaserve serve CHECKPOINT --device cuda` as a fresh process, and measures
- process start -> /healthz answering, and -> the first action returned to openpi-client;
- p50/p90 wall latency per route at batch 1 (3 uint8 224x224 cameras): HTTP msgpack,
  /v1/actions/realtime, /openpi/policy through the unmodified openpi-client.

    python bench/bench_serve.py [--checkpoint DIR] [--cold] [--serve-args "..."] [--label L] [--requests N] [--out DIR]

Needs fastapi/uvicorn/websockets/openpi-client (carried as wheels on the GPU machine).
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
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "client" / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def log(*args):
    print(*args, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int) -> None:
    """Polls /healthz until it answers 200; raises with the server's log if the process exits first."""
    while True:
        if server.poll() is not None:
            raise RuntimeError("server exited:\n" + server.stdout.read()[-4000:])
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return
        except OSError:  # refused, or 503 while the runtime warms up
            time.sleep(0.1)


def observation(rng) -> dict:
    return {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.uniform(-1, 1, 14).astype(np.float32), "prompt": "pick up the red block"}


def stats(times: list[float]) -> dict:
    times = sorted(times)
    return {"p50_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))], "n": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None,
                    help="checkpoint directory; written (random, full size) when missing (default: a temp dir)")
    ap.add_argument("--template", default=str(ROOT / ".golden" / "checkpoint"))
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache, empty Triton cache")
    ap.add_argument("--serve-args", default="", help="more `vlaserve serve` options, e.g. '--weights-loader safetensors'")
    ap.add_argument("--label", default="", help="suffix of the result file name")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()

    from openpi_client import msgpack_numpy, websocket_client_policy

    results: dict = {}
    checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp()) / "pi05-random-full"
    if not checkpoint.exists():
        import torch

        from bench_memory import write_checkpoint
        from vlaserve.config import ModelConfig

        checkpoint.mkdir(parents=True)
        started = time.perf_counter()
        results["weight_bytes"] = write_checkpoint(checkpoint, Path(args.template), ModelConfig.full_size(), args.device)
        results["write_s"] = time.perf_counter() - started
        torch.cuda.empty_cache()
        log(f"checkpoint written in {results['write_s']:.1f} s")

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "client" / "src"), os.environ.get("PYTHONPATH")]))}
    if args.cold:
        # As after a reboot: weights not in the page cache, no compiled Triton kernels.
        from bench_memory import evict_from_page_cache

        evict_from_page_cache(Path(checkpoint))
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    results["cold"] = args.cold
    results["serve_args"] = args.serve_args
    started = time.perf_counter()
    command = [sys.executable, "-m", "vlaserve.cli", "serve", str(checkpoint), "--device", args.device,
               "--port", str(port), *args.serve_args.split()]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_healthy(server, port)
        results["process_to_healthz_s"] = time.perf_counter() - started
        rng = np.random.default_rng(0)
        client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
        first = client.infer(observation(rng))
        results["process_to_first_action_s"] = time.perf_counter() - started
        results["first_action_shape"] = list(first["actions"].shape)
        results["first_action_timing"] = {**first.get("server_timing", {}), **first.get("policy_timing", {})}
        log("time to first served action:", round(results["process_to_first_action_s"], 2), "s")
        while not json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read()).get("fast_path"):
            if time.perf_counter() - started > 240 or args.device != "cuda":
                break
            client.infer(observation(rng))  # served by the eager model meanwhile
            time.sleep(0.05)
        results["process_to_fast_path_s"] = time.perf_counter() - started
        log("fast path serving after:", round(results["process_to_fast_path_s"], 2), "s")

        walls, server_ms = [], []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            out = client.infer(observation(rng))
            walls.append((time.perf_counter() - t0) * 1e3)
            server_ms.append(out["server_timing"]["infer_ms"])
        results["openpi_ws"] = {**stats(walls), "server_infer_p50_ms": statistics.median(server_ms)}

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
        results["http_msgpack"] = {**stats(walls), "model_p50_ms": statistics.median(model_ms),
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
        results["realtime_ws"] = stats(walls)
        metadata = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        results["metadata"] = {k: metadata.get(k) for k in ("dtype", "device", "fast_path", "parameter_counts")}
    finally:
        server.terminate()
        try:
            results["server_exit_code"] = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        results["server_log_tail"] = "\n".join(line for line in server.stdout.read().splitlines()
                                               if "loading weights" not in line)[-2500:]
        log("--- server log (tail) ---\n" + results["server_log_tail"])

    for route in ("openpi_ws", "http_msgpack", "realtime_ws"):
        if route in results:
            log(f"{route:14s} p50 {results[route]['p50_ms']:.2f} ms  p90 {results[route]['p90_ms']:.2f} ms")
    log(json.dumps({k: v for k, v in results.items() if k != "server_log_tail"}, indent=1))
    for d in filter(None, [ROOT / "bench" / "results", Path(args.out) if args.out else None]):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"bench_serve{'_cold' if args.cold else ''}{'_' + args.label if args.label else ''}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
