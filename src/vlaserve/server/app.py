"""The FastAPI app: the routes (server.routes) over one Service, with its middleware and error handlers."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from .guard import Guard
from .page import serve_page
from .routes import ERROR_HANDLERS, MSGPACK, generations, router
from .schema import GenerationRequest
from .service import Service
from .settings import ROUTES, ServerSettings

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
    # The routes find it here; the server's shutdown drains its websocket sessions (server.lifecycle).
    app.state.service = service

    # Added last, so outermost: origins are checked before CORS headers are added or routes run.
    origins = list(service.settings.allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "X-API-Key", "Content-Type", "Accept"])
    app.add_middleware(Guard, metrics=service.metrics, allowed_origins=tuple(origins), inference_path=ROUTES["http"])
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)

    app.include_router(router)
    app.add_api_route(ROUTES["http"], generations, methods=["POST"], response_model=None,
                      openapi_extra=_request_body_doc(policy.metadata))

    schemas = _request_schemas()
    default_openapi = app.openapi

    def openapi() -> dict:
        # The generation route parses its body itself (JSON or msgpack), so FastAPI can't infer
        # its schema; register the pydantic models for /docs by hand.
        if app.openapi_schema is None:
            default_openapi().setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema

    app.openapi = openapi
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
