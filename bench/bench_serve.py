"""The server on a GPU, as a robot sees it: time to the first served action, then latency per route.

Writes a full-size random Pi0.5 checkpoint in the LeRobot layout (common.write_checkpoint),
starts `vlaserve serve CHECKPOINT --device cuda` as a fresh process, and measures
- process start -> /healthz answering, and -> the first action returned to openpi-client;
- p50/p90 wall latency per route at batch 1 (3 uint8 224x224 cameras): HTTP msgpack,
  /v1/actions/realtime, /openpi/policy through the unmodified openpi-client.

    python bench/bench_serve.py [--checkpoint DIR] [--cold] [--serve-args "..."] [--label L] [--requests N] [--out DIR]

Needs openpi-client (bench/prepare_device.sh's wheels). Writes bench_serve[_LABEL].json; --smoke
serves the golden checkpoint on the CPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np

from common import (bench_checkpoint, evict_from_page_cache, log, parser, percentiles, save_json, server_env, start_server,
                    stop_server, wait_until_healthy)


def observation(rng) -> dict:
    return {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.uniform(-1, 1, 14).astype(np.float32), "prompt": "pick up the red block"}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--checkpoint", default=None,
                    help="checkpoint directory (default: a full-size random one written to a temp dir; --smoke: "
                         "the golden one)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache, empty Triton cache")
    ap.add_argument("--serve-args", default="", help="more `vlaserve serve` options, e.g. '--weights-loader safetensors'")
    ap.add_argument("--label", default="", help="suffix of the result file name")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.requests = min(args.requests, 3)

    from openpi_client import msgpack_numpy, websocket_client_policy

    results: dict = {"device": device, "smoke": args.smoke}
    workdir = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    started = time.perf_counter()
    checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(args.smoke, device, workdir)
    results["checkpoint"], results["write_s"] = str(checkpoint), time.perf_counter() - started
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
        while not json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read()).get("fast_path"):
            if time.perf_counter() - started > 240 or device != "cuda":
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
        metadata = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata").read())
        results["metadata"] = {k: metadata.get(k) for k in ("dtype", "device", "fast_path", "parameter_counts")}
    finally:
        results["server_exit_code"], results["server_log_tail"] = stop_server(server, log_path)
        log("--- server log (tail) ---\n" + results["server_log_tail"])

    for route in ("openpi_ws", "http_msgpack", "realtime_ws"):
        if route in results:
            log(f"{route:14s} p50 {results[route]['p50_ms']:.2f} ms  p90 {results[route]['p90_ms']:.2f} ms")
    log(json.dumps({k: v for k, v in results.items() if k != "server_log_tail"}, indent=1))
    save_json(results, args.out, "bench_serve" + (f"_{args.label}" if args.label else ""))


if __name__ == "__main__":
    main()
