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

from fastapi import WebSocket, WebSocketDisconnect

from ..errors import InvalidInput
from ..types import Observation, Request
from .bodies import decode
from .codec import packb
from .schema import ApiError, api_error, invalid, tensor_field
from .service import Service, ms_since, policy_timing

log = logging.getLogger(__name__)

INTERNAL_ERROR = 1011


# SGLang's per-request toggles on this socket: Request field -> its key, and the older name.
TOGGLE_KEYS = {"prefix_cache": ("enable_prefix_cache", "enable_pi_prefix_cache"),
               "cuda_graph": ("enable_cuda_graph", "enable_pi_cuda_graph")}


def _toggles(raw: dict) -> dict:
    """Pops SGLang's toggles out of an observation dict: {Request field: bool} (`"auto"` is True)."""
    toggles = {}
    for target, names in TOGGLE_KEYS.items():
        given = [name for name in names if name in raw]
        if len(given) > 1:
            raise invalid(given[1], f"given twice (as {given[0]!r} too)")
        if given:
            value = raw.pop(given[0])
            if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):
                raise invalid(given[0], 'must be true, false or "auto"')
            toggles[target] = value is not False
    return toggles


def request_from_openpi(raw, service: Service) -> Request:
    """An OpenPI/LeRobot/ALOHA observation dict -> a Request. Besides noise, SGLang's options:
    num_inference_steps, enable_prefix_cache / enable_cuda_graph (or their enable_pi_ names)."""
    if not isinstance(raw, dict):
        raise invalid(None, "an observation must be a map of observation keys to values")
    # Tensor objects (SGLang's JSON form of arrays) as ndarrays, here and one level down (images).
    raw = {key: {k: tensor_field(v, f"{key}.{k}") for k, v in value.items()}
           if isinstance(value, dict) and "values" not in value else tensor_field(value, key)
           for key, value in raw.items()}
    num_steps, toggles = raw.pop("num_inference_steps", None), _toggles(raw)
    try:
        canonical = service.layout.canonical(raw)
        if "state" not in canonical:
            raise invalid("state", "missing: send the robot state as 'state' or 'observation/state'")
        if "task" not in canonical:
            raise invalid("task", "missing: send the instruction as 'prompt' or 'task'")
        observation = Observation.create(canonical["images"], canonical["state"], canonical["task"],
                                         canonical.get("images_normalized", False))
        return Request.create(observation, noise=canonical.get("noise"), num_steps=num_steps,
                              default_steps=service.identity["num_inference_steps"],
                              prefix_cache=toggles.get("prefix_cache", True), cuda_graph=toggles.get("cuda_graph", True))
    except InvalidInput as e:
        raise api_error(e) from None


async def serve_openpi(websocket: WebSocket, service: Service) -> None:
    route = websocket.scope["path"]  # /openpi/policy, or / for clients that connect without a path
    await websocket.send_bytes(packb(service.public_metadata()))
    prev_total_ms = None
    try:
        async for frame, started in service.sessions.frames(websocket):
            try:
                if frame is None:
                    raise ApiError(400, "invalid_frame", "send observations as msgpack binary frames")
                raw = await decode(frame, "msgpack", service.workers)
                request = request_from_openpi(raw, service)
                request.client = id(websocket)
                decode_ms = ms_since(started)
                submitted = time.perf_counter()
                result = await service.infer(request, in_request_body=False)
                infer_ms = ms_since(submitted)
            except ApiError as error:
                await _fail(websocket, service, route, error)
                return
            except Exception:  # noqa: BLE001 - the traceback goes to the log, never to the client
                log.exception("openpi request failed")
                await _fail(websocket, service, route, ApiError(
                    500, "internal_error", "the server failed to handle this request; see the server log"))
                return

            encode_start = time.perf_counter()
            server_timing = {"infer_ms": infer_ms}
            if prev_total_ms is not None:
                server_timing["prev_total_ms"] = prev_total_ms
            reply = {"actions": result.actions, "server_timing": server_timing,
                     "policy_timing": policy_timing(result.timings)}
            await websocket.send_bytes(packb(reply))
            # Like OpenPI: the previous cycle's total, since this cycle's send isn't done when reported;
            # frame received -> reply sent, so the bookkeeping below is not in it.
            prev_total_ms = ms_since(started)
            service.metrics.observe_stages({"decode_ms": decode_ms, **result.timings,
                                            "encode_ms": ms_since(encode_start)})
            service.metrics.requests.labels(route, "200").inc()
            service.metrics.latency.labels(route).observe(prev_total_ms / 1000.0)
    except WebSocketDisconnect:
        return


async def _fail(websocket: WebSocket, service: Service, route: str, error: ApiError) -> None:
    """One line, `type: field: message`, the same type and message an HTTP client would get."""
    service.metrics.errors.labels(route, error.type).inc()
    service.metrics.requests.labels(route, str(error.status)).inc()
    try:
        await websocket.send_text(f"{error.type}: {error.field + ': ' if error.field else ''}{error.message}")
        await websocket.close(code=INTERNAL_ERROR, reason="Request failed; the reason is in the previous frame.")
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client is already gone
