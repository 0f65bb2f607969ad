"""The `vlaserve` command."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("vlaserve")

# name: (type, default, metavar, help). The same names are the keys of a --config JSON file.
SERVE_OPTIONS: dict[str, tuple[type, object, str, str]] = {
    "host": (str, "127.0.0.1", "HOST", "address to bind"),
    "port": (int, 8000, "PORT", "port to bind"),
    "device": (str, "auto", "DEVICE", "auto, cpu or cuda (auto: cuda when available)"),
    "dtype": (str, "bfloat16", "DTYPE", "bfloat16 or float32"),
    "max_batch_size": (int, 8, "N", "most observations run in one batch"),
    "batch_delay_ms": (float, 2.0, "MS", "how long the first request of a batch waits for company"),
    "api_key": (str, None, "KEY", "require this key (Authorization: Bearer KEY or X-API-Key: KEY)"),
    "max_payload_mb": (float, 64.0, "MB", "largest request body or websocket message, in MiB"),
    "tokenizer": (str, None, "PATH", "tokenizer directory or file, when the checkpoint has none"),
}
CONFIG_ONLY_KEYS = ("checkpoint", "camera_aliases")


class UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlaserve", description="Serve the Pi0.5 robot policy.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", argument_default=argparse.SUPPRESS, help="run the HTTP/websocket server",
        description="Serve a Pi0.5 checkpoint over HTTP and websockets (OpenPI-compatible). "
                    "Options come from the command line, then --config, then the defaults.")
    serve.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                       help="local directory or Hugging Face hub id (owner/name); none: the built-in DEMO")
    serve.add_argument("--config", metavar="FILE", help="JSON file with any of the options below, plus camera_aliases")
    for name, (kind, default, metavar, text) in SERVE_OPTIONS.items():
        suffix = "" if default is None else f" (default: {default})"
        serve.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, metavar=metavar, help=text + suffix)
    serve.set_defaults(run=serve_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(vars(args))


def read_config_file(path: str) -> dict:
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
        if name in SERVE_OPTIONS:
            kind = SERVE_OPTIONS[name][0]
            ok = value is None or isinstance(value, kind) or (kind is float and isinstance(value, int))
            if not ok or isinstance(value, bool):
                wanted = {int: "an integer", float: "a number", str: "a string"}[kind]
                raise UsageError(f"config file {path}: {key} must be {wanted}")
        elif name == "checkpoint":
            if value is not None and not isinstance(value, str):
                raise UsageError(f"config file {path}: checkpoint must be a string")
        elif name == "camera_aliases":
            if not isinstance(value, dict) or not all(isinstance(v, str) or v is None for v in value.values()):
                raise UsageError(f"config file {path}: camera_aliases must map keys to camera names (or null)")
        else:
            known = ", ".join([*SERVE_OPTIONS, *CONFIG_ONLY_KEYS])
            raise UsageError(f"config file {path}: unknown option {key!r} (known: {known})")
        options[name] = value
    return options


def serve_options(cli: dict) -> dict:
    """Defaults, overridden by the config file, overridden by the command line."""
    options = {name: spec[1] for name, spec in SERVE_OPTIONS.items()}
    options.update(checkpoint=None, camera_aliases=None)
    if "config" in cli:
        options.update(read_config_file(cli["config"]))
    options.update({k: v for k, v in cli.items() if k in options})
    if not 0 <= options["port"] <= 65535:
        raise UsageError(f"port {options['port']} is out of range")
    if options["max_batch_size"] < 1:
        raise UsageError("max_batch_size must be at least 1")
    if options["batch_delay_ms"] < 0:
        raise UsageError("batch_delay_ms must not be negative")
    if options["max_payload_mb"] <= 0:
        raise UsageError("max_payload_mb must be positive")
    return options


class _SpuriousHandshakeError(logging.Filter):
    """uvicorn's websockets-sansio protocol logs this at ERROR after every correctly sent 401 denial
    (it never marks the handshake done; see uvicorn PR #3138). Every vlaserve websocket route either
    accepts or sends a denial, so here the message is always that false alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


def serve_command(cli: dict) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.error").addFilter(_SpuriousHandshakeError())
    try:
        options = serve_options(cli)
    except UsageError as e:
        log.error("%s", e)
        return 2

    import uvicorn

    from . import Policy
    from .demo import demo_checkpoint
    from .errors import VlaserveError
    from .server import ServerSettings, create_app
    from .server.aliases import camera_aliases

    try:
        checkpoint = options["checkpoint"] or demo_checkpoint()
        load_started = time.perf_counter()
        policy = Policy.from_pretrained(checkpoint, device=options["device"], dtype=options["dtype"],
                                        tokenizer=options["tokenizer"])
        load_seconds = time.perf_counter() - load_started
        aliases = camera_aliases(options["camera_aliases"])
    except (VlaserveError, ValueError, OSError) as e:
        log.error("%s", e)
        return 2

    max_payload_bytes = int(options["max_payload_mb"] * 2**20)
    settings = ServerSettings(api_key=options["api_key"], max_payload_bytes=max_payload_bytes,
                              max_batch_size=options["max_batch_size"], batch_delay_ms=options["batch_delay_ms"],
                              camera_aliases=aliases)
    app = create_app(policy, settings)
    log_startup(policy, options, load_seconds)
    server = uvicorn.Server(uvicorn.Config(
        app, host=options["host"], port=options["port"], log_config=None, access_log=False,
        ws_max_size=max_payload_bytes, timeout_graceful_shutdown=None))
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


def log_startup(policy, options: dict, load_seconds: float) -> None:
    m = policy.metadata
    host = f"[{options['host']}]" if ":" in options["host"] else options["host"]
    if m["is_demo"]:
        log.warning("*" * 72)
        log.warning("DEMO MODEL: tiny, random weights; its actions are meaningless.")
        log.warning("Pass a checkpoint (directory or hub id) to serve a real policy.")
        log.warning("*" * 72)
    counts = ", ".join(f"{n:,} {dtype}" for dtype, n in m["parameter_counts"].items())
    log.info("model %s%s from %s", m["model"], " (DEMO)" if m["is_demo"] else "", m["checkpoint"])
    log.info("dtype %s, device %s, parameters: %s; loaded in %.2f s", m["dtype"], m["device"], counts,
             load_seconds)
    log.info("cameras %s, state dim %d, actions %d x %d, %d denoising steps", ", ".join(m["cameras"]),
             m["state_dim"], m["action_horizon"], m["action_dim"], m["num_inference_steps"])
    log.info("serving at http://%s:%d (docs: /docs; OpenPI websocket: ws://%s:%d/openpi/policy)%s",
             host, options["port"], host, options["port"], " with an API key" if options["api_key"] else "")


if __name__ == "__main__":
    sys.exit(main())
