"""What the sync and asyncio clients share: errors, the two wire protocols, URLs, auth, backoff.

Nothing here does I/O, so `sync.py` and `aio.py` differ only in how they move frames.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .codec import packb, unpackb

log = logging.getLogger(__name__)


# ---- errors ---------------------------------------------------------------------------------------
class ClientError(Exception):
    """Base class of every error the client raises on purpose."""


class ServerError(ClientError):
    """The server refused a request: `type` (e.g. invalid_observation), the `field` at fault, `message`."""

    def __init__(self, type: str, field: str | None, message: str):
        where = f" at {field}" if field else ""
        super().__init__(f"{type}{where}: {message}")
        self.type, self.field, self.message = type, field, message


class BatchError(ClientError):
    """Some observations of `infer_batch` failed: `replies[i]` is item i's Reply (None where it failed),
    `errors[i]` its ServerError (None where it succeeded)."""

    def __init__(self, replies: list, errors: list):
        failed = [i for i, e in enumerate(errors) if e is not None]
        super().__init__(f"{len(failed)} of {len(errors)} observations failed; the first, item {failed[0]}: "
                         f"{errors[failed[0]]}")
        self.replies, self.errors = replies, errors


class AuthenticationError(ClientError):
    """The server answered the handshake with HTTP 401: missing or wrong API key. Never retried."""


class ConnectionLost(ClientError, ConnectionError):
    """The connection closed while a request was in flight; the next call reconnects."""


class RtcNotSupported(ClientError):
    """RTC guidance was asked of a protocol (OpenPI's) or server that has none."""


@dataclass(frozen=True)
class Reply:
    actions: np.ndarray            # [action_horizon, action_dim] float32, robot units
    round_trip_ms: float           # send -> reply decoded, as the client saw it
    server_timing: dict = field(default_factory=dict)
    # Asked for with return_noise / return_trace (realtime protocol), else None; model space, float32.
    noise: np.ndarray | None = None  # [action_horizon, padded_action_dim]: send it back as the observation's
                                     # "noise" and the server answers the same actions, bit for bit
    trace: np.ndarray | None = None  # [num_inference_steps + 1, action_horizon, padded_action_dim]: x before
                                     # each Euler step and after the last (trace[0] is the noise)


# ---- protocols ------------------------------------------------------------------------------------
class RealtimeProtocol:
    """WS /v1/actions/realtime: generation request bodies in, envelopes (or errors) out."""

    name, path = "realtime", "/v1/actions/realtime"

    @staticmethod
    def encode(observation: Mapping, rtc: Mapping | None, seed: int | list[int] | None,
               num_inference_steps: int | None, return_noise: bool = False, return_trace: bool = False) -> bytes:
        obs = dict(observation)
        if ("task" in obs) == ("prompt" in obs):
            raise ValueError("the observation needs exactly one of 'task' and 'prompt' (the instruction)")
        task = obs.pop("task", None) or obs.pop("prompt")
        runtime = {"output_format": "numpy", "return_timing": True}
        # Sent only when asked for: a server older than these options refuses fields it does not know.
        runtime.update({k: True for k, asked in (("return_noise", return_noise), ("return_trace", return_trace))
                        if asked})
        body = {"input": {"task": task, "observation": obs}, "runtime": runtime}
        parameters = {k: v for k, v in (("seed", seed), ("num_inference_steps", num_inference_steps))
                      if v is not None}
        if parameters:
            body["parameters"] = parameters
        if rtc is not None:
            body["rtc"] = dict(rtc)
        return packb(body)

    @staticmethod
    def encode_batch(observations: list[Mapping], seed: int | list[int] | None, num_inference_steps: int | None,
                     return_noise: bool = False, return_trace: bool = False) -> bytes:
        """B observations as one request (the batch form: a leading dimension of B on every array,
        one task per observation). Their keys, and each array's shape, must match. `seed`: one per
        observation (a list of B), or one int for all (item i gets seed + i)."""
        if not observations:
            raise ValueError("infer_batch needs at least one observation")
        if isinstance(seed, list) and len(seed) != len(observations):
            raise ValueError(f"seeds holds one seed per observation: {len(seed)} given for {len(observations)}")
        if len({frozenset(o) for o in observations}) != 1 or len({frozenset(o["images"]) for o in observations}) != 1:
            raise ValueError("every observation of a batch needs the same keys and cameras")
        stacked = {}
        for key in observations[0]:
            values = [o[key] for o in observations]
            if key == "images":
                stacked[key] = {cam: _stack([v[cam] for v in values], f"images.{cam}") for cam in values[0]}
            elif key in ("task", "prompt"):
                stacked[key] = list(values)
            else:
                stacked[key] = _stack(values, key)
        return RealtimeProtocol.encode(stacked, None, seed, num_inference_steps, return_noise, return_trace)

    @staticmethod
    def decode(frame) -> tuple[dict, dict]:
        items, timings = RealtimeProtocol.decode_batch(frame)
        if not items:
            raise ClientError("realtime reply has an empty data list")
        if isinstance(items[0], ServerError):
            raise items[0]
        return items[0], timings

    @staticmethod
    def decode_batch(frame) -> tuple[list, dict]:
        """Each item's Reply fields ({"actions", "noise", "trace"}) or its ServerError, and the reply's
        timings; a whole-request error raises."""
        reply = unpackb(frame) if isinstance(frame, bytes) else None
        if not isinstance(reply, dict):
            raise ClientError(f"unexpected realtime reply: {str(frame)[:200]!r}")
        if "error" in reply:
            raise _server_error(reply["error"])
        try:
            items = [_server_error(item["error"]) if "error" in item else _outputs(item) for item in reply["data"]]
        except (KeyError, IndexError, TypeError):
            raise ClientError(f"realtime reply has no data[i].action.values: keys {sorted(reply)}") from None
        return items, dict(reply.get("timings") or {})


def _outputs(item: Mapping) -> dict:
    """One answered item's Reply fields: its actions, and the noise and trace it was asked for (None if not)."""
    output = item.get("output") or {}
    return {"actions": np.asarray(item["action"]["values"], dtype=np.float32),
            **{name: None if name not in output else np.asarray(output[name]["values"], dtype=np.float32)
               for name in ("noise", "trace")}}


def _server_error(error) -> ServerError:
    error = error or {}
    return ServerError(str(error.get("type")), error.get("field"), str(error.get("message")))


def _stack(values: list, key: str) -> np.ndarray:
    try:
        return np.stack([np.asarray(v) for v in values])
    except ValueError:
        raise ValueError(f"the observations' {key!r} differ in shape; a batch stacks them") from None


# OpenPI reports an error as one text frame, "type: field: message" or "type: message" (then 1011).
_OPENPI_ERROR = re.compile(r"^(?P<type>[a-z_]+): (?:(?P<field>[^\s:]+): )?(?P<message>.*)$", re.S)


class OpenPIProtocol:
    """WS /openpi/policy: observation dicts in, {"actions", "server_timing", ...} out. No RTC, no seed."""

    name, path = "openpi", "/openpi/policy"

    @staticmethod
    def encode(observation: Mapping, rtc: Mapping | None, seed: int | None,
               num_inference_steps: int | None, return_noise: bool = False, return_trace: bool = False) -> bytes:
        if rtc is not None:
            raise RtcNotSupported("the OpenPI protocol carries no RTC guidance; use protocol='realtime'")
        if seed is not None or num_inference_steps is not None or return_noise or return_trace:
            raise ValueError("the OpenPI protocol takes no seed, num_inference_steps, return_noise or "
                             "return_trace; use protocol='realtime'")
        return packb(dict(observation))

    @staticmethod
    def decode(frame) -> tuple[dict, dict]:
        if isinstance(frame, str):
            match = _OPENPI_ERROR.match(frame)
            if match is None:  # an internal error: the server sends its traceback
                raise ServerError("internal_error", None, frame.strip())
            raise ServerError(match["type"], match["field"], match["message"])
        reply = unpackb(frame)
        if not isinstance(reply, dict) or "actions" not in reply:
            raise ClientError(f"OpenPI reply has no 'actions': {str(reply)[:200]!r}")
        return {"actions": np.asarray(reply["actions"], dtype=np.float32)}, dict(reply.get("server_timing") or {})


PROTOCOLS = {p.name: p for p in (RealtimeProtocol, OpenPIProtocol)}


def protocol_named(name: str):
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; choose one of {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]


def websocket_url(url: str, protocol) -> str:
    """'host:port', 'http(s)://…' or 'ws(s)://…'; with no path, the protocol's own path is added."""
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"a server URL is ws://, wss://, http:// or https://, not {url!r}")
    path = parts.path if parts.path not in ("", "/") else protocol.path
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def post_json(url: str, path: str, body: dict, api_key: str | None, timeout: float) -> dict:
    """POSTs `body` as JSON to `path` of the server at `url` (any form websocket_url takes) -> the JSON reply.
    A refusal raises ServerError (its error's type, field and message), a 401 AuthenticationError."""
    parts = urlsplit(url if "://" in url else "ws://" + url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    request = urllib.request.Request(urlunsplit((scheme, parts.netloc, path, "", "")), method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise AuthenticationError(f"{request.full_url} refused the key (HTTP 401)") from None
        try:
            error = json.loads(e.read())["error"]
        except (ValueError, KeyError, TypeError):
            raise ServerError("http_error", None, f"HTTP {e.code} from {request.full_url}") from None
        raise ServerError(error.get("type", "http_error"), error.get("field"), error.get("message", "")) from None
    except urllib.error.URLError as e:
        raise ConnectionError(f"cannot reach {request.full_url}: {e.reason}") from None


def parse_metadata(frame) -> dict:
    metadata = unpackb(frame) if isinstance(frame, bytes) else None
    if not isinstance(metadata, dict):
        raise ClientError(f"the server's first frame is not a metadata map: {str(frame)[:200]!r}")
    return metadata


def backoff_delays(initial: float, maximum: float) -> Iterator[float]:
    """initial, 2·initial, 4·initial … capped at maximum, each shortened by up to 20% at random so
    that a fleet of robots does not reconnect to a restarted server in lockstep."""
    delay = initial
    while True:
        yield delay * random.uniform(0.8, 1.0)
        delay = min(maximum, delay * 2)


@dataclass(frozen=True)
class ConnectionSettings:
    url: str = "ws://127.0.0.1:8000"
    protocol: str = "realtime"
    api_key: str | None = None
    timeout: float = 10.0           # per request: send -> reply
    connect_timeout: float = 5.0    # one handshake + metadata frame
    close_timeout: float = 0.5      # close() waits this long for the server's half of the closing handshake
    reconnect_timeout: float = 30.0  # keep retrying a refused/failed connect this long, then raise
    backoff_initial: float = 0.05
    # A short cap: a refused connect costs the server nothing, and a restarted one is found within it.
    backoff_max: float = 0.25
    max_frame_bytes: int = 64 * 2**20

    def __post_init__(self):
        protocol_named(self.protocol)
        for name in ("timeout", "connect_timeout", "close_timeout", "reconnect_timeout", "backoff_initial",
                     "backoff_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


# What a failed connection attempt may raise and still be worth retrying (a refused or dropped socket).
RETRYABLE = (OSError, TimeoutError)


def retry_delay(error: Exception, delay: float, deadline: float, url: str, reconnect_timeout: float) -> float:
    """The wait before the next connection attempt; raises instead when `error` is not worth a retry
    (a bad URL) or the next attempt would start past `deadline` (time.monotonic)."""
    from websockets.exceptions import InvalidURI

    if isinstance(error, InvalidURI):
        raise error
    if time.monotonic() + delay > deadline:
        raise ConnectionError(f"cannot connect to {url} within {reconnect_timeout:g} s: "
                              f"{type(error).__name__}: {error}") from error
    log.info("connect to %s failed (%s); retrying in %.2f s", url, error, delay)
    return delay


def refused_attempt(error: Exception, url: str) -> Exception:
    """One failed connection attempt as ConnectionError (for a caller that paces its own retries);
    a bad URL is raised as itself: no retry will fix it."""
    from websockets.exceptions import InvalidURI

    if isinstance(error, InvalidURI):
        return error
    return ConnectionError(f"cannot connect to {url}: {type(error).__name__}: {error}")


def refused_key(error: Exception, url: str) -> Exception:
    """The handshake's error as the client reports it: a 401 is an AuthenticationError (never retried)."""
    if getattr(getattr(error, "response", None), "status_code", None) == 401:
        return AuthenticationError(f"{url} refused the API key (HTTP 401)")
    return error
