"""The `vlaserve` command."""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

from . import __version__
from .checkpoint.files import ReadAhead, read_ahead
from .config import RuntimeConfig
from .demo import DEMO_NAMES
from .errors import VlaserveError

log = logging.getLogger("vlaserve")

# The server's own options: name -> (type, default, metavar, help); a bool is a flag (--name, no value). The runtime's options are
# RuntimeConfig's fields (config.py); both are also the keys of a --config JSON file.
SERVER_OPTIONS: dict[str, tuple[type, object, str, str]] = {
    "host": (str, "127.0.0.1", "HOST", "address to bind (0.0.0.0: every interface, for robots on other computers)"),
    "port": (int, 8000, "PORT", "port to bind"),
    "served_model_name": (str, None, "NAME", "the model name reported in metadata, /healthz and responses "
                                             "(default: the checkpoint directory's name or hub id)"),
    "log_requests": (bool, False, None, "log one INFO line per finished request: route, status, milliseconds"),
    "batch_delay_ms": (float, 0.0, "MS", "extra wait of a batch for company (0: a request runs as soon as the device "
                                         "is free, with everything queued meanwhile)"),
    "serial_batches": (bool, False, None, "form the next batch only once the last is answered (default: enqueue it "
                                          "on the device while the last one finishes; for measurement)"),
    "api_key": (str, None, "KEY", "require this key (Authorization: Bearer KEY or X-API-Key: KEY); visible in the "
                                  "process list: prefer --api-key-file or $VLASERVE_API_KEY"),
    "api_key_file": (str, None, "FILE", "read the API key from this file (surrounding whitespace dropped)"),
    "allowed_origins": (str, None, "O1,O2",
                        "browser origins (e.g. http://localhost:3000) that may call the server, or *; "
                        "without it any request that carries an Origin header is refused"),
    "max_connections": (int, 512, "N", "most open connections; more get a 503 and are closed"),
    "header_timeout_s": (float, 10.0, "S", "close a connection whose request headers take longer than this"),
    "body_timeout_s": (float, 60.0, "S", "answer 408 when a request body takes longer than this to arrive"),
    "drain_timeout_s": (float, 30.0, "S", "on SIGTERM/SIGINT, how long in-flight requests may take to finish"),
    "max_payload_mb": (float, 64.0, "MB", "largest request body or websocket message, in MiB"),
}
# `vlaserve serve` restarts should answer at once: its warm-up runs in the background by default.
SERVE_RUNTIME_DEFAULTS = {"warmup": "background"}


def _runtime_options() -> dict[str, tuple[type, object, str, str]]:
    out = {}
    for f in RuntimeConfig.options():
        default = SERVE_RUNTIME_DEFAULTS.get(f.name, f.default)
        # Counts are integers on the command line; the rest are text (prompt buckets "48,96").
        kind = int if isinstance(default, int) else str
        out[f.name] = (kind, ",".join(map(str, default)) if isinstance(default, tuple) else default,
                       f.metadata["metavar"], f.metadata["help"])
    return out


SERVE_OPTIONS = {**SERVER_OPTIONS, **_runtime_options()}
CONFIG_ONLY_KEYS = ("checkpoint", "camera_aliases")


DEMO_HELP = "which built-in DEMO (tiny, random weights) to use without a checkpoint (default: pi05)"


class UsageError(Exception):
    pass


def checkpoint_or_demo(checkpoint: str | None, demo: str | None) -> str:
    """The checkpoint to load: the given one, else the family's DEMO (built offline on first use)."""
    from .demo import demo_checkpoint

    if checkpoint is not None and demo is not None:
        raise UsageError("pass a checkpoint or --demo, not both")
    return checkpoint or str(demo_checkpoint(policy_type=demo or "pi05"))


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
    from .fleet.command import add_parser as add_serve_ray  # stdlib only: Ray is imported when it runs

    add_serve_ray(commands, SERVE_OPTIONS, add_options)

    info = commands.add_parser(
        "info", help="describe a checkpoint without loading its weights",
        description="Parameter counts per dtype, expected device memory per memory profile, cameras, dims, "
                    "tokenizer and normalization of a checkpoint, read from its headers and config files.")
    info.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                      help="local directory or Hugging Face hub id (owner/name); none: the built-in DEMO")
    info.add_argument("--demo", choices=tuple(DEMO_NAMES), help=DEMO_HELP)
    info.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="serving dtype the counts and memory assume (default: bfloat16)")
    info.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                      help="batch size of the second memory column (default: 8, as serve)")
    info.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory or file, when the checkpoint has none")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    info.set_defaults(run=info_command)
    return parser


def add_options(parser: argparse.ArgumentParser, options: dict[str, tuple[type, object, str, str]]) -> None:
    """One --flag per option (name -> type, default, metavar, help); booleans are switches."""
    for name, (kind, default, metavar, text) in options.items():
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", help=text)
            continue
        suffix = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, dest=name, type=kind, metavar=metavar, help=text + suffix)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(vars(args))


def read_config_file(path: str, extra_keys: tuple[str, ...] = ()) -> dict:
    """The file's options, checked; `extra_keys` (another command's, e.g. serve-ray's Ray keys) are
    passed through unchecked for that command to check."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"config file {path} must hold a JSON object")
    options = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in extra_keys:
            pass
        elif name in SERVE_OPTIONS:
            kind = SERVE_OPTIONS[name][0]
            if kind is bool:
                ok = isinstance(value, bool)
            else:
                ok = value is None or isinstance(value, kind) or (kind is float and isinstance(value, int))
                ok = ok and not isinstance(value, bool)
            if not ok:
                wanted = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]
                raise UsageError(f"config file {path}: {key} must be {wanted}")
        elif name == "checkpoint":
            if value is not None and not isinstance(value, str):
                raise UsageError(f"config file {path}: checkpoint must be a string")
        elif name == "camera_aliases":
            if not isinstance(value, dict) or not all(isinstance(v, str) or v is None for v in value.values()):
                raise UsageError(f"config file {path}: camera_aliases must map keys to camera names (or null)")
        else:
            known = ", ".join([*SERVE_OPTIONS, *CONFIG_ONLY_KEYS, *extra_keys])
            raise UsageError(f"config file {path}: unknown option {key!r} (known: {known})")
        options[name] = value
    return options


def serve_options(cli: dict, extra: dict | None = None) -> dict:
    """Defaults, overridden by the config file, overridden by the command line; the runtime's
    options are checked by RuntimeConfig (options["runtime"]). `extra`: another command's own
    options and their defaults (serve-ray's Ray keys), also read from the file and the command line."""
    extra = extra or {}
    options = {name: spec[1] for name, spec in SERVE_OPTIONS.items()}
    options.update(checkpoint=None, camera_aliases=None, **extra)
    if "config" in cli:
        options.update(read_config_file(cli["config"], tuple(extra)))
    options.update({k: v for k, v in cli.items() if k in options})
    if not 0 <= options["port"] <= 65535:
        raise UsageError(f"port {options['port']} is out of range")
    if options["served_model_name"] is not None and not options["served_model_name"].strip():
        raise UsageError("served_model_name must not be empty")
    if options["batch_delay_ms"] < 0:
        raise UsageError("batch_delay_ms must not be negative")
    if options["max_payload_mb"] <= 0:
        raise UsageError("max_payload_mb must be positive")
    if options["max_connections"] < 1:
        raise UsageError("max_connections must be at least 1")
    for name in ("header_timeout_s", "body_timeout_s", "drain_timeout_s"):
        if not options[name] > 0:
            raise UsageError(f"{name} must be positive")
    options["api_key"] = api_key(options)
    try:
        options["runtime"] = RuntimeConfig(**{f.name: options[f.name] for f in RuntimeConfig.options()})
    except VlaserveError as e:
        raise UsageError(str(e)) from None
    return options


API_KEY_ENV = "VLASERVE_API_KEY"


def api_key(options: dict) -> str | None:
    """The key from --api-key, --api-key-file or $VLASERVE_API_KEY (at most one of them); an empty
    one is an error, never a server without a key."""
    sources = {name: value for name, value in (("--api-key", options["api_key"]),
                                               ("--api-key-file", options["api_key_file"]),
                                               (f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV))) if value is not None}
    if len(sources) > 1:
        raise UsageError(f"give the API key one way, not {' and '.join(sources)}")
    if not sources:
        return None
    (source, value), = sources.items()
    if source == "--api-key-file":
        try:
            value = Path(value).expanduser().read_text()
        except OSError as e:
            raise UsageError(f"cannot read the API key file {options['api_key_file']}: {e.strerror}") from None
        value = value.strip()
    if not value:
        raise UsageError(f"{source} is empty: give a key, or leave it out to serve without one")
    return value


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
    except UsageError as e:
        log.error("%s", e)
        return 2
    read_checkpoint_ahead(options)

    import uvicorn

    from . import Policy
    from .processing.layouts import check_camera_aliases
    from .server import ServerSettings, create_app
    from .server.lifecycle import DrainingServer, guarded_http_protocol

    runtime = options["runtime"]
    try:
        settings = ServerSettings.from_options(options, runtime)
        checkpoint = checkpoint_or_demo(options["checkpoint"], cli.get("demo"))
        policy = Policy.from_pretrained(checkpoint, runtime)
        check_camera_aliases(settings.camera_aliases, policy.config.cameras)
        if options["served_model_name"] is not None:
            policy.name = options["served_model_name"]
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


def check_can_bind(host: str, port: int) -> None:
    """Binds host:port once, the way uvicorn will (SO_REUSEADDR), and lets it go: a port already
    taken is then reported at once instead of after the weights are loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"cannot bind host {host!r}: {e.strerror}; pass --host (e.g. 127.0.0.1 or 0.0.0.0)") from None
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is already in use (another server?); "
                             f"pass --port to choose another one") from None
        raise UsageError(f"cannot bind port {port} on {host}: {e.strerror}; pass --port or --host "
                         f"to choose another address") from None


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
    log.info("loaded in %.2f s: config %.2f s, device %.2f s, weights %.2f s (%.2f GB%s, %s), engine %.2f s",
             t["total_s"], t["config_s"], t["device_s"], t["weights_s"], t["weight_bytes"] / 1e9, rate,
             t["weights_loader"], t["engine_s"])
    log.info("cameras %s, state dim %d, actions %d x %d, %d denoising steps", ", ".join(m["cameras"]),
             m["state_dim"], m["action_horizon"], m["action_dim"], m["num_inference_steps"])
    log.info("serving at http://%s:%d (docs: /docs; OpenPI websocket: ws://%s:%d/openpi/policy)%s%s",
             host, options["port"], host, options["port"], " with an API key" if options["api_key"] else "",
             reachability(options["host"]))


def reachability(host: str) -> str:
    """How a robot on another computer reaches the server, for the startup line."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return " (local only: pass --host 0.0.0.0 so robots on other computers can connect)"
    if host in ("0.0.0.0", "::", ""):
        return " on every interface (robots connect to this computer's IP address or name)"
    return ""


def checkpoint_info(checkpoint: str | None, dtype: str, max_batch_size: int, tokenizer: str | None = None,
                    demo: str | None = None) -> dict:
    """What `vlaserve info` reports, from headers and config files only (no weight is read)."""

    from .config import load_policy_config
    from .errors import CheckpointError
    from .checkpoint.files import resolve_checkpoint
    from .checkpoint.weights import check_weights, checkpoint_shapes
    from .config import PROFILES
    from .family import family_of
    from .processing.normalize import load_normalization
    from .processing.prompt import find_tokenizer
    from .runtime.device import DTYPES
    from .runtime.memory import counts_by_dtype, estimate_memory, prefix_kv_bytes

    directory = resolve_checkpoint(checkpoint_or_demo(checkpoint, demo))
    config = load_policy_config(directory)
    family = family_of(config)
    layout = family.weights
    check_weights(family.build_model(config), directory, layout)  # config.json's type and the weights agree
    shapes = checkpoint_shapes(directory, layout)
    torch_dtype = DTYPES[dtype]
    counts = counts_by_dtype(shapes, torch_dtype, layout)
    info = {
        "checkpoint": str(directory), "policy_type": config.policy_type, "is_demo": config.is_demo, "dtype": dtype,
        "parameters": {"total": sum(counts.values()), "by_dtype": counts},
        "cameras": list(config.cameras), "state_dim": config.state_dim, "action_dim": config.action_dim,
        "action_horizon": config.action_horizon, "num_inference_steps": config.num_inference_steps,
        "max_token_len": config.max_token_len,
    }
    try:
        info["tokenizer"] = str(find_tokenizer(directory, tokenizer))
    except CheckpointError as e:
        info["tokenizer"], info["tokenizer_error"] = None, str(e)
    try:
        info["normalization"] = load_normalization(directory).source
    except CheckpointError as e:
        info["normalization"], info["normalization_error"] = None, str(e)
    entry = prefix_kv_bytes(config, torch_dtype.itemsize)
    info["memory"] = {
        "batch_sizes": [1, max_batch_size],
        "prefix_cache_entry_bytes": entry,
        "profiles": {p.name: {
            "summary": p.summary, "max_graph_batch": p.max_graph_batch,
            "prefix_cache_entries": p.prefix_cache_entries, "prefix_cache_bytes": p.prefix_cache_entries * entry,
            "estimates": [estimate_memory(shapes, config, torch_dtype, p, b).as_dict() for b in (1, max_batch_size)],
        } for p in PROFILES.values()},
    }
    return info


def format_info(info: dict) -> str:
    gib = 2**30
    params = info["parameters"]
    split = " + ".join(f"{n:,} {dtype}" for dtype, n in sorted(params["by_dtype"].items(), key=lambda kv: -kv[1]))
    tokenizer = info["tokenizer"] or f"not found: {info['tokenizer_error']}"
    normalization = info["normalization"] or f"not found: {info['normalization_error']}"
    lines = [
        f"checkpoint      {info['checkpoint']}",
        f"policy type     {info['policy_type']}",
        f"demo            {'yes (tiny, random weights)' if info['is_demo'] else 'no'}",
        f"parameters      {params['total']:,} used: {split} (serving dtype {info['dtype']})",
        f"cameras         {', '.join(info['cameras'])}",
        f"state dim       {info['state_dim']}",
        f"action dim      {info['action_dim']}",
        (f"action horizon  {info['action_horizon']} ({info['num_inference_steps']} denoising steps, "
         f"prompts of {info['max_token_len']} tokens)"),
        f"tokenizer       {tokenizer}",
        f"normalization   {normalization}",
        "",
        "expected device memory per profile (estimates; docs/memory.md)",
    ]
    memory = info["memory"]
    small, large = memory["batch_sizes"]
    lines.append(f"{'profile':<11} {f'batch {small}':>10} {f'batch {large}':>10} {'host, pinned':>13} "
                 f"{f'graphs at batch {large}':>18}")
    for name, p in memory["profiles"].items():
        first, second = p["estimates"]
        host = f"{first['host_pinned'] / gib:.2f} GiB" if first["host_pinned"] else "-"
        capped = "*" if second["batch_size"] < large else " "
        # The CUDA fast path's share: static buffers for every batch size 1..N and the graphs' pool.
        graphs = (second["kv_and_buffers"] + second["activations"]) / gib
        lines.append(f"{name:<11} {first['total'] / gib:>6.2f} GiB {second['total'] / gib:>6.2f} GiB{capped}"
                     f"{host:>13} {graphs:>14.2f} GiB")
    capped = [f"{name} runs batches of at most {p['max_graph_batch']}" for name, p in memory["profiles"].items()
              if p["max_graph_batch"] is not None and p["max_graph_batch"] < large]
    if capped:
        lines.append("* " + "; ".join(capped))
    limits = ", ".join(f"{name} {p['prefix_cache_entries']}" for name, p in memory["profiles"].items())
    lines.append(f"prefix cache (opt-in, not included): {memory['prefix_cache_entry_bytes'] / 2**20:.1f} MiB per "
                 f"entry; entries: {limits}")
    lines.append(f"graphs: the CUDA fast path's static buffers (batches 1..{large}) and graph pool, captured at "
                 "startup; included in the totals and in the startup memory check")
    return "\n".join(lines)


def info_command(cli: dict) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if cli["max_batch_size"] < 1:
        log.error("max_batch_size must be at least 1")
        return 2
    try:
        info = checkpoint_info(cli["checkpoint"], cli["dtype"], cli["max_batch_size"], cli["tokenizer"], cli["demo"])
    except (VlaserveError, OSError, UsageError) as e:
        log.error("%s", e)
        return 2
    print(json.dumps(info, indent=1) if cli["json"] else format_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
