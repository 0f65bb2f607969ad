"""OpenPI's websocket policy protocol, so robots running the unmodified openpi-client can connect.

The protocol (openpi `serving/websocket_policy_server.py` + openpi-client `websocket_client_policy.py`):
on connect the server sends the policy metadata as one msgpack-numpy frame; then for each binary
frame holding an observation dict it answers one frame {"actions": ndarray [H, action_dim],
"server_timing": {"infer_ms", "prev_total_ms" from the second reply on}, "policy_timing": {...}}.
On an error it sends the message as a text frame (which the client raises as RuntimeError) and
closes with 1011.
"""

from __future__ import annotations

import functools
import logging
import time

from fastapi import WebSocket, WebSocketDisconnect

from ..errors import InvalidInput
from ..types import Observation, Request
from .codec import packb
from .schema import ApiError, api_error, invalid, tensor_field
from .replies import ms_since, policy_timing
from .service import Service
from .sockets import FrameSession

log = logging.getLogger(__name__)

INTERNAL_ERROR = 1011
# What OpenPI's own server does and this one does not: said where an OpenPI user looks (the socket's metadata
# frame, the server log at the first connection), since the actions differ without any error.
TRANSFORMS_WARNING = ("OpenPI's data transforms (ALOHA's joint and gripper flips, delta actions, DROID's action "
                      "space) are not applied here: the policy takes and returns what its checkpoint's LeRobot "
                      "processors define, so a checkpoint trained behind those transforms needs them on the robot "
                      "side (docs/checkpoints.md#openpi-converted-checkpoints)")


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
    _log_transforms_warning()
    await OpenPISession(websocket, service).serve({**service.public_metadata(), "warnings": [TRANSFORMS_WARNING]})


class OpenPISession(FrameSession):
    name = "openpi"
    not_binary = "send observations as msgpack binary frames"

    def __init__(self, websocket: WebSocket, service: Service):
        super().__init__(websocket, service)
        self.route = websocket.scope["path"]  # /openpi/policy, or / for clients that connect without a path
        self.prev_total_ms = None

    async def answer(self, raw, frame: bytes, started: float) -> tuple:
        """The request's result, and the time to decode it and to infer it (ms)."""
        request = request_from_openpi(raw, self.service)
        request.client = id(self.websocket)
        decode_ms = ms_since(started)
        submitted = time.perf_counter()
        result = await self.service.infer(request, in_request_body=False)
        return result, decode_ms, ms_since(submitted)

    async def send(self, answered: tuple, started: float) -> None:
        result, decode_ms, infer_ms = answered
        encode_start = time.perf_counter()
        server_timing = {"infer_ms": infer_ms}
        if self.prev_total_ms is not None:
            server_timing["prev_total_ms"] = self.prev_total_ms
        reply = {"actions": result.actions, "server_timing": server_timing,
                 "policy_timing": policy_timing(result.timings)}
        await self.websocket.send_bytes(packb(reply))
        # Like OpenPI: the previous cycle's total, since this cycle's send isn't done when reported;
        # frame received -> reply sent, so the bookkeeping below is not in it.
        self.prev_total_ms = ms_since(started)
        metrics = self.service.metrics
        metrics.observe_stages({"decode_ms": decode_ms, **result.timings, "encode_ms": ms_since(encode_start)})
        metrics.request_done(self.route, 200, self.prev_total_ms / 1000.0, id(self.websocket))

    async def fail(self, error: ApiError, started: float) -> bool:
        """One line, `type: field: message`, the same type and message an HTTP client would get; then the
        socket closes (openpi-client raises the line as RuntimeError)."""
        metrics = self.service.metrics
        metrics.errors.labels(self.route, error.type).inc()
        metrics.request_done(self.route, error.status, None, id(self.websocket))
        try:
            await self.websocket.send_text(f"{error.type}: {error.field + ': ' if error.field else ''}{error.message}")
            await self.websocket.close(code=INTERNAL_ERROR, reason="Request failed; the reason is in the previous frame.")
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client is already gone
        return False


@functools.cache
def _log_transforms_warning() -> None:
    log.warning("an OpenPI client connected: %s", TRANSFORMS_WARNING)

