"""The FastAPI app: HTTP + websocket routes over one Service."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .codec import DecodeError, dumps_json, is_msgpack, loads_json, packb, unpackb
from .openpi import serve_openpi
from .schema import ApiError, GenerationRequest
from .service import ROUTES, ServerSettings, Service, binary_frames

MSGPACK = "application/msgpack"


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

    app = FastAPI(title="vlaserve", version="0.1.0", lifespan=lifespan,
                  description="Serving runtime for the Pi0.5 vision-language-action policy. See docs/server.md.")

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = route.path if route is not None else "unmatched"
        service.metrics.requests.labels(path, str(response.status_code)).inc()
        service.metrics.latency.labels(path).observe(time.perf_counter() - started)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        route = request.scope.get("route")
        service.metrics.errors.labels(route.path if route else "unmatched", error.type).inc()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": service.metadata["model"], "is_demo": service.metadata["is_demo"]}

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
        payload = await _read_body(request, service.settings.max_payload_bytes)
        body = _decode(payload, request.headers.get("content-type"))
        msgpack_response = is_msgpack(request.headers.get("accept"))
        generation, result, timings = await service.generate(body, started, msgpack_response)
        reply = service.reply(generation, result, timings, started)
        if msgpack_response:
            return Response(packb(reply), media_type=MSGPACK)
        return Response(dumps_json(reply), media_type="application/json")

    @app.websocket(ROUTES["realtime"])
    async def realtime(websocket: WebSocket) -> None:
        if not await accept(websocket):
            return
        await websocket.send_bytes(packb(service.public_metadata()))
        try:
            async for frame, started in binary_frames(websocket):
                try:
                    if frame is None:
                        raise ApiError(400, "invalid_frame", "send each request as a msgpack binary frame")
                    body = _decode(frame, MSGPACK)
                    generation, result, timings = await service.generate(body, started, msgpack_response=True)
                    reply, status = service.reply(generation, result, timings, started), 200
                except ApiError as error:
                    service.metrics.errors.labels(ROUTES["realtime"], error.type).inc()
                    reply, status = error.body(), error.status
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
        """Authorizes at the handshake: a refused client gets HTTP 401 and no websocket."""
        if service.authorized(websocket.headers):
            await websocket.accept()
            return True
        service.metrics.errors.labels(websocket.scope["path"], "unauthorized").inc()
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            error = ApiError(401, "unauthorized", "missing or wrong API key")
            await websocket.send_denial_response(JSONResponse(error.body(), status_code=401))
        else:
            await websocket.close(code=1008)
        return False

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes (--max-payload-mb)")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(payload: bytes, content_type: str | None):
    try:
        if is_msgpack(content_type):
            return unpackb(payload)
        if content_type is None or "json" in content_type.lower():
            return loads_json(payload)
    except DecodeError as e:
        kind = "invalid_msgpack" if is_msgpack(content_type) else "invalid_json"
        raise ApiError(400, kind, str(e)) from None
    raise ApiError(415, "unsupported_media_type",
                   f"send application/json or application/msgpack, not {content_type!r}")


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
