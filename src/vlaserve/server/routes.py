"""The routes, as module functions over the one Service, which each finds on `app.state.service`
(server.app assembles them into the app)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection

from ..about import STARTED
from .bodies import body_format, decode, read_body
from .codec import dumps_json, packb, reply_msgpack
from .guard import route_label
from .metrics import SERVING_STATES
from .openpi import serve_openpi
from .realtime import serve_realtime
from .schema import ApiError
from .service import Service
from .settings import ROUTES
from .sockets import accept
from .weight_updates import PATH as UPDATE_WEIGHTS, model_path_of

MSGPACK = "application/msgpack"
# Error types of Starlette's own HTTP errors (unknown path, wrong method, ...).
_HTTP_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed"}

router = APIRouter()


def _service(connection: HTTPConnection) -> Service:
    return connection.app.state.service


async def api_error(request: Request, error: ApiError) -> JSONResponse:
    _service(request).metrics.errors.labels(route_label(request.scope), error.type).inc()
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = _HTTP_ERROR_TYPES.get(error.status_code, "http_error")
    return JSONResponse(ApiError(error.status_code, kind, str(error.detail)).body(),
                        status_code=error.status_code, headers=error.headers)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or None
    return JSONResponse(ApiError(422, "invalid_request", first.get("msg", "invalid"), field).body(),
                        status_code=422)


ERROR_HANDLERS = {ApiError: api_error, HTTPException: http_error, RequestValidationError: validation_error}


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    # 503 "starting" until the runtime serves (its batch-1 CUDA graphs captured; the rest are
    # captured while it serves); load balancers and Ray take a replica into rotation on the 200.
    service = _service(request)
    body = _health(service.policy.runtime.stats())
    body.update(model=service.identity["model"], is_demo=service.identity["is_demo"],
                weight_version=service.policy.weight_version)
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


@router.get("/stats")
async def stats(request: Request) -> dict:
    """What /metrics counts, as JSON for people (the page at /): health, uptime, and the inference
    requests of the last minute with their latency and connections."""
    service = _service(request)
    return {"object": "server.stats", **_health(service.policy.runtime.stats()),
            "uptime_s": time.perf_counter() - STARTED, **service.metrics.recent.summary(),
            "websocket_sessions": service.sessions.open}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/actions/metadata")
async def metadata(request: Request) -> dict:
    service = _service(request)
    service.require_auth(request.headers)
    return service.public_metadata()


@router.post(UPDATE_WEIGHTS)
async def update_weights_from_disk(request: Request) -> dict:
    """SGLang's route: {"model_path": DIR} -> the weights swapped in place between batches (docs/server.md)."""
    service = _service(request)
    service.require_admin(request.headers, None if request.client is None else request.client.host)
    payload = await read_body(request, service.settings.max_payload_bytes, service.settings.body_timeout_s)
    body = await decode(payload, body_format(request.headers.get("content-type")), service.workers)
    return await service.update_weights(model_path_of(body))


async def generations(request: Request) -> Response:
    """POST ROUTES["http"]; server.app adds it with its body's schema, which the checkpoint gives."""
    started = time.perf_counter()
    service = _service(request)
    service.require_auth(request.headers)
    fmt = body_format(request.headers.get("content-type"))
    payload = await read_body(request, service.settings.max_payload_bytes, service.settings.body_timeout_s)
    body = await decode(payload, fmt, service.workers)
    msgpack_response = reply_msgpack(request.headers.get("content-type"), request.headers.get("accept"))
    generation, results, timings = await service.generate(
        body, started, msgpack_response, client=_connection(request))
    reply, status = service.http_reply(generation, results, timings, started)
    if status != 200:
        service.metrics.errors.labels(ROUTES["http"], reply["error"]["type"]).inc()
    if msgpack_response:
        return Response(packb(reply), status_code=status, media_type=MSGPACK)
    return Response(dumps_json(reply), status_code=status, media_type="application/json")


@router.websocket(ROUTES["realtime"])
async def realtime(websocket: WebSocket) -> None:
    if await accept(websocket, _service(websocket)):
        await serve_realtime(websocket, _service(websocket))


async def openpi(websocket: WebSocket) -> None:
    if await accept(websocket, _service(websocket)):
        await serve_openpi(websocket, _service(websocket))


# openpi-client connects to ws://host:port with no path, so "/" speaks the same protocol.
router.add_api_websocket_route(ROUTES["openpi"], openpi)
router.add_api_websocket_route("/", openpi)


def _health(runtime_stats: dict) -> dict:
    """"ok" once the runtime serves (its batch-1 CUDA graphs captured; the rest are captured while it
    serves), and the graphs captured so far. "failed": a capture failed (the log says why); batches may
    still run on the graphs captured before it, but an orchestrator should restart this server."""
    state, graphs = runtime_stats["state"], runtime_stats["graphs"]
    status = "ok" if state in SERVING_STATES else "failed" if state == "failed" else "starting"
    return {"status": status, "graphs": {k: graphs[k] for k in ("captured", "total")}}


def _connection(request: Request) -> tuple | None:
    """A keep-alive HTTP connection (client address and port): one robot's requests, one after another."""
    return None if request.client is None else (request.client.host, request.client.port)
