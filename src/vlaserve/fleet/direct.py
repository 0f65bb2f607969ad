"""Websocket robots straight to their replica (serve-ray `direct_websockets`).

Ray's proxy relays every websocket message to the replica and back, milliseconds per openpi-client call
(docs/benchmarks.md). With direct websockets a replica also
serves its own app on a port of its own, on its own event loop task, and a websocket handshake that
arrives through the proxy is answered with a redirect there (HTTP 307; the `websockets` client that
openpi-client and vlaserve_client use follows it, carrying a ticket for the API key it drops on the
way). HTTP requests still take the proxy. Robots must be able to reach the replica's host and port;
Ray's proxy does not see them, so the replica reports them to the autoscaler (fleet/autoscale.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse

import uvicorn

log = logging.getLogger("vlaserve.fleet")

DIRECT = "vlaserve.direct"  # scope key marking a connection the replica's own server accepted


class _Marked:
    """The app as the direct server runs it: its connections carry the DIRECT mark, and its open
    websockets are counted (the autoscaler's direct robots)."""

    def __init__(self, app):
        self.app = app
        self.websockets = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        scope = {**scope, DIRECT: True}
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        self.websockets += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.websockets -= 1


class DirectServer:
    def __init__(self, app, advertise_host: str, bind_host: str = "0.0.0.0", port: int = 0,
                 max_message_bytes: int = 64 * 2**20):
        self.advertise_host = advertise_host
        self._app = _Marked(app)
        self._bind = (bind_host, port)
        self._server = uvicorn.Server(uvicorn.Config(
            self._app, lifespan="off", log_config=None, access_log=False,
            ws_max_size=max_message_bytes, ws_per_message_deflate=False))
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> None:
        """Serves on the running event loop (the replica's, so its sessions and batcher are shared).
        If it can't listen, says so: robots then stay on the proxy (redirect() answers None)."""
        try:  # bound here, not by uvicorn, whose bind error would exit the replica's event loop
            sock = socket.socket(socket.AF_INET6 if ":" in self._bind[0] else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(self._bind)
        except OSError as error:
            log.error("direct websockets unavailable (%s): robots stay on Ray's proxy", error)
            return
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if not self._server.started:
            log.error("direct websockets unavailable (%s): robots stay on Ray's proxy", self._task.exception())
            return
        self.port = sock.getsockname()[1]
        log.info("direct websockets on ws://%s:%d", self.advertise_host, self.port)

    @property
    def robots(self) -> int:
        """Websockets open on this server now (a robot each)."""
        return self._app.websockets

    def redirect(self, scope) -> str | None:
        """Where a websocket handshake goes: None for one this server accepted, else its URL here."""
        if scope.get(DIRECT) or self.port is None:
            return None
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        # A ticket the client brought is dropped: the handshake adds a fresh one.
        query = urllib.parse.urlencode([(k, v) for k, v in urllib.parse.parse_qsl(scope.get("query_string", b"").decode())
                                        if k != "ticket"])
        return f"ws://{host}:{self.port}{scope['path']}" + (f"?{query}" if query else "")

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
