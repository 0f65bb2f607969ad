"""OpenPI's websocket policy protocol, so robots running the unmodified openpi-client can connect.

The protocol (openpi `serving/websocket_policy_server.py` + openpi-client `websocket_client_policy.py`):
on connect the server sends the policy metadata as one msgpack-numpy frame; then for each binary
frame holding an observation dict it answers one frame {"actions": ndarray [H, action_dim],
"server_timing": {"infer_ms", "prev_total_ms" from the second reply on}, "policy_timing": {...}}.
On an error it sends the message as a text frame (which the client raises as RuntimeError) and
closes with 1011.
"""

from __future__ import annotations

import logging
import time
import traceback

from fastapi import WebSocket, WebSocketDisconnect

from ..errors import InvalidObservation
from .aliases import canonical_observation
from .codec import DecodeError, packb, unpackb
from .schema import ApiError, float_array, image_array, invalid, invalid_observation, noise_array
from .service import Service, binary_frames, ms_since, policy_timing

log = logging.getLogger(__name__)

INTERNAL_ERROR = 1011


def observation_from_openpi(raw, service: Service) -> tuple[dict, object]:
    """An OpenPI/LeRobot/ALOHA observation dict -> (Policy observation, noise or None)."""
    if not isinstance(raw, dict):
        raise invalid(None, "an observation must be a map of observation keys to values")
    metadata = service.metadata
    try:
        canonical = canonical_observation(raw, tuple(metadata["cameras"]), service.settings.camera_aliases,
                                          metadata.get("rename_map"))
    except InvalidObservation as e:
        raise invalid_observation(e) from None
    if "state" not in canonical:
        raise invalid("state", "missing: send the robot state as 'state' or 'observation/state'")
    if "task" not in canonical:
        raise invalid("task", "missing: send the instruction as 'prompt' or 'task'")
    observation = {
        "images": {cam: image_array(image, f"images.{cam}") for cam, image in canonical["images"].items()},
        "state": float_array(canonical["state"], "state"),
        "task": canonical["task"],
    }
    if "images_normalized" in canonical:
        if not isinstance(canonical["images_normalized"], bool):
            raise invalid("images_normalized", "must be true or false")
        observation["images_normalized"] = canonical["images_normalized"]
    noise = canonical.get("noise")
    return observation, None if noise is None else noise_array(noise, "noise", metadata)


async def serve_openpi(websocket: WebSocket, service: Service) -> None:
    route = websocket.scope["path"]  # /openpi/policy, or / for clients that connect without a path
    await websocket.send_bytes(packb(service.metadata))
    prev_total_ms = None
    try:
        async for frame, started in binary_frames(websocket):
            try:
                if frame is None:
                    raise ApiError(400, "invalid_frame", "send observations as msgpack binary frames")
                try:
                    raw = unpackb(frame)
                except DecodeError as e:
                    raise ApiError(400, "invalid_msgpack", str(e)) from None
                observation, noise = observation_from_openpi(raw, service)
                prepared = await service.check(observation, in_request_body=False)
                decode_ms = ms_since(started)
                submitted = time.perf_counter()
                result = await service.infer(prepared, noise)
                infer_ms = ms_since(submitted)
            except ApiError as error:
                await _fail(websocket, service, route, error.type, error.status,
                            f"{error.type}: {error.field + ': ' if error.field else ''}{error.message}")
                return
            except Exception:
                log.exception("openpi request failed")
                await _fail(websocket, service, route, "internal_error", 500, traceback.format_exc())
                return

            encode_start = time.perf_counter()
            server_timing = {"infer_ms": infer_ms}
            if prev_total_ms is not None:
                server_timing["prev_total_ms"] = prev_total_ms
            reply = {"actions": result.actions, "server_timing": server_timing,
                     "policy_timing": policy_timing(result.timings)}
            await websocket.send_bytes(packb(reply))
            service.metrics.observe_stages({"decode_ms": decode_ms, **result.timings,
                                            "encode_ms": ms_since(encode_start)})
            service.metrics.requests.labels(route, "200").inc()
            service.metrics.latency.labels(route).observe(ms_since(started) / 1000.0)
            # Like OpenPI: the previous cycle's total, since this cycle's send isn't done when reported.
            prev_total_ms = ms_since(started)
    except WebSocketDisconnect:
        return


async def _fail(websocket: WebSocket, service: Service, route: str, kind: str, status: int, text: str) -> None:
    service.metrics.errors.labels(route, kind).inc()
    service.metrics.requests.labels(route, str(status)).inc()
    try:
        await websocket.send_text(text)
        await websocket.close(code=INTERNAL_ERROR, reason="Request failed; the reason is in the previous frame.")
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client is already gone
