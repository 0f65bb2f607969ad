"""Probe (issue 44): where a lone robot's frames spend their time on the way to the device, and whether
their upload can run beside the event loop's other work.

    python bench/probes/frames_upload.py OUT.json [CALLS]

In one process on a CUDA host, for bench_fleet's observation (3 uint8 224x224 cameras, sent by
openpi-client) on the golden checkpoint's preprocessing, each call from a fresh copy of the message
(as the websocket hands the server one), with 15 ms asleep before each (the device's batch-1 time:
a lone robot's server is idle between frames), p50 / p99 us of host time:
- decode, request (validation), prepare (with its host stack of the frames), collate;
- into_buffers into static buffers of the fast path's layout, whole, and its parts: the stacked
  frames up from pageable memory, their conversion (three kernels), masks and tokens up;
- the frames up one camera at a time from the decoded views (no host stack) into one device tensor;
- the frames copied into a pinned block (np.copyto), and that block up;
- the upload of the three frames on a second thread while this one prepares the request
  (request + prepare + collate), against the two in turn: what overlapping them would save;
- the device time of the upload (events around the stacked frames' copy).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from openpi_client import msgpack_numpy  # noqa: E402

from common import golden_checkpoint, robot_observation  # noqa: E402
from vlaserve import Policy  # noqa: E402
from vlaserve.processing.images import bytes_to_model_range  # noqa: E402
from vlaserve.processing.prepare import into_buffers  # noqa: E402
from vlaserve.runtime.fast.buffers import BufferSpec  # noqa: E402
from vlaserve.server.codec import unpackb  # noqa: E402
from vlaserve.server.openpi import request_from_openpi  # noqa: E402
from vlaserve.server.service import ServerSettings, Service  # noqa: E402

IDLE_S = 0.015


def spread(us: list[float]) -> dict:
    us = sorted(us)
    return {"p50_us": round(statistics.median(us), 1), "p99_us": round(us[min(len(us) - 1, round(0.99 * (len(us) - 1)))], 1)}


def main() -> None:
    out, calls = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 300
    device = torch.device("cuda")
    policy = Policy.from_pretrained(golden_checkpoint(), device="cpu", dtype="float32", progress=False)
    torch.set_num_threads(1)  # as the server on a GPU (Runtime.limit_host_threads)
    service = Service(policy, ServerSettings())
    c = policy.config
    message = msgpack_numpy.packb(robot_observation(0, c.state_dim, c.action_horizon, c.model.max_action_dim))
    buf = BufferSpec.of(c, 1, torch.bfloat16).allocate(device)
    side = c.image_resolution[0]
    per_slot = torch.empty((1, len(c.cameras), side, side, 3), dtype=torch.uint8, device=device)
    pinned = torch.empty((1, len(c.cameras), side, side, 3), dtype=torch.uint8, pin_memory=True)
    pool = ThreadPoolExecutor(1, thread_name_prefix="upload")
    stages: dict[str, list[float]] = {}
    device_ms: list[float] = []

    def note(name: str, start: int) -> int:
        now = time.perf_counter_ns()
        stages.setdefault(name, []).append((now - start) / 1e3)
        return now

    def fresh():
        return unpackb(bytes(bytearray(message)), 1024)

    def frames_of(decoded) -> list[np.ndarray]:
        return [decoded[f"observation/images/{k}"] if f"observation/images/{k}" in decoded else
                decoded[f"observation.images.{k}"] for k in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")]

    def upload_per_slot(frames: list[np.ndarray]) -> None:
        for i, f in enumerate(frames):
            per_slot[0, i].copy_(torch.from_numpy(f), non_blocking=True)

    for call in range(calls):
        torch.cuda.synchronize()
        time.sleep(IDLE_S)
        payload = bytes(bytearray(message))
        t = time.perf_counter_ns()
        decoded = unpackb(payload, 1024)
        t = note("decode", t)
        request = request_from_openpi(decoded, service)
        t = note("request", t)
        policy.prepare(request)
        t = note("prepare", t)
        inputs, noise, _ = policy.preprocessor.collate([request])
        t = note("collate", t)
        into_buffers(inputs, buf)
        note("into_buffers", t)
        torch.cuda.synchronize()

        # its parts, each after an idle pause, on this call's prepared inputs
        time.sleep(IDLE_S)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter_ns()
        start.record()
        up = inputs.images.to(device, non_blocking=True)
        end.record()
        t = note("frames_up_stacked_pageable", t)
        bytes_to_model_range(up, out=buf["images"])
        t = note("convert_3_kernels", t)
        for name in ("image_masks", "tokens", "token_mask"):
            buf[name].copy_(getattr(inputs, name), non_blocking=True)
        note("masks_tokens_up", t)
        torch.cuda.synchronize()
        device_ms.append(start.elapsed_time(end))

        time.sleep(IDLE_S)
        frames = frames_of(fresh())
        t = time.perf_counter_ns()
        upload_per_slot(frames)
        note("frames_up_per_camera_pageable", t)
        torch.cuda.synchronize()

        time.sleep(IDLE_S)
        frames = frames_of(fresh())
        t = time.perf_counter_ns()
        for i, f in enumerate(frames):
            np.copyto(pinned[0, i].numpy(), f)
        t = note("frames_into_pinned", t)
        per_slot.copy_(pinned, non_blocking=True)
        note("pinned_up", t)
        torch.cuda.synchronize()

        # the upload beside the request's preparation, against the two in turn
        time.sleep(IDLE_S)
        decoded = fresh()
        t = time.perf_counter_ns()
        upload = pool.submit(upload_per_slot, frames_of(decoded))
        request = request_from_openpi(decoded, service)
        policy.prepare(request)
        policy.preprocessor.collate([request])
        upload.result()
        note("upload_beside_prepare", t)
        torch.cuda.synchronize()
        time.sleep(IDLE_S)
        decoded = fresh()
        t = time.perf_counter_ns()
        upload_per_slot(frames_of(decoded))
        request = request_from_openpi(decoded, service)
        policy.prepare(request)
        policy.preprocessor.collate([request])
        note("upload_then_prepare", t)
        torch.cuda.synchronize()

    result = {"calls": calls, "idle_ms": IDLE_S * 1e3, "device": torch.cuda.get_device_name(),
              "message_bytes": len(message), "host_us": {k: spread(v) for k, v in stages.items()},
              "stacked_upload_device_us": spread([1e3 * m for m in device_ms])}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
