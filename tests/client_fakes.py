"""A scripted stand-in for `vlaserve serve`, for the client tests: an asyncio websockets server on
127.0.0.1 in a background thread, speaking the realtime protocol (or OpenPI's). Imports no torch.

Each request takes the next `Scripted` entry (or a default one): it can wait on a gate the test
opens, run a hook first (e.g. advance a fake clock: "the model took 60 ms"), answer an error, or
drop the connection. Chunk n (n = 1 for the first request) has action[i] = [100 n + i, -(100 n + i)],
so a test can read from any action which request and which index it came from.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import numpy as np
from websockets.asyncio.server import serve

from vlaserve_client.codec import packb, unpackb

HORIZON, ACTION_DIM = 20, 2


def chunk(n: int, horizon: int = HORIZON) -> np.ndarray:
    values = 100.0 * n + np.arange(horizon, dtype=np.float32)
    return np.stack([values, -values], axis=1).astype(np.float32)


def decode(action) -> tuple[int, int]:
    """(request number, index) of an action from `chunk`."""
    n, i = divmod(int(round(float(action[0]))), 100)
    return n, i


@dataclass
class Scripted:
    latency: float = 0.0
    gate: threading.Event | None = None
    before_reply: Callable[[], None] | None = None
    error: dict | None = None   # realtime: {"type", "field", "message"}; openpi: sent as the text frame
    drop: bool = False          # close the connection instead of answering
    actions: np.ndarray | None = None


class FakeServer:
    def __init__(self, protocol: str = "realtime", api_key: str | None = None, rtc: bool = True,
                 metadata: dict | None = None, horizon: int = HORIZON):
        self.protocol, self.api_key, self.rtc, self.horizon = protocol, api_key, rtc, horizon
        self.metadata = {"object": "action.metadata", "input": {"image_keys": ["base_0_rgb"], "state_dim": 3},
                         "output": {"action_horizon": horizon, "action_dim": ACTION_DIM},
                         "defaults": {"num_inference_steps": 10}, **(metadata or {})}
        self.script: list[Scripted] = []
        self.requests: list[dict] = []  # decoded request frames, in arrival order
        self.headers: list[dict] = []   # handshake headers of each connection
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> FakeServer:
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve(ready)), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake server did not start")
        return self

    def stop(self) -> None:
        """Closes every connection (like a server shutting down) and frees the port."""
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with serve(self._handle, "127.0.0.1", self.port, process_request=self._authorize,
                         compression=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            await self._stop.wait()
            server.close(close_connections=True)

    def _authorize(self, connection, request):
        self.headers.append({k.lower(): v for k, v in request.headers.raw_items()})
        if self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return None
        return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")

    # ---- one connection -----------------------------------------------------------------------------
    async def _handle(self, ws) -> None:
        await ws.send(packb(self.metadata))
        async for frame in ws:
            body = unpackb(frame)
            self.requests.append(body)
            step = self.script.pop(0) if self.script else Scripted()
            if step.latency:
                await asyncio.sleep(step.latency)
            if step.gate is not None:
                while not step.gate.is_set():
                    await asyncio.sleep(0.002)
            if step.before_reply is not None:
                step.before_reply()
            if step.drop:
                await ws.close(1011, "scripted drop")
                return
            error = step.error
            if self.protocol == "realtime" and error is None and "rtc" in body and not self.rtc:
                # What an older server's strict schema answers to a field it does not know.
                error = {"type": "invalid_request", "field": "rtc", "message": "Extra inputs are not permitted"}
            actions = step.actions if step.actions is not None else chunk(len(self.requests), self.horizon)
            if self.protocol == "openpi":
                if error is not None:
                    await ws.send(f"{error['type']}: {error['field']}: {error['message']}")
                    await ws.close(1011, "Request failed")
                    return
                await ws.send(packb({"actions": actions, "server_timing": {"infer_ms": 1.0}}))
            elif error is not None:
                await ws.send(packb({"error": error}))
            else:
                await ws.send(packb({"object": "action.generation",
                                     "data": [{"index": 0, "action": {"values": actions,
                                                                      "shape": list(actions.shape)}}],
                                     "timings": {"total_ms": 1.0}}))

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> dict:
        """Blocks until `n` requests have arrived; returns the n-th."""
        wait_until(lambda: len(self.requests) >= n, timeout, f"request {n} never arrived")
        return self.requests[n - 1]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """A liveness bound, not a timing assertion: generous, and only fails when something is stuck."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: {what}")
        time.sleep(0.002)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
