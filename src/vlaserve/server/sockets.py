"""What both websocket protocols share: the handshake (authorize, or redirect) and the frame loop.

Each protocol (server.realtime, server.openpi) is a FrameSession with three steps for the loop: `answer`
turns one decoded frame into its reply (an ApiError, or a route bug as a 500, goes to `fail`), `send`
sends that reply, and `fail` sends an error and says whether the session goes on."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response

from .bodies import decode
from .codec import packb
from .schema import ApiError

log = logging.getLogger(__name__)


class FrameSession:
    """One websocket session of a protocol, which supplies `answer`, `send` and `fail`."""

    name = "websocket"  # for the log
    not_binary = "send msgpack binary frames"  # the error a text frame gets

    def __init__(self, websocket: WebSocket, service):
        self.websocket, self.service = websocket, service

    async def serve(self, metadata: dict) -> None:
        """Sends the metadata frame, then answers the frames in turn (each a msgpack binary frame) until
        the client leaves, the server drains (server.sessions), or `fail` ends the session."""
        await self.websocket.send_bytes(packb(metadata))
        try:
            async for frame, started in self.service.sessions.frames(self.websocket):
                try:
                    if frame is None:
                        raise ApiError(400, "invalid_frame", self.not_binary)
                    body = await decode(frame, "msgpack", self.service.workers)
                    reply = await self.answer(body, frame, started)
                except ApiError as error:
                    if not await self.fail(error, started):
                        return
                    continue
                except Exception:  # noqa: BLE001 - the traceback goes to the log, never to the client
                    log.exception("%s request failed", self.name)
                    if not await self.fail(ApiError(500, "internal_error", "the server failed to handle this "
                                                                           "request; see the server log"), started):
                        return
                    continue
                await self.send(reply, started)
        except WebSocketDisconnect:
            return

    async def answer(self, body: Any, frame: bytes, started: float) -> Any:
        """The reply to one decoded frame (`frame`: its bytes, `started`: when it arrived)."""
        raise NotImplementedError

    async def send(self, reply: Any, started: float) -> None:
        raise NotImplementedError

    async def fail(self, error: ApiError, started: float) -> bool:
        """Sends the error; whether the session goes on."""
        raise NotImplementedError


async def accept(websocket: WebSocket, service) -> bool:
    """Authorizes at the handshake: a refused client gets HTTP 401 and no websocket. With a
    websocket redirect (serve-ray's direct websockets), an authorized client is sent there
    (307, with a ticket standing in for the API key its client drops on the way)."""
    if service.authorized(websocket.headers) or service.valid_ticket(websocket.query_params.get("ticket")):
        target = service.websocket_redirect(websocket.scope) if service.websocket_redirect else None
        if target is None or "websocket.http.response" not in websocket.scope.get("extensions", {}):
            await websocket.accept()
            return True
        if service.settings.api_key is not None:
            target += ("&" if "?" in target else "?") + "ticket=" + service.ticket()
        await websocket.send_denial_response(Response(status_code=307, headers={"location": target}))
        return False
    service.metrics.errors.labels(websocket.scope["path"], "unauthorized").inc()
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        error = ApiError(401, "unauthorized", "missing or wrong API key")
        await websocket.send_denial_response(JSONResponse(error.body(), status_code=401))
    else:
        await websocket.close(code=1008)
    return False
