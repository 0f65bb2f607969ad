"""`vlaserve` command-line options: --version, a taken port (exit 2 before loading), --served-model-name,
--log-requests, and the startup line that says how robots on other computers connect."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import vlaserve
from vlaserve.cli import RequestLog, build_parser, reachability
from vlaserve.options import UsageError, check_can_bind, serve_options

from test_server_cli import run_serve


def options(argv: list[str]) -> dict:
    return serve_options(vars(build_parser().parse_args(["serve", *argv])))


def test_version():
    result = subprocess.run([sys.executable, "-m", "vlaserve.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"vlaserve {vlaserve.__version__}"


def test_new_server_options_from_command_line_and_config(tmp_path):
    assert options([])["served_model_name"] is None and options([])["log_requests"] is False
    assert options(["--served-model-name", "arm-7", "--log-requests"])["served_model_name"] == "arm-7"
    assert options(["--log-requests"])["log_requests"] is True
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"log-requests": True, "served_model_name": "arm-8"}))
    merged = options(["--config", str(config)])
    assert merged["log_requests"] is True and merged["served_model_name"] == "arm-8"
    config.write_text('{"log_requests": "yes"}')
    with pytest.raises(UsageError, match="log_requests must be true or false"):
        options(["--config", str(config)])
    config.write_text('{"port": true}')
    with pytest.raises(UsageError, match="port must be an integer"):
        options(["--config", str(config)])
    with pytest.raises(UsageError, match="served_model_name must not be empty"):
        options(["--served-model-name", " "])


def _flags(command: str) -> list[str]:
    """Every option string a subcommand's parser takes (-h and --help counted apart)."""
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return [flag for action in commands.choices[command]._actions for flag in action.option_strings]


def test_serve_takes_at_most_30_flags_and_the_fp8_gate_from_the_config_file(tmp_path):
    """`vlaserve serve --help` lists at most 30 flags (--help among them): options that exist only to
    compare two ways are gone, and the fp8 gate's inputs and capture_while_loading are config-file keys."""
    flags = [f for f in _flags("serve") if f != "-h"]
    assert len(flags) <= 30, flags
    for key in ("precision_gate", "precision_scales", "precision_observations", "gripper_dims", "action_groups",
                "capture_while_loading"):
        assert f"--{key.replace('_', '-')}" not in flags and f"--no-{key.replace('_', '-')}" not in flags
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gripper-dims", "6"])
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"precision_gate": "warn", "gripper_dims": "6,13", "capture_while_loading": False}))
    runtime = options(["--config", str(config)])["runtime"]
    assert (runtime.precision_gate, runtime.gripper_dims, runtime.capture_while_loading) == ("warn", (6, 13), False)


def listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_taken_port_exits_2_before_loading(tmp_path):
    with listening_socket() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {port} .*already in use.*--port"):
            check_can_bind("127.0.0.1", port)
        result = run_serve(["--port", str(port), "--device", "cpu"], tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"port {port}" in errors[0] and "--port" in errors[0]
    assert "Traceback" not in result.stderr
    assert "loaded in" not in result.stderr and "DEMO" not in result.stderr  # failed before loading weights


def test_free_port_binds_and_is_released():
    with listening_socket() as s:
        port = s.getsockname()[1]
    check_can_bind("127.0.0.1", port)
    check_can_bind("127.0.0.1", port)  # the check itself let go of the port


def test_reachability_in_the_startup_line():
    assert "local only: pass --host 0.0.0.0 so robots on other computers can connect" in reachability("127.0.0.1")
    assert "local only" in reachability("localhost")
    assert "on every interface" in reachability("0.0.0.0")
    assert reachability("192.168.1.5") == ""


def test_request_log_middleware(caplog):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        pass

    async def receive():
        return {"type": "http.request"}

    with caplog.at_level(logging.INFO, logger="vlaserve.requests"):
        asyncio.run(RequestLog(app)({"type": "http", "method": "GET", "path": "/nope"}, receive, send))
    lines = [r.getMessage() for r in caplog.records if r.name == "vlaserve.requests"]
    assert len(lines) == 1 and lines[0].startswith("GET /nope 404 ") and lines[0].endswith(" ms")


def test_served_model_name_and_request_log_end_to_end(tmp_path):
    with listening_socket() as s:
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "VLASERVE_CACHE": str(tmp_path)}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "vlaserve.cli", "serve", "--port", str(port), "--device",
                                   "cpu", "--served-model-name", "arm-7", "--log-requests"],
                                  stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            health = None
            for _ in range(600):
                assert server.poll() is None, log_path.read_text()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                        health = json.loads(r.read())
                    break
                except OSError:
                    time.sleep(0.2)
            assert health is not None and health["model"] == "arm-7"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/actions/metadata", timeout=5) as r:
                assert json.loads(r.read())["model"] == "arm-7"
        finally:
            server.terminate()
            server.wait(timeout=60)
    log = log_path.read_text()
    assert "local only: pass --host 0.0.0.0" in log
    assert any("GET /healthz 200" in line and line.endswith(" ms") for line in log.splitlines()), log
