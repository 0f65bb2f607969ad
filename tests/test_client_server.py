"""The client against a real `vlaserve serve` process (golden checkpoint, float32, CPU): one server,
both protocols, and the executor through three chunk switches with RTC."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from vlaserve_client import ActionChunkExecutor, AuthenticationError, Client, ServerError

API_KEY = "robot-key"


@pytest.fixture(scope="module")
def server_url(golden, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("client_server") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vlaserve.cli", "serve", str(golden / "checkpoint"),
                                 "--device", "cpu", "--dtype", "float32", "--port", str(port),
                                 "--api-key", API_KEY], stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    try:
        while True:  # until /healthz answers, or the process dies
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield f"ws://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


def observation(state) -> dict:
    rng = np.random.default_rng(0)
    return {"images": {"base_0_rgb": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
            "state": np.asarray(state, np.float32), "task": "pick up the red block"}


def test_both_protocols(server_url):
    with Client(server_url, api_key=API_KEY) as client:
        metadata = client.metadata()
        horizon, dim = metadata["action_horizon"], metadata["action_dim"]
        first = client.infer(observation(np.zeros(metadata["state_dim"])), seed=3)
        assert first.actions.shape == (horizon, dim) and first.server_timing["total_ms"] > 0
        again = client.infer(observation(np.zeros(metadata["state_dim"])), seed=3)
        np.testing.assert_array_equal(again.actions, first.actions)  # same seed, same server: same answer
        rtc = {"prev_chunk": first.actions[20:], "space": "action", "inference_delay": 5, "execution_horizon": 30}
        guided = client.infer(observation(np.zeros(metadata["state_dim"])), seed=4, rtc=rtc)
        assert guided.actions.shape == (horizon, dim)
        with pytest.raises(ServerError) as e:
            client.infer(observation(np.zeros(3)))
        assert (e.value.type, e.value.field) == ("invalid_observation", "input.observation.state")
    with Client(server_url, protocol="openpi", api_key=API_KEY) as openpi:
        assert openpi.infer(observation(np.zeros(metadata["state_dim"]))).actions.shape == (horizon, dim)
    with pytest.raises(AuthenticationError):
        Client(server_url, api_key="wrong").metadata()


def test_executor_through_three_switches(server_url):
    client = Client(server_url, api_key=API_KEY)
    state_dim = client.metadata()["state_dim"]
    hz = 50.0
    with ActionChunkExecutor(client, control_hz=hz, execution_horizon=25) as executor:
        executor.start(observation(np.zeros(state_dim)))
        for tick in range(2000):  # a bound, not a timing: 3 switches take ~75 ticks
            action = executor.get_action(observation(np.full(state_dim, tick * 1e-3)))
            assert action.shape == (executor.action_dim,) and np.isfinite(action).all()
            if executor.stats.chunks >= 4:
                break
            time.sleep(1 / hz)
        stats = executor.stats
    assert stats.chunks >= 4, stats
    assert stats.rtc_active and stats.rtc_requests >= 3 and executor.error is None, stats
    switches = [e for e in executor.events if e.kind == "switch"]
    assert all(1 <= e.detail["index"] < executor.horizon for e in switches), switches
