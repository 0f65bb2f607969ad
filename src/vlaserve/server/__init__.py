"""HTTP and websocket serving for a Policy (FastAPI + uvicorn)."""

__all__ = ["create_app", "ServerSettings"]


def __getattr__(name: str):
    # Lazy, so a decode worker process (server.workers) imports server.codec without FastAPI.
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServerSettings":
        from .settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'vlaserve.server' has no attribute {name!r}")
