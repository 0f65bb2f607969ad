"""LeRobot 0.6.1's own RobotClient, unmodified, against `vlaserve serve --lerobot-port` on the pi05
golden checkpoint (tests/lerobot_client_runner.py: a simulated robot, >= 100 control steps).

LeRobot 0.6.1 needs Python >= 3.12, so it runs in a venv of its own, built once from PyPI into
$VLASERVE_LEROBOT_VENV (default ~/.cache/vlaserve-tests/lerobot-0.6.1-venv) with the interpreter
in $VLASERVE_LEROBOT_PYTHON, or python3.13 / python3.12 on PATH; without one the tests skip.
LeRobot is installed --no-deps with only the modules robot_client imports (LEROBOT_CLIENT_PACKAGES).

Tolerance: as test_lerobot.py, ATOL = 1e-4 against /v1 for the same observation and noise.
"""

from __future__ import annotations

import glob
import os
import pickle
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_server import ATOL, ServerProcess, envelope_actions, free_port, post_msgpack

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")]

RUNNER = Path(__file__).with_name("lerobot_client_runner.py")
STEPS = 100
# torch (with its own dependencies) for the venv's Python; the rest --no-deps: what robot_client imports.
LEROBOT_TORCH = "torch==2.13.0"
LEROBOT_CLIENT_PACKAGES = [
    "lerobot==0.6.1", "numpy==2.2.6", "grpcio==1.85.4", "protobuf==7.36.2", "draccus==0.11.6", "mergedeep==1.3.4",
    "pyyaml==6.0.4", "typing-inspect==0.9.0", "mypy-extensions==1.2.0", "opencv-python-headless==4.13.0.92",
    "pillow==13.0.0", "torchvision==0.29.1", "huggingface-hub==2.5.0", "httpx2==2.17.0", "httpcore2==2.17.0",
    "h11==0.16.0", "idna==3.21", "truststore==0.10.5", "tqdm==4.70.1", "safetensors==0.8.0", "einops==0.8.2",
    "packaging==26.4", "gymnasium==1.4.0"]


def _interpreter() -> str | None:
    candidates = [os.environ.get("VLASERVE_LEROBOT_PYTHON"), shutil.which("python3.13"), shutil.which("python3.12"),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[23]*/bin/python")))]
    for python in filter(None, candidates):
        ok = subprocess.run([python, "-c", "import sys; assert sys.version_info >= (3, 12)"], capture_output=True)
        if ok.returncode == 0:
            return python
    return None


def _imports_client(python: Path) -> bool:
    # Elsewhere than here: importing robot_client opens a log file under ./logs.
    return python.exists() and subprocess.run([str(python), "-c", "import lerobot.async_inference.robot_client"],
                                              capture_output=True, cwd=tempfile.gettempdir()).returncode == 0


@pytest.fixture(scope="session")
def lerobot_python() -> str:
    venv = Path(os.environ.get("VLASERVE_LEROBOT_VENV", "~/.cache/vlaserve-tests/lerobot-0.6.1-venv")).expanduser()
    python = venv / "bin" / "python"
    if _imports_client(python):
        return str(python)
    interpreter = _interpreter()
    if interpreter is None:
        pytest.skip("LeRobot 0.6.1 needs Python >= 3.12: set VLASERVE_LEROBOT_PYTHON or put python3.12 on PATH")
    subprocess.run([interpreter, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, LEROBOT_TORCH], check=True)
    subprocess.run([*pip, "--no-deps", *LEROBOT_CLIENT_PACKAGES], check=True)
    assert _imports_client(python), "LeRobot's robot_client does not import in the venv just built"
    return str(python)


@pytest.fixture(scope="module")
def server(golden, tmp_path_factory):
    port = free_port()
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32", "--batch-delay-ms", "20",
                          "--lerobot-port", str(port)], tmp_path_factory.mktemp("lerobot_client") / "server.log")
    proc.lerobot = f"127.0.0.1:{port}"
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def run_client(python: str, server, seed: int, out: Path) -> subprocess.Popen:
    log = open(out.with_suffix(".log"), "wb")
    return subprocess.Popen([python, str(RUNNER), server.lerobot, str(seed), str(STEPS), str(out)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=out.parent,
                            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})


def check_record(out: Path, http: httpx.Client, seed: int) -> int:
    """The client's record (the runner's): >= STEPS actions performed, every chunk timed off the
    observation it answers and equal to /v1's answer for it. Returns the number of chunks."""
    assert out.exists(), out.with_suffix(".log").read_text()
    with open(out, "rb") as f:
        record = pickle.load(f)  # written by our own runner
    assert record["finished"] and len(record["performed"]) >= STEPS
    sent = {timestamp: (timestep, raw) for timestamp, timestep, _, raw in record["observations"]}
    assert len(record["chunks"]) >= 2
    for chunk in record["chunks"]:
        timestamp, timestep, _ = chunk[0]
        assert timestamp in sent, "a chunk that answers no observation this robot sent"
        obs_timestep, raw = sent[timestamp]
        assert [a[1] for a in chunk] == list(range(obs_timestep, obs_timestep + len(chunk)))
        np.testing.assert_allclose([a[0] for a in chunk], [timestamp + i / 30 for i in range(len(chunk))], atol=1e-9)
        body = {"input": {"task": raw["task"], "observation": {
            "images": {camera: raw[camera] for camera in ("base_0_rgb", "left_wrist_0_rgb")},
            "state": np.array([raw[f"joint_{i}.pos"] for i in range(14)], np.float32), "noise": raw["noise"]}}}
        from openpi_client import msgpack_numpy

        expected = envelope_actions(msgpack_numpy.unpackb(post_msgpack(http, body).content))
        np.testing.assert_allclose(np.stack([a[2] for a in chunk]), expected[:len(chunk)], rtol=0, atol=ATOL)
    return len(record["chunks"])


def test_lerobot_robot_client_runs_100_steps_on_vlaserve(lerobot_python, server, tmp_path):
    out = tmp_path / "robot.pkl"
    assert run_client(lerobot_python, server, seed=1, out=out).wait(900) == 0, out.with_suffix(".log").read_text()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        check_record(out, http, seed=1)


def test_two_lerobot_clients_and_an_openpi_robot_at_once(lerobot_python, server, tmp_path):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    outs = [tmp_path / f"robot{seed}.pkl" for seed in (2, 3)]
    clients = [run_client(lerobot_python, server, seed, out) for seed, out in zip((2, 3), outs)]
    sizes, openpi = [], WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    rng = np.random.default_rng(7)
    while any(c.poll() is None for c in clients):
        observation = {"observation/image": rng.integers(0, 256, (96, 128, 3), dtype=np.uint8),
                       "observation/state": rng.normal(size=14).astype(np.float32), "prompt": "wave"}
        sizes.append(openpi.infer(observation)["policy_timing"]["batch_size"])
    assert [c.wait() for c in clients] == [0, 0], [o.with_suffix(".log").read_text()[-3000:] for o in outs]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for seed, out in zip((2, 3), outs):
            check_record(out, http, seed)  # each robot's chunks answer its own observations
    assert max(sizes) >= 2, sizes  # the openpi robot shared batches with the LeRobot robots
