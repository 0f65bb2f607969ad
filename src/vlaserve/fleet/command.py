"""`vlaserve serve-ray`: the same options and config file as `vlaserve serve`, plus the Ray keys
(fleet.options), serving N replicas behind Ray Serve's proxy. Ray is imported only when it runs."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from ..options import SERVE_OPTIONS, UsageError, add_options, check_can_bind, serve_options
from .options import RAY_OPTIONS, RayOptionError, check_ray_options

log = logging.getLogger("vlaserve")

INSTALL_HINT = 'serve-ray needs Ray: pip install -e ".[ray]" in vlaserve\'s clone (or pip install "ray[serve]>=2.60")'
# Ray Serve reads its session-id header name from this variable, in its proxy, at import.
SESSION_HEADER_ENV = "RAY_SERVE_SESSION_ID_HEADER_KEY"
# `vlaserve serve` options enforced by its own uvicorn protocol, which the Ray proxy replaces.
PROXY_OWNED = ("max_connections", "header_timeout_s")


def add_parser(commands) -> None:
    """`vlaserve serve-ray`: every serve option plus the Ray keys."""
    parser = commands.add_parser(
        "serve-ray", argument_default=argparse.SUPPRESS, help="serve replicas on Ray Serve (the ray extra)",
        description="Serve a Pi0.5 checkpoint from N replicas on Ray Serve, with the routes of `vlaserve serve`. "
                    "Takes every serve option and config key, plus the Ray keys below (docs/ray.md).")
    parser.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                        help="local directory or Hugging Face hub id; none: the built-in DEMO")
    parser.add_argument("--config", metavar="FILE", help="JSON file with serve's options and the Ray keys")
    add_options(parser, {**SERVE_OPTIONS, **RAY_OPTIONS})
    parser.set_defaults(run=serve_ray_command)


def fleet_options(cli: dict) -> dict:
    """serve_options with the Ray keys; raises UsageError."""
    options = serve_options(cli, extra={name: spec[1] for name, spec in RAY_OPTIONS.items()})
    try:
        check_ray_options(options)
    except RayOptionError as e:
        raise UsageError(str(e)) from None
    return options


def serve_ray_command(cli: dict) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = fleet_options(cli)
    except UsageError as e:
        log.error("%s", e)
        return 2
    if options["lerobot_port"] is not None:
        log.error("--lerobot-port is served by `vlaserve serve` only, not by Ray replicas (docs/lerobot.md)")
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        log.error("%s", INSTALL_HINT)
        return 2
    for name in PROXY_OWNED:
        if name in cli:
            log.warning("--%s does not apply under Ray: Ray Serve's proxy owns the connections", name.replace("_", "-"))
    local = options["ray_address"] is None
    try:
        if local:
            check_can_bind(options["host"], options["port"])
    except UsageError as e:
        log.error("%s", e)
        return 2
    if local:  # inherited by the local cluster's proxy; a running cluster has its own setting
        os.environ.setdefault(SESSION_HEADER_ENV, options["robot_id_header"])
    from .replica import build

    ray.init(address=options["ray_address"], include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": options["host"], "port": options["port"]})
    log.info("starting %s on Ray Serve; each replica loads the checkpoint and warms up before it serves",
             describe_scale(options))
    try:
        serve.run(build(options), name=options["app_name"], route_prefix="/")
    except Exception as e:  # noqa: BLE001 - a replica's constructor failed: Ray says why
        log.error("the application did not start: %s", e)
        serve.shutdown()
        return 1
    host = f"[{options['host']}]" if ":" in options["host"] else options["host"]
    log.info("serving at http://%s:%d (OpenPI websocket: ws://%s:%d/ and /openpi/policy); "
             "HTTP requests with header %s: %s stay on one replica", host, options["port"], host, options["port"],
             os.environ.get(SESSION_HEADER_ENV, "x-session-id"), "ID")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down: replicas finish their in-flight requests (at most %.0f s)", options["drain_timeout_s"])
    serve.shutdown()  # each replica drains (graceful_shutdown_timeout_s), then exits
    if local:
        ray.shutdown()
    return 0


def describe_scale(options: dict) -> str:
    if options["max_replicas"] is not None:
        low = 1 if options["min_replicas"] is None else options["min_replicas"]
        return f"{low} to {options['max_replicas']} replicas (autoscaling)"
    return f"{options['replicas']} replica{'s' if options['replicas'] != 1 else ''}"
