"""The FastAPI app: HTTP + websocket routes over one Service."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from .bodies import body_format, decode, read_body
from .codec import dumps_json, packb, reply_msgpack
from .guard import Guard
from .metrics import SERVING_STATES
from .openpi import serve_openpi
from .schema import ApiError, GenerationRequest
from .service import ROUTES, ServerSettings, Service

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
# Error types of Starlette's own HTTP errors (unknown path, wrong method, ...).
_HTTP_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed"}


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

    app = FastAPI(title="vlaserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Serving runtime for the Pi0.5 vision-language-action policy. See docs/server.md.")
    _serve_docs_offline(app)
    app.state.service = service  # the server's shutdown drains its websocket sessions (server.lifecycle)

    # Added last, so outermost: origins are checked before CORS headers are added or routes run.
    origins = list(service.settings.allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "X-API-Key", "Content-Type", "Accept"])
    app.add_middleware(Guard, metrics=service.metrics, allowed_origins=tuple(origins))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        route = request.scope.get("route")
        service.metrics.errors.labels(route.path if route else "unmatched", error.type).inc()
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
        stats = service.policy.runtime.stats()
        serving = stats["state"] in SERVING_STATES
        graphs = stats["graphs"]
        # "failed": a capture failed (the log says why); batches may still run on the graphs captured
        # before it, but an orchestrator should restart this server.
        status = "ok" if serving else "failed" if stats["state"] == "failed" else "starting"
        body = {"status": status, "model": service.identity["model"],
                "is_demo": service.identity["is_demo"], "graphs": {k: graphs[k] for k in ("captured", "total")}}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/actions/metadata")
    async def metadata(request: Request) -> dict:
        service.require_auth(request.headers)
        return service.public_metadata()

    @app.post(ROUTES["http"], openapi_extra=_request_body_doc(), response_model=None)
    async def generations(request: Request) -> Response:
        started = time.perf_counter()
        service.require_auth(request.headers)
        fmt = body_format(request.headers.get("content-type"))
        payload = await read_body(request, service.settings.max_payload_bytes, service.settings.body_timeout_s)
        body = await decode(payload, fmt, service.workers)
        msgpack_response = reply_msgpack(request.headers.get("content-type"), request.headers.get("accept"))
        generation, results, timings = await service.generate(body, started, msgpack_response,
                                                              client=_connection(request))
        reply = service.reply(generation, results, timings, started)
        if msgpack_response:
            return Response(packb(reply), media_type=MSGPACK)
        return Response(dumps_json(reply), media_type="application/json")

    @app.websocket(ROUTES["realtime"])
    async def realtime(websocket: WebSocket) -> None:
        if not await accept(websocket):
            return
        await websocket.send_bytes(packb(service.public_metadata()))
        try:
            async for frame, started in service.sessions.frames(websocket):
                try:
                    if frame is None:
                        raise ApiError(400, "invalid_frame", "send each request as a msgpack binary frame")
                    body = await decode(frame, "msgpack", service.workers)
                    generation, results, timings = await service.generate(
                        body, started, msgpack_response=True, client=id(websocket))
                    reply, status = service.reply(generation, results, timings, started), 200
                except ApiError as error:
                    reply, status = error.body(), error.status
                except Exception:  # noqa: BLE001 - a route bug: this request fails, the session goes on
                    log.exception("realtime request failed")
                    error = ApiError(500, "internal_error", "the server failed to handle this request; "
                                                            "see the server log")
                    reply, status = error.body(), error.status
                if status != 200:
                    service.metrics.errors.labels(ROUTES["realtime"], reply["error"]["type"]).inc()
                await websocket.send_bytes(packb(reply))
                service.metrics.requests.labels(ROUTES["realtime"], str(status)).inc()
                service.metrics.latency.labels(ROUTES["realtime"]).observe(time.perf_counter() - started)
        except WebSocketDisconnect:
            return

    async def openpi(websocket: WebSocket) -> None:
        if await accept(websocket):
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

    async def accept(websocket: WebSocket) -> bool:
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

    return app


_SCHEMA_REF = "#/components/schemas/{model}"


def _request_schemas() -> dict:
    schema = GenerationRequest.model_json_schema(ref_template=_SCHEMA_REF)
    return {**schema.pop("$defs", {}), "GenerationRequest": schema}


def _request_body_doc() -> dict:
    ref = {"$ref": _SCHEMA_REF.format(model="GenerationRequest")}
    return {
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref},
            MSGPACK: {"schema": ref},
        }},
        "responses": {"200": {"description": "an action.generation envelope, or the raw OpenPI-style dict"}},
    }


def _connection(request: Request) -> tuple | None:
    """A keep-alive HTTP connection (client address and port): one robot's requests, one after another."""
    return None if request.client is None else (request.client.host, request.client.port)


def _serve_docs_offline(app: FastAPI) -> None:
    """/docs from the Swagger UI files the swagger-ui-bundle package ships: robot LANs are often
    air-gapped, and FastAPI's default page loads its scripts from a CDN."""
    import swagger_ui_bundle
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="vlaserve",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


DOCS_ASSETS = "/docs-assets"
