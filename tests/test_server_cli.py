"""`vlaserve serve`: option precedence and the errors that must end with exit code 2 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vlaserve.cli import build_parser
from vlaserve.options import UsageError, serve_options


def options(argv: list[str]) -> dict:
    return serve_options(vars(build_parser().parse_args(["serve", *argv])))


def test_defaults_then_config_file_then_command_line(tmp_path):
    assert options([])["port"] == 8000 and options([])["checkpoint"] is None
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"port": 9000, "max-batch-size": 4, "dtype": "float32", "checkpoint": "a/b",
                                  "camera_aliases": {"observation.images.top": "base_0_rgb"}}))
    merged = options(["--config", str(config), "--port", "9100"])
    assert merged["port"] == 9100  # the command line wins
    assert (merged["max_batch_size"], merged["dtype"], merged["checkpoint"]) == (4, "float32", "a/b")
    assert merged["camera_aliases"] == {"observation.images.top": "base_0_rgb"}
    assert merged["host"] == "127.0.0.1" and merged["batch_delay_ms"] == 0.0  # continuous batching by default
    assert options(["ckpt", "--config", str(config)])["checkpoint"] == "ckpt"


@pytest.mark.parametrize("content, message", [
    ('{"prot": 1}', "unknown option 'prot'"),
    ('{"port": "80"}', "port must be an integer"),
    ("[1]", "must hold a JSON object"),
    ("{", "not valid JSON"),
    ('{"camera_aliases": {"cam": 3}}', "camera_aliases must map"),
])
def test_bad_config_files(tmp_path, content, message):
    config = tmp_path / "serve.json"
    config.write_text(content)
    with pytest.raises(UsageError, match=message):
        options(["--config", str(config)])


def run_serve(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "VLASERVE_CACHE": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "vlaserve.cli", "serve", *args], capture_output=True, text=True,
                          env=env)


def test_hub_id_while_offline_exits_2_with_a_clear_message(tmp_path):
    result = run_serve(["some-org/some-pi05-model"], tmp_path)
    assert result.returncode == 2
    assert "some-org/some-pi05-model" in result.stderr and "Offline" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_directory_and_bad_config_exit_2(tmp_path):
    result = run_serve([str(tmp_path / "no-such-checkpoint")], tmp_path)
    assert result.returncode == 2 and "is not a directory" in result.stderr and "Traceback" not in result.stderr
    config = tmp_path / "serve.json"
    config.write_text('{"workers": 4}')
    result = run_serve(["--config", str(config)], tmp_path)
    assert result.returncode == 2 and "unknown option 'workers'" in result.stderr and "Traceback" not in result.stderr
