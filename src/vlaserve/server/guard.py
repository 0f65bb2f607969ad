"""The outermost ASGI layer: refuses browser origins that are not allowed, turns anything a route
did not handle into the documented error shape (logged once, never sent to the client), and counts
HTTP requests for /metrics.

Why an Origin check: a web page can POST to a server on localhost or the robot's network with
`text/plain` or a form without a CORS preflight, and open websockets to it. Browsers always send
`Origin` on those requests; robots, curl and openpi-client don't. So by default any request that
carries an Origin is refused, and `--allowed-origins` lists the pages that may call the server
(they also get CORS headers, from Starlette's CORSMiddleware inside this layer). The server's own
pages (/docs' "Try it out") pass too: their Origin is the request's own scheme://Host, for a Host
that is an IP address or `localhost`. A Host that is a DNS name is not trusted that way: a page of
any domain can have it resolve to this server (DNS rebinding) and be "same-origin"; such a name
goes in --allowed-origins.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from urllib.parse import urlsplit

from starlette.requests import ClientDisconnect

from .metrics import Metrics

log = logging.getLogger(__name__)


def error_body(status: int, type: str, message: str, field: str | None = None) -> bytes:
    return json.dumps({"error": {"type": type, "field": field, "message": message}}).encode()


async def send_json_error(send, status: int, type: str, message: str, close: bool = False) -> None:
    """`close`: the connection closes after this answer (uvicorn honours `connection: close`)."""
    body = error_body(status, type, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    return next((value.decode("latin-1") for key, value in scope.get("headers", ()) if key == name), None)


def _same_origin(origin: str, scope) -> bool:
    """`origin` is this server's own, as the request's Host names it, and that Host cannot be a
    rebound DNS name (an IP address, or localhost, which browsers resolve themselves)."""
    host = _header(scope, b"host")
    scheme = {"ws": "http", "wss": "https"}.get(scope.get("scheme"), scope.get("scheme"))
    if host is None or origin != f"{scheme}://{host.lower()}":
        return False
    try:
        hostname = urlsplit(origin).hostname or ""
        if hostname != "localhost":
            ipaddress.ip_address(hostname)
    except ValueError:  # a DNS name, or a malformed Host
        return False
    return True


def route_label(scope) -> str:
    """The path template of the route that served a request, for metrics labels; "unmatched" for none.
    FastAPI records only its own routes in the scope: a plain route (/openapi.json) or a mount (the docs'
    assets) is found by the endpoint the router handed the request to."""
    route = scope.get("route")
    if route is None and "endpoint" in scope:
        endpoint = scope["endpoint"]
        route = next((r for r in getattr(scope.get("router"), "routes", ())
                      if getattr(r, "endpoint", None) is endpoint or getattr(r, "app", None) is endpoint), None)
    return getattr(route, "path", None) or "unmatched"


def _ambiguous_framing(scope) -> bool:
    names = {name for name, _ in scope.get("headers", ())}
    return b"content-length" in names and b"transfer-encoding" in names


class Guard:
    def __init__(self, app, metrics: Metrics, allowed_origins: tuple[str, ...], inference_path: str):
        self.app = app
        self.metrics = metrics
        self.inference_path = inference_path  # its requests make the last minute's figures (Metrics.request_done)
        self.allow_any_origin = "*" in allowed_origins
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    def origin_allowed(self, scope) -> bool:
        origin = _header(scope, b"origin")
        if origin is None:
            return True  # not a browser
        origin = origin.rstrip("/").lower()
        return self.allow_any_origin or origin in self.allowed_origins or _same_origin(origin, scope)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope, receive, send):
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_tracked(message):
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
            await send(message)

        try:
            if _ambiguous_framing(scope):
                # Content-Length and Transfer-Encoding together: where this body ends is ambiguous (a
                # proxy in front may have read it otherwise), so nothing after it on this connection
                # can be trusted: 400, then close (RFC 9112 section 6.1).
                await send_json_error(send_tracked, 400, "invalid_http_framing",
                                      "a request may carry Content-Length or Transfer-Encoding, not both", close=True)
            elif not self.origin_allowed(scope):
                await send_json_error(send_tracked, 403, "forbidden_origin",
                                         "requests from web pages are refused unless their origin is in "
                                         "--allowed-origins (or is this server's own, at an IP address or "
                                         "localhost)")
            else:
                await self.app(scope, receive, send_tracked)
        except ClientDisconnect:
            status = 499  # the client left half-way through its body: nobody to answer, nothing to log
        except Exception:  # noqa: BLE001 - a route bug must still give the documented error shape
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not response_started:
                await send_json_error(send_tracked, 500, "internal_error",
                                         "the server failed to handle this request; see the server log")
        path = route_label(scope)
        self.metrics.request_done(path, status, time.perf_counter() - started,
                                  (scope.get("client") or "unknown") if path == self.inference_path else None)

    async def _websocket(self, scope, receive, send):
        if not self.origin_allowed(scope):
            self.metrics.errors.labels(scope["path"], "forbidden_origin").inc()
            await receive()  # websocket.connect
            if "websocket.http.response" in scope.get("extensions", {}):
                body = error_body(403, "forbidden_origin", "websockets from web pages are refused unless "
                                                           "their origin is in --allowed-origins (or is this "
                                                           "server's own, at an IP address or localhost)")
                await send({"type": "websocket.http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "websocket.http.response.body", "body": body})
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        try:
            await self.app(scope, receive, send)
        except Exception:  # noqa: BLE001
            log.exception("unhandled error on websocket %s", scope.get("path"))
            try:
                await send({"type": "websocket.close", "code": 1011})
            except Exception:  # noqa: BLE001 - already closed
                pass
