"""How this server is set up (`vlaserve serve`'s options, or a serve-ray replica's), and where each
protocol is served."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..processing.layouts import camera_aliases

ROUTES = {"http": "/v1/actions/generations", "realtime": "/v1/actions/realtime", "openpi": "/openpi/policy"}


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    admin_api_key: str | None = None  # the admin routes' key (server.access)
    max_payload_bytes: int = 64 * 2**20
    batch_delay_ms: float = 0.0
    camera_aliases: dict[str, str] = field(default_factory=camera_aliases)
    body_timeout_s: float = 60.0
    allowed_origins: tuple[str, ...] = ()  # browser origins that may call; "*" for any
    # Decoding and preprocessing, off the event loop: threads, decode processes, and the most jobs
    # waiting or running before new ones get 503.
    worker_threads: int = 4
    decode_processes: int = 1
    max_pending: int = 64

    @classmethod
    def from_options(cls, options: Mapping) -> "ServerSettings":
        """What `vlaserve serve` and each `serve-ray` replica build from the same options
        (options.serve_options). The batch size limit is the policy's (RuntimeConfig.batch_limit)."""
        return cls(api_key=options["api_key"], admin_api_key=options["admin_api_key"],
                   max_payload_bytes=int(options["max_payload_mb"] * 2**20),
                   batch_delay_ms=options["batch_delay_ms"],
                   camera_aliases=camera_aliases(options["camera_aliases"]), body_timeout_s=options["body_timeout_s"],
                   allowed_origins=tuple(o.strip() for o in (options["allowed_origins"] or "").split(",") if o.strip()))
