"""vlaserve's realtime websocket: the /v1 request body per msgpack frame, its reply per frame, and the
session going on after an error (the error is that frame's reply)."""

from __future__ import annotations

import time

from fastapi import WebSocket

from .codec import packb
from .schema import ApiError
from .replies import failed_status
from .service import Service
from .settings import ROUTES
from .sockets import FrameSession


async def serve_realtime(websocket: WebSocket, service: Service) -> None:
    await RealtimeSession(websocket, service).serve(service.public_metadata())


class RealtimeSession(FrameSession):
    name = "realtime"
    not_binary = "send each request as a msgpack binary frame"

    async def answer(self, body, frame: bytes, started: float) -> tuple[dict, int]:
        service = self.service
        generation, results, timings = await service.generate(
            body, started, msgpack_response=True, client=id(self.websocket))
        # An all-failed batch keeps its envelope (each item's error); its status is the items'.
        return service.reply(generation, results, timings, started), failed_status(results)

    async def fail(self, error: ApiError, started: float) -> bool:
        await self.send((error.body(), error.status), started)
        return True

    async def send(self, reply_status: tuple[dict, int], started: float) -> None:
        reply, status = reply_status
        metrics = self.service.metrics
        if "error" in reply:
            metrics.errors.labels(ROUTES["realtime"], reply["error"]["type"]).inc()
        await self.websocket.send_bytes(packb(reply))
        metrics.request_done(ROUTES["realtime"], status, time.perf_counter() - started, id(self.websocket))
