"""The page at / for people: what the server serves and how it is doing, and "Try it" (frames, state and
a task in; the chunk drawn per action dimension out). It is a view over the public routes
(/v1/actions/metadata, /stats, /v1/actions/generations), plain files in static/ with no build step, served
by the server itself: robot LANs are often air-gapped. static/samples/ holds synthetic frames (drawn with
Pillow) so the demo's page answers in one click."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
PAGE_ASSETS = "/page-assets"


def serve_page(app: FastAPI) -> None:
    app.mount(PAGE_ASSETS, StaticFiles(directory=STATIC), name="page-assets")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")
