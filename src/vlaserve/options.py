"""`vlaserve serve`'s options, shared with `vlaserve serve-ray` (fleet/): their table, the --config
file, the checks, and `build_service`, which turns checked options into the policy and server
settings both commands run. Light to import (no torch): the command line reads it before the
checkpoint's read-ahead starts."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
from dataclasses import replace
from pathlib import Path

from .config import RuntimeConfig
from .demo import demo_checkpoint
from .errors import VlaserveError

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
    "api_key": (str, None, "KEY", "require this key (Authorization: Bearer KEY or X-API-Key: KEY); visible in the "
                                  "process list: prefer --api-key-file or $VLASERVE_API_KEY"),
    "api_key_file": (str, None, "FILE", "read the API key from this file (surrounding whitespace dropped)"),
    "admin_api_key_file": (str, None, "FILE", "read the admin routes' key from this file (POST "
                                              "/update_weights_from_disk; docs/server.md)"),
    "allowed_origins": (str, None, "O1,O2",
                        "browser origins (e.g. http://localhost:3000) that may call the server, or *; "
                        "without it any request that carries an Origin header is refused"),
    "max_connections": (int, 512, "N", "most open connections; more get a 503 and are closed"),
    "header_timeout_s": (float, 10.0, "S", "close a connection whose request headers take longer than this"),
    "body_timeout_s": (float, 60.0, "S", "answer 408 when a request body takes longer than this to arrive"),
    "drain_timeout_s": (float, 30.0, "S", "on SIGTERM/SIGINT, how long in-flight requests may take to finish"),
    "max_payload_mb": (float, 64.0, "MB", "largest request body or websocket message, in MiB"),
    "lerobot_port": (int, None, "PORT", "also serve LeRobot's robot_client (gRPC AsyncInference) on this port; "
                                        "needs the lerobot extra (docs/lerobot.md)"),
}

def _runtime_options() -> dict[str, tuple[type, object, str, str]]:
    out = {}
    for f in RuntimeConfig.options():
        default = f.default
        # Switches are flags; counts are integers on the command line; the rest are text (prompt buckets "48,96").
        kind = bool if isinstance(default, bool) else int if isinstance(default, int) else str
        out[f.name] = (kind, ",".join(map(str, default)) if isinstance(default, tuple) else default,
                       f.metadata["metavar"], f.metadata["help"])
    return out


RUNTIME_OPTIONS = _runtime_options()
SERVE_OPTIONS = {**SERVER_OPTIONS, **RUNTIME_OPTIONS}
# Keys of the --config file that are no command-line flag (RuntimeConfig's `flag=False` fields).
CONFIG_FILE_ONLY = frozenset(f.name for f in RuntimeConfig.options() if not f.metadata["flag"]) | {"admin_api_key_file"}
CONFIG_ONLY_KEYS = ("checkpoint", "camera_aliases")
DEMO_HELP = "which built-in DEMO (tiny, random weights) to use without a checkpoint (default: pi05)"


class UsageError(Exception):
    pass


def checkpoint_or_demo(checkpoint: str | None, demo: str | None) -> str:
    """The checkpoint to load: the given one, else the family's DEMO (built offline on first use)."""
    if checkpoint is not None and demo is not None:
        raise UsageError("pass a checkpoint or --demo, not both")
    return checkpoint or str(demo_checkpoint(policy_type=demo or "pi05"))


def add_options(parser: argparse.ArgumentParser, options: dict[str, tuple[type, object, str, str]]) -> None:
    """One --flag per option (name -> type, default, metavar, help), those of the config file only
    left out; booleans are switches: --name turns one that is off by default on, --no-name one that is
    on by default off."""
    for name, (kind, default, metavar, text) in options.items():
        if name in CONFIG_FILE_ONLY:
            continue
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            if default:
                parser.add_argument(f"--no-{flag[2:]}", dest=name, action="store_false", help=f"do not {text}")
            else:
                parser.add_argument(flag, dest=name, action="store_true", help=text)
            continue
        suffix = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, dest=name, type=kind, metavar=metavar, help=text + suffix)


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
    options["admin_api_key"] = admin_api_key(options)
    try:
        options["runtime"] = RuntimeConfig(**{f.name: options[f.name] for f in RuntimeConfig.options()})
    except VlaserveError as e:
        raise UsageError(str(e)) from None
    return options


API_KEY_ENV = "VLASERVE_API_KEY"
ADMIN_API_KEY_ENV = "VLASERVE_ADMIN_API_KEY"


def api_key(options: dict) -> str | None:
    """The key from --api-key, --api-key-file or $VLASERVE_API_KEY (at most one of them); an empty
    one is an error, never a server without a key."""
    return _key("API key", {"--api-key": options["api_key"], "--api-key-file": options["api_key_file"],
                            f"${API_KEY_ENV}": os.environ.get(API_KEY_ENV)}, "--api-key-file")


def admin_api_key(options: dict) -> str | None:
    """The admin routes' key (server.access), from the config file's admin_api_key_file or
    $VLASERVE_ADMIN_API_KEY (at most one of them; no flag); an empty one is an error."""
    return _key("admin key", {"admin_api_key_file": options["admin_api_key_file"],
                              f"${ADMIN_API_KEY_ENV}": os.environ.get(ADMIN_API_KEY_ENV)}, "admin_api_key_file")


def _key(what: str, given: dict[str, str | None], file_source: str) -> str | None:
    """The one key of `given` (source -> value, None where not given; `file_source` names a file to read)."""
    sources = {name: value for name, value in given.items() if value is not None}
    if len(sources) > 1:
        raise UsageError(f"give the {what} one way, not {' and '.join(sources)}")
    if not sources:
        return None
    (source, value), = sources.items()
    if source == file_source:
        try:
            value = Path(value).expanduser().read_text()
        except OSError as e:
            raise UsageError(f"cannot read the {what} file {value}: {e.strerror}") from None
        value = value.strip()
    if not value:
        raise UsageError(f"{source} is empty: give a key, or leave it out to serve without one")
    return value


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


def build_service(options: dict, demo: str | None = None, progress: bool = True, **runtime_overrides):
    """-> (Policy, ServerSettings): what `vlaserve serve` and each `serve-ray` replica serve, from
    `serve_options`' result. The settings are checked first, then the checkpoint (or the family's
    DEMO) loads, then the camera aliases are checked against its cameras. `runtime_overrides`
    replace RuntimeConfig fields (a replica warms up blocking)."""
    # Here, not at the top: torch and the server load only once the options are checked and the
    # checkpoint's read-ahead runs.
    from .policy import Policy
    from .processing.layouts import check_camera_aliases
    from .server.service import ServerSettings

    runtime = replace(options["runtime"], **runtime_overrides)
    settings = ServerSettings.from_options(options)
    policy = Policy.from_pretrained(checkpoint_or_demo(options["checkpoint"], demo), runtime, progress=progress)
    check_camera_aliases(settings.camera_aliases, policy.config.cameras)
    if options["served_model_name"] is not None:
        policy.name = options["served_model_name"]
    return policy, settings
