"""Open websocket sessions, so that shutdown finishes their in-flight requests.

uvicorn's own shutdown closes every websocket with 1012 at once, dropping requests that are being
answered. Instead, `drain` runs first (server.lifecycle): a session waiting for its next frame is
closed with 1012 right away; one in the middle of a request sends its answer, then closes with 1012.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import WebSocket

log = logging.getLogger(__name__)

SERVICE_RESTART = 1012


class Sessions:
    def __init__(self):
        self._idle: set[WebSocket] = set()
        self._busy: set[WebSocket] = set()
        self.draining = False

    @property
    def open(self) -> int:
        return len(self._idle | self._busy)

    async def frames(self, websocket: WebSocket):
        """Each message's binary payload (None for a text frame) and the time it arrived, until the
        client disconnects or the server drains (then, with every frame answered, closes 1012)."""
        try:
            while not self.draining:
                self._busy.discard(websocket)
                self._idle.add(websocket)
                message = await websocket.receive()
                self._idle.discard(websocket)
                if message["type"] == "websocket.disconnect":
                    return
                self._busy.add(websocket)
                yield message.get("bytes"), time.perf_counter()
            await _close(websocket)
        finally:
            self._idle.discard(websocket)
            self._busy.discard(websocket)

    async def drain(self, timeout_s: float) -> None:
        """Closes idle sessions, waits up to `timeout_s` for busy ones to answer and close."""
        self.draining = True
        for websocket in list(self._idle):
            await _close(websocket)
        deadline = time.monotonic() + timeout_s
        while (self._busy or self._idle) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._busy:
            log.warning("drain timeout: %d websocket request(s) still running are cut off", len(self._busy))


async def _close(websocket: WebSocket) -> None:
    try:
        await websocket.close(code=SERVICE_RESTART, reason="server shutting down")
    except RuntimeError:
        pass  # already closed (a close from the other side, or from drain)
