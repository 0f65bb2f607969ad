"""The FastAPI app: HTTP + websocket routes over one Service."""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..about import STARTED
from .bodies import body_format, decode, read_body
from .codec import dumps_json, packb, reply_msgpack
from .guard import Guard, route_label
from .metrics import SERVING_STATES
from .openpi import serve_openpi
from .page import serve_page
from .realtime import serve_realtime
from .schema import ApiError, GenerationRequest
from .service import ROUTES, ServerSettings, Service
from .sockets import accept

MSGPACK = "application/msgpack"
# Error types of Starlette's own HTTP errors (unknown path, wrong method, ...).
_HTTP_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed"}
DOCS_ASSETS = "/docs-assets"


def create_app(policy, settings: ServerSettings | None = None) -> FastAPI:
    service = Service(policy, settings or ServerSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        try:
            yield
        finally:
            # Runs after uvicorn has finished the in-flight requests; the batcher drains what's left.
            await asyncio.to_thread(service.stop)

    # /docs from the Swagger UI 5 files fastapi-offline ships (it reads OpenAPI 3.1, which FastAPI writes):
    # robot LANs are often air-gapped, and FastAPI's default page loads its scripts from a CDN.
    app = FastAPIOffline(title="vlaserve", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                         static_url=DOCS_ASSETS,
                         description="Serving runtime for the Pi0.5 vision-language-action policy. See docs/server.md.")
    serve_page(app)
    app.state.service = service  # the server's shutdown drains its websocket sessions (server.lifecycle)

    # Added last, so outermost: origins are checked before CORS headers are added or routes run.
    origins = list(service.settings.allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "X-API-Key", "Content-Type", "Accept"])
    app.add_middleware(Guard, metrics=service.metrics, allowed_origins=tuple(origins), inference_path=ROUTES["http"])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        service.metrics.errors.labels(route_label(request.scope), error.type).inc()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        kind = _HTTP_ERROR_TYPES.get(error.status_code, "http_error")
        return JSONResponse(ApiError(error.status_code, kind, str(error.detail)).body(),
                            status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        return JSONResponse(ApiError(422, "invalid_request", first.get("msg", "invalid"), field).body(),
                            status_code=422)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        # 503 "starting" until the runtime serves (its batch-1 CUDA graphs captured; the rest are
        # captured while it serves); load balancers and Ray take a replica into rotation on the 200.
        body = _health(service.policy.runtime.stats())
        body.update(model=service.identity["model"], is_demo=service.identity["is_demo"])
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/stats")
    async def stats() -> dict:
        """What /metrics counts, as JSON for people (the page at /): health, uptime, and the inference
        requests of the last minute with their latency and connections."""
        return {"object": "server.stats", **_health(service.policy.runtime.stats()),
                "uptime_s": time.perf_counter() - STARTED, **service.metrics.recent.summary(),
                "websocket_sessions": service.sessions.open}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/actions/metadata")
    async def metadata(request: Request) -> dict:
        service.require_auth(request.headers)
        return service.public_metadata()

    @app.post(ROUTES["http"], openapi_extra=_request_body_doc(policy.metadata), response_model=None)
    async def generations(request: Request) -> Response:
        started = time.perf_counter()
        service.require_auth(request.headers)
        fmt = body_format(request.headers.get("content-type"))
        payload = await read_body(request, service.settings.max_payload_bytes, service.settings.body_timeout_s)
        body = await decode(payload, fmt, service.workers)
        msgpack_response = reply_msgpack(request.headers.get("content-type"), request.headers.get("accept"))
        generation, results, timings = await service.generate(
            body, started, msgpack_response, client=_connection(request),
            rehearsal=functools.partial(service.rehearse_generation, payload) if fmt == "msgpack" else None)
        reply, status = service.http_reply(generation, results, timings, started)
        if status != 200:
            service.metrics.errors.labels(ROUTES["http"], reply["error"]["type"]).inc()
        if msgpack_response:
            return Response(packb(reply), status_code=status, media_type=MSGPACK)
        return Response(dumps_json(reply), status_code=status, media_type="application/json")

    @app.websocket(ROUTES["realtime"])
    async def realtime(websocket: WebSocket) -> None:
        if await accept(websocket, service):
            await serve_realtime(websocket, service)

    async def openpi(websocket: WebSocket) -> None:
        if await accept(websocket, service):
            await serve_openpi(websocket, service)

    schemas = _request_schemas()
    default_openapi = app.openapi

    def openapi() -> dict:
        # The generation route parses its body itself (JSON or msgpack), so FastAPI can't infer
        # its schema; register the pydantic models for /docs by hand.
        if app.openapi_schema is None:
            default_openapi().setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema

    app.openapi = openapi

    # openpi-client connects to ws://host:port with no path, so "/" speaks the same protocol.
    app.add_api_websocket_route(ROUTES["openpi"], openpi)
    app.add_api_websocket_route("/", openpi)

    return app


_SCHEMA_REF = "#/components/schemas/{model}"


def _request_schemas() -> dict:
    schema = GenerationRequest.model_json_schema(ref_template=_SCHEMA_REF)
    return {**schema.pop("$defs", {}), "GenerationRequest": schema}


def _request_body_doc(metadata: dict) -> dict:
    """The generation route's body in the schema, with an example this checkpoint answers (a black 8x8 frame
    per camera, a zero state), so that /docs' "Try it out" runs as it stands."""
    ref = {"$ref": _SCHEMA_REF.format(model="GenerationRequest")}
    frame = [[[0, 0, 0]] * 8] * 8
    example = {"input": {"task": "pick up the red block",
                         "observation": {"images": {camera: frame for camera in metadata["cameras"]},
                                         "state": [0.0] * metadata["state_dim"]}},
               "parameters": {"seed": 0}}
    return {
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref, "example": example},
            MSGPACK: {"schema": ref},
        }},
        "responses": {"200": {"description": "an action.generation envelope, or the raw OpenPI-style dict"}},
    }


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
