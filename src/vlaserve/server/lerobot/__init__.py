"""LeRobot's async inference wire (`vlaserve serve --lerobot-port PORT`, docs/lerobot.md): the gRPC
`AsyncInference` service its unmodified robot_client talks to, reading the pickles it sends through
an allow-list only. Light to import: grpc loads when the service starts (server.py)."""

from __future__ import annotations

import importlib.util


def problem_with(options: dict) -> str | None:
    """Why `vlaserve serve` cannot serve --lerobot-port with these options, or None."""
    if options.get("lerobot_port") is None:
        return None
    if options["lerobot_port"] == options["port"]:
        return "--lerobot-port must differ from --port"
    if options["api_key"]:
        return ("--lerobot-port cannot be served with an API key: LeRobot's robot_client sends none, so the port "
                "would be open to anyone who reaches it; serve it without a key on a trusted network (docs/lerobot.md)")
    if importlib.util.find_spec("grpc") is None or importlib.util.find_spec("google.protobuf") is None:
        return ('--lerobot-port needs grpcio and protobuf: pip install -e ".[lerobot]" in vlaserve\'s clone '
                "(or pip install grpcio protobuf)")
    return None
