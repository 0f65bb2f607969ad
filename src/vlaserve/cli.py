"""The `vlaserve` command: its parser, `vlaserve serve` and `vlaserve warmup` (the options live in options.py,
`vlaserve info` in info.py, `vlaserve serve-ray` in fleet/command.py)."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import gc
import logging
import resource
import signal
import sys
import time
from pathlib import Path

from .about import __version__
from .bytecode import WARN_AT_MODULES, imported_without_bytecode, write_bytecode
from .checkpoint.files import ReadAhead, read_ahead
from .demo import DEMO_NAMES
from .errors import VlaserveError
from .fleet.command import add_parser as add_serve_ray_parser  # stdlib only: Ray is imported when it runs
from .info import add_parser as add_info_parser
from .options import (API_KEY_ENV, DEMO_HELP, RUNTIME_OPTIONS, SERVE_OPTIONS, UsageError, add_options, build_service,
                      check_can_bind, serve_options)
from .precision_command import add_parsers as add_precision_parsers
from .server.lerobot import problem_with as lerobot_problem

log = logging.getLogger("vlaserve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlaserve", description="Serve Pi0.5 and Pi0 robot policies.")
    parser.add_argument("--version", action="version", version=f"vlaserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", argument_default=argparse.SUPPRESS, help="run the HTTP/websocket server",
        description="Serve a Pi0.5 or Pi0 checkpoint over HTTP and websockets (OpenPI-compatible). "
                    "Options come from the command line, then --config, then the defaults.")
    serve.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                       help="local directory or Hugging Face hub id (owner/name); none: the built-in DEMO")
    serve.add_argument("--demo", choices=tuple(DEMO_NAMES), help=DEMO_HELP)
    serve.add_argument("--config", metavar="FILE", help="JSON file with any of the options below, plus camera_aliases")
    add_options(serve, SERVE_OPTIONS)
    serve.set_defaults(run=serve_command)
    add_serve_ray_parser(commands)
    add_info_parser(commands)

    warmup = commands.add_parser(
        "warmup", argument_default=argparse.SUPPRESS,
        help="fill the compile cache (and write missing Python bytecode) ahead of a deploy",
        description="Load a checkpoint as `vlaserve serve` would, compile the CUDA fast path's kernels into the "
                    "compile cache and capture every CUDA graph, print where and how long, and exit 0. A server "
                    "started later with the same options on the same kind of GPU and software loads the kernels "
                    "instead of compiling them. It also writes the Python bytecode of the modules a start imports "
                    "where there is none (PYTHONDONTWRITEBYTECODE, uv installs): otherwise every start compiles them. "
                    "Without a CUDA device there is nothing to compile: it says so "
                    "and exits 1. Exit 2: bad options or checkpoint.")
    warmup.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                        help="local directory or Hugging Face hub id (owner/name); none: the built-in DEMO")
    warmup.add_argument("--demo", choices=tuple(DEMO_NAMES), help=DEMO_HELP)
    warmup.add_argument("--config", metavar="FILE", help="JSON file with serve's options (the runtime's are used)")
    add_options(warmup, {name: spec for name, spec in RUNTIME_OPTIONS.items() if name != "warmup"})
    warmup.set_defaults(run=warmup_command)
    add_precision_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 PID` prints every thread's stack to stderr (the log): what a stuck server is waiting on.
    # (Only where stderr is a file: an embedding that captured it in memory has no descriptor to write to.)
    with contextlib.suppress(io.UnsupportedOperation, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True, file=sys.stderr.fileno())
    args = build_parser().parse_args(argv)
    return args.run(vars(args))


def connection_limit(requested: int) -> int:
    """--max-connections, lowered to fit the process's file-descriptor limit (with room for the
    checkpoint, logs and sockets of the server itself): past that limit every accept() fails."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fits = max(1, soft - 64) if soft != resource.RLIM_INFINITY else requested
    if requested > fits:
        log.warning("max_connections %d lowered to %d: the open-file limit is %d (ulimit -n)", requested, fits, soft)
    return min(requested, fits)


class _SpuriousHandshakeError(logging.Filter):
    """uvicorn's websockets-sansio protocol logs this at ERROR after every correctly sent 401 denial
    (it never marks the handshake done; see uvicorn PR #3138). Every vlaserve websocket route either
    accepts or sends a denial, so here the message is always that false alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


def serve_command(cli: dict) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.error").addFilter(_SpuriousHandshakeError())
    from .server.logs import install as limit_repeated_logs

    limit_repeated_logs()
    try:
        options = serve_options(cli)
    except UsageError as e:
        log.error("%s", e)
        return 2
    if "api_key" in cli:
        log.warning("--api-key on the command line is visible to every user in the process list; "
                    "prefer --api-key-file or $%s", API_KEY_ENV)
    try:
        check_can_bind(options["host"], options["port"])  # before minutes of loading, not after
        if lerobot_problem(options):
            raise UsageError(lerobot_problem(options))
        if options["lerobot_port"] is not None:
            check_can_bind(options["host"], options["lerobot_port"])
    except UsageError as e:
        log.error("%s", e)
        return 2
    read_checkpoint_ahead(options)

    import uvicorn

    from .server import create_app
    from .server.lifecycle import DrainingServer, guarded_http_protocol

    runtime = options["runtime"]
    try:
        policy, settings = build_service(options, cli.get("demo"))
    except (VlaserveError, ValueError, OSError, UsageError) as e:
        log.error("%s", e)
        return 2

    max_payload_bytes = settings.max_payload_bytes
    if runtime.batch_limit < runtime.max_batch_size:
        # The batcher then never forms a batch that would run without CUDA graphs (and their bounded buffers).
        log.info("memory profile %s: batches of at most %d (max_batch_size %d lowered)", runtime.memory_profile,
                 runtime.batch_limit, runtime.max_batch_size)
    app = create_app(policy, settings)
    log_startup(policy, options)
    protocol = guarded_http_protocol(options["header_timeout_s"], connection_limit(options["max_connections"]),
                                     max_payload_bytes, options["body_timeout_s"])
    served = RequestLog(app) if options["log_requests"] else app
    if options["lerobot_port"] is not None:
        from .server.lerobot.server import LeRobotGateway

        served = LeRobotGateway(served, app.state.service, options["host"], options["lerobot_port"],
                                options["checkpoint"], options["max_connections"], options["drain_timeout_s"])
    server = DrainingServer(uvicorn.Config(
        served, host=options["host"], port=options["port"], log_config=None, access_log=False, http=protocol,
        ws_max_size=max_payload_bytes, timeout_graceful_shutdown=options["drain_timeout_s"],
        # Robots send camera bytes: deflating ~0.5 MB per message costs more latency than it saves.
        ws_per_message_deflate=False), app.state.service.sessions, options["drain_timeout_s"])
    # Everything allocated so far (torch, the model, the app) lives until exit. Freezing it keeps the
    # cyclic GC from rescanning those objects each time a request allocates many (a JSON image is
    # ~150k list items): it made JSON decoding 3x faster.
    gc.collect()
    gc.freeze()
    # uvicorn drains in-flight requests on SIGINT/SIGTERM, then re-raises the signal it caught. With
    # the default handlers that re-raise would kill an already cleanly stopped server (exit 143, or a
    # KeyboardInterrupt traceback); ignoring it lets the process exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


def warmup_command(cli: dict) -> int:
    """`vlaserve warmup`: the policy loaded as serve loads it, warm-up blocking; then the compile
    cache holds every kernel the server compiles."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        options = serve_options(cli)
    except UsageError as e:
        log.error("%s", e)
        return 2
    runtime = options["runtime"]
    from .runtime.compile_cache import activate
    from .runtime.device import resolve_device

    try:
        device = resolve_device(runtime.device)
        if not runtime.runs_fast_path(device.type):
            print(f"nothing to compile: no CUDA device here (device {device}), so the eager model serves, without "
                  "compiled kernels or CUDA graphs; run `vlaserve warmup` on the kind of GPU that will serve",
                  file=sys.stderr)
            return 1
        directory = activate(runtime.compile_cache, device)
        policy, _ = build_service(options, cli.get("demo"), warmup="blocking")
    except (VlaserveError, ValueError, OSError, UsageError) as e:
        log.error("%s", e)
        return 2
    graphs, t = policy.runtime.stats()["graphs"], policy.load_timings
    print(f"compile cache {directory}: filled in {time.perf_counter() - started:.1f} s (weights {t['weights_s']:.1f} s, "
          f"kernels and {graphs['captured']} CUDA graphs {t['engine_s']:.1f} s)")
    import uvicorn  # noqa: F401 - what serve imports besides, so that its bytecode is written too

    from . import server  # noqa: F401

    missing, imported = imported_without_bytecode()
    written, failures = write_bytecode(missing)
    if missing:
        print(f"python bytecode: written for {written} of the {imported} modules a start imports (they had none)")
    for line in failures[:3]:
        print(f"python bytecode not written: {line}", file=sys.stderr)
    if len(failures) > 3:
        print(f"python bytecode not written for {len(failures) - 3} more modules", file=sys.stderr)
    return 0


class RequestLog:
    """ASGI wrapper for --log-requests: one INFO line per finished HTTP request or websocket session
    (method, path, status, milliseconds; 101 for an accepted websocket)."""

    def __init__(self, app):
        self.app = app
        self.log = logging.getLogger("vlaserve.requests")

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), None

        async def send_status(message):
            nonlocal status
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                status = message["status"]
            elif kind == "websocket.accept":
                status = 101
            elif kind == "websocket.close" and status is None:
                status = 403  # closed before the handshake: uvicorn answers 403
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            method = scope.get("method", "WS")
            self.log.info("%s %s %s %.1f ms", method, scope.get("path", ""), status if status is not None else "-",
                          (time.perf_counter() - start) * 1e3)


def read_checkpoint_ahead(options: dict) -> ReadAhead | None:
    """For a local checkpoint read through safetensors' mmap, starts pulling the weight files into
    the page cache now, while torch and the server are imported (vlaserve.files.ReadAhead)."""
    checkpoint = options["checkpoint"]
    if options["runtime"].weights_loader != "safetensors" or not checkpoint or not Path(checkpoint).expanduser().is_dir():
        return None  # runai-streamer reads in parallel itself; the demo is tiny; a hub id is resolved later
    try:
        return read_ahead(Path(checkpoint).expanduser())
    except (VlaserveError, OSError):
        return None  # from_pretrained reports the same problem with its context


def log_startup(policy, options: dict) -> None:
    m = policy.metadata
    host = f"[{options['host']}]" if ":" in options["host"] else options["host"]
    if m["is_demo"]:
        log.warning("*" * 72)
        log.warning("DEMO MODEL: tiny, random weights; its actions are meaningless.")
        log.warning("Pass a checkpoint (directory or hub id) to serve a real policy.")
        log.warning("*" * 72)
    counts = ", ".join(f"{n:,} {dtype}" for dtype, n in m["parameter_counts"].items())
    log.info("model %s (%s%s) from %s", m["model"], m["policy_type"], ", DEMO" if m["is_demo"] else "",
             m["checkpoint"])
    log.info("dtype %s, device %s, memory profile %s, parameters: %s", m["dtype"], m["device"],
             m["memory_profile"], counts)
    t = policy.load_timings
    rate = "" if t["weights_gb_per_s"] is None else f" at {t['weights_gb_per_s']:.2f} GB/s"
    weights = f"weights {t['weights_s']:.2f} s ({t['weight_bytes'] / 1e9:.2f} GB{rate}, {t['weights_loader']})"
    engine = f"engine {t['engine_s']:.2f} s"
    # the engine first where its CUDA graphs are captured while the weights load
    stages = f"{engine}, {weights}: CUDA graphs captured meanwhile" if t["captured_while_loading"] else f"{weights}, {engine}"
    log.info("loaded in %.2f s: config %.2f s, device %.2f s, %s", t["total_s"], t["config_s"], t["device_s"], stages)
    log.info("cameras %s, state dim %d, actions %d x %d, %d denoising steps", ", ".join(m["cameras"]),
             m["state_dim"], m["action_horizon"], m["action_dim"], m["num_inference_steps"])
    log.info("serving at http://%s:%d (docs: /docs; OpenPI websocket: ws://%s:%d/openpi/policy)%s%s",
             host, options["port"], host, options["port"], " with an API key" if options["api_key"] else "",
             reachability(options["host"]))
    missing, imported = imported_without_bytecode()
    if len(missing) >= WARN_AT_MODULES:
        log.warning("%d of the %d Python modules this start imported have no bytecode (%s), so every start compiles "
                    "them again (seconds of CPU for torch's alone): `vlaserve warmup` writes it on a GPU "
                    "host, `python -m compileall` on the environment's site-packages anywhere",
                    len(missing), imported, "PYTHONDONTWRITEBYTECODE is set" if sys.flags.dont_write_bytecode
                    else "their directories are not writable")


def reachability(host: str) -> str:
    """How a robot on another computer reaches the server, for the startup line."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return " (local only: pass --host 0.0.0.0 so robots on other computers can connect)"
    if host in ("0.0.0.0", "::", ""):
        return " on every interface (robots connect to this computer's IP address or name)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
