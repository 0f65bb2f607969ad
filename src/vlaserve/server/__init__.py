"""HTTP and websocket serving for a Policy (FastAPI + uvicorn)."""

from .app import create_app
from .service import ServerSettings

__all__ = ["create_app", "ServerSettings"]
