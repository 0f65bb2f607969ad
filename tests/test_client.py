"""vlaserve_client.Client / AsyncClient against the scripted fake server (tests/client_fakes.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from client_fakes import ACTION_DIM, HORIZON, FakeServer, Scripted, chunk

from vlaserve_client import AsyncClient, AuthenticationError, Client, ConnectionLost, RtcNotSupported, ServerError

OBS = {"images": {"base_0_rgb": np.zeros((4, 4, 3), np.uint8)}, "state": np.arange(3, dtype=np.float32),
       "task": "stack the cups"}
FAST = {"backoff_initial": 0.01, "backoff_max": 0.05}


@pytest.fixture()
def server():
    with FakeServer() as s:
        yield s


def test_infer_sends_a_generation_request_and_returns_the_chunk(server):
    with Client(server.url, **FAST) as client:
        assert client.metadata()["output"]["action_horizon"] == HORIZON
        rtc = {"prev_chunk": chunk(9)[:5], "space": "action", "inference_delay": 2, "execution_horizon": 5}
        reply = client.infer(OBS, rtc=rtc, seed=7, num_inference_steps=4)
    np.testing.assert_array_equal(reply.actions, chunk(1))
    assert reply.actions.dtype == np.float32 and reply.round_trip_ms > 0 and reply.server_timing == {"total_ms": 1.0}
    body = server.requests[0]
    assert body["input"]["task"] == "stack the cups"
    np.testing.assert_array_equal(body["input"]["observation"]["state"], OBS["state"])
    assert body["input"]["observation"]["images"]["base_0_rgb"].dtype == np.uint8
    assert body["parameters"] == {"seed": 7, "num_inference_steps": 4}
    assert body["runtime"]["output_format"] == "numpy"
    np.testing.assert_array_equal(body["rtc"]["prev_chunk"], chunk(9)[:5])
    assert {k: body["rtc"][k] for k in ("space", "inference_delay", "execution_horizon")} == \
        {"space": "action", "inference_delay": 2, "execution_horizon": 5}


def test_url_forms_pick_the_protocol_path(server):
    assert Client(f"127.0.0.1:{server.port}").url == f"ws://127.0.0.1:{server.port}/v1/actions/realtime"
    assert Client("http://h:1", protocol="openpi").url == "ws://h:1/openpi/policy"
    assert Client("wss://h/custom/path").url == "wss://h/custom/path"
    with pytest.raises(ValueError, match="unknown protocol"):
        Client("h:1", protocol="grpc")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Client("h:1", timeout=0)


def test_server_error_names_the_field_and_keeps_the_connection(server):
    server.script = [Scripted(error={"type": "invalid_observation", "field": "input.observation.state",
                                     "message": "expected shape [3], got [2]"})]
    with Client(server.url) as client:
        with pytest.raises(ServerError, match=r"invalid_observation at input.observation.state: expected") as e:
            client.infer(OBS)
        assert (e.value.type, e.value.field) == ("invalid_observation", "input.observation.state")
        np.testing.assert_array_equal(client.infer(OBS).actions, chunk(2))
        assert client.connects == 1


def test_observation_needs_a_task():
    with pytest.raises(ValueError, match="'task' and 'prompt'"):
        Client("h:1").infer({"images": {}, "state": [0.0]})


def test_api_key_is_sent_and_a_refusal_is_not_retried():
    with FakeServer(api_key="sesame") as server:
        with Client(server.url, api_key="sesame") as client:
            client.infer(OBS)
        assert server.headers[-1]["authorization"] == "Bearer sesame"
        with pytest.raises(AuthenticationError, match="401"):
            Client(server.url, api_key="wrong", **FAST).metadata()
        assert len(server.headers) == 2  # one handshake for the wrong key: no retries


def test_timeout_closes_the_socket_so_a_late_reply_is_never_taken_for_the_next(server):
    server.script = [Scripted(latency=0.5)]
    with Client(server.url, timeout=0.1) as client:
        with pytest.raises(TimeoutError, match="no reply .* within 0.1 s"):
            client.infer(OBS)
        assert not client.connected
        np.testing.assert_array_equal(client.infer(OBS).actions, chunk(2))  # not request 1's late chunk
        assert client.connects == 2


def test_connect_retries_with_backoff_until_the_server_is_up():
    server = FakeServer()
    server.port = _free_port()
    starter = threading.Timer(0.3, server.start)
    starter.start()
    try:
        with Client(server.url, reconnect_timeout=10, **FAST) as client:
            assert client.metadata()["output"]["action_dim"] == ACTION_DIM
    finally:
        starter.join()
        server.stop()


def test_connect_gives_up_after_reconnect_timeout():
    with pytest.raises(ConnectionError, match=r"cannot connect to .* within 0.2 s"):
        Client(f"127.0.0.1:{_free_port()}", reconnect_timeout=0.2, **FAST).metadata()


def test_server_restart_loses_the_request_in_flight_then_reconnects(server):
    client = Client(server.url, **FAST)
    client.infer(OBS)
    server.script = [Scripted(drop=True)]
    with pytest.raises(ConnectionLost):
        client.infer(OBS)
    server.stop()
    server.start()  # same port
    np.testing.assert_array_equal(client.infer(OBS).actions, chunk(3))
    assert client.connects == 2
    client.close()


def test_openpi_protocol_errors_and_reconnects():
    with FakeServer(protocol="openpi") as server:
        server.script = [Scripted(), Scripted(error={"type": "invalid_observation", "field": "state",
                                                     "message": "expected shape [3], got [2]"})]
        with Client(server.url, protocol="openpi", **FAST) as client:
            np.testing.assert_array_equal(client.infer(OBS).actions, chunk(1))
            with pytest.raises(ServerError) as e:
                client.infer(OBS)
            assert (e.value.type, e.value.field, e.value.message) == \
                ("invalid_observation", "state", "expected shape [3], got [2]")
            assert not client.connected  # OpenPI closes after an error; the next call reconnects
            np.testing.assert_array_equal(client.infer(OBS).actions, chunk(3))
            with pytest.raises(RtcNotSupported):
                client.infer(OBS, rtc={"prev_chunk": chunk(1)})
        sent = server.requests[0]  # the observation dict as given, no /v1 envelope
        assert sorted(sent) == ["images", "state", "task"] and sent["task"] == OBS["task"]
        np.testing.assert_array_equal(sent["state"], OBS["state"])


def test_async_client(server):
    server.script = [Scripted(), Scripted(error={"type": "invalid_request", "field": "rtc.prev_chunk",
                                                 "message": "bad shape"})]

    async def run():
        async with AsyncClient(server.url, **FAST) as client:
            assert (await client.metadata())["output"]["action_horizon"] == HORIZON
            first = await client.infer(OBS, seed=1)
            with pytest.raises(ServerError) as e:
                await client.infer(OBS, rtc={"prev_chunk": chunk(1)})
            return first, e.value

    first, error = asyncio.run(run())
    np.testing.assert_array_equal(first.actions, chunk(1))
    assert error.field == "rtc.prev_chunk"


NO_TORCH_EXCHANGE = (
    "import sys\n"
    "from vlaserve_client import AsyncClient, Client, ActionChunkExecutor\n"
    "from client_fakes import FakeServer, chunk\n"
    "with FakeServer() as s, Client(s.url) as c:\n"
    "    assert (c.infer({'images': {}, 'state': [0.0], 'task': 't'}).actions == chunk(1)).all()\n"
    "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'pydantic', 'vlaserve'))\n"
    "assert not bad, bad\n"
    "import vlaserve_client\n"
    "print(vlaserve_client.__file__)\n")


def exchange_without_torch(python: str, path: list[Path]) -> Path:
    """Runs one exchange with the fake server in a fresh interpreter with only `path` added to its
    sys.path; returns where vlaserve_client was imported from."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    out = subprocess.run([python, "-c", NO_TORCH_EXCHANGE], capture_output=True, text=True, env=env, timeout=120,
                         cwd=path[-1])
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def test_client_import_never_imports_torch():
    """A robot installs the client without torch: importing it and running an exchange pulls in
    neither torch nor the server (fastapi, vlaserve). Only client/src is on the path."""
    tests = Path(__file__).resolve().parent
    origin = exchange_without_torch(sys.executable, [tests.parent / "client" / "src", tests])
    assert origin == tests.parent / "client" / "src" / "vlaserve_client" / "__init__.py"


@pytest.mark.slow
def test_vlaserve_client_installs_into_a_venv_without_torch(tmp_path):
    """`pip install ./client` (docs/client.md) into a fresh venv: the distribution brings numpy,
    msgpack and websockets, not torch, and an exchange runs from the installed copy."""
    tests = Path(__file__).resolve().parent
    # Built from a copy, so the build leaves nothing in the checkout.
    source = shutil.copytree(tests.parent / "client", tmp_path / "client",
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "robot"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(source)], capture_output=True, text=True,
                             env=env, timeout=600)
    assert install.returncode == 0, install.stderr
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            env=env, timeout=120).stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert {"vlaserve-client", "numpy", "msgpack", "websockets"} <= installed and "torch" not in installed, listed
    origin = exchange_without_torch(python, [tests])
    assert origin.is_relative_to(venv), origin


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
