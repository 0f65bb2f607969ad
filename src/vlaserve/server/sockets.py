"""What both websocket protocols share: the handshake (authorize, or redirect) and the frame loop.

Each protocol (server.realtime, server.openpi) is a session object with three steps for the loop:
`answer` turns one decoded frame into its reply (an ApiError, or a route bug as a 500, goes to `fail`),
`send` sends that reply, and `fail` sends an error and says whether the session goes on."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response

from .bodies import decode
from .schema import ApiError

log = logging.getLogger(__name__)


class FrameSession(Protocol):
    name: str  # for the log
    not_binary: str  # the message a text frame is refused with

    async def answer(self, body: Any, frame: bytes, started: float) -> Any: ...

    async def send(self, reply: Any, started: float) -> None: ...

    async def fail(self, error: ApiError, started: float) -> bool: ...


async def serve_frames(websocket: WebSocket, service, session: FrameSession) -> None:
    """Answers a websocket's frames in turn (each a msgpack binary frame) until the client leaves, the
    server drains (server.sessions), or `session.fail` ends it."""
    try:
        async for frame, started in service.sessions.frames(websocket):
            try:
                if frame is None:
                    raise ApiError(400, "invalid_frame", session.not_binary)
                body = await decode(frame, "msgpack", service.workers)
                reply = await session.answer(body, frame, started)
            except ApiError as error:
                if not await session.fail(error, started):
                    return
                continue
            except Exception:  # noqa: BLE001 - the traceback goes to the log, never to the client
                log.exception("%s request failed", session.name)
                if not await session.fail(ApiError(500, "internal_error", "the server failed to handle this "
                                                                          "request; see the server log"), started):
                    return
                continue
            await session.send(reply, started)
    except WebSocketDisconnect:
        return


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
