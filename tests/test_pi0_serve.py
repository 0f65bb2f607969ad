"""Pi0 served end to end: a real `vlaserve serve` process on the Pi0 golden checkpoint answering the
unmodified openpi-client and both /v1 routes, the Pi0 DEMO, `vlaserve info`, and a config whose type
does not match its weights.

Tolerances: the server's answers are compared with an in-process `Policy.infer` on the same checkpoint
(float32, same noise) at ATOL = 1e-4, as in test_server.py: the two runs differ only in reduction
order (batching, thread count: up to ~1e-5), while the smallest effect of a Pi0 bug in the golden
README §3 (the state token also attending to the actions) moves the actions by 5.6e-4 and the
state-path bugs by >= 2.6e-3. The golden case sent through the server is held to the golden
FLOAT_TOLERANCE (1e-5) against LeRobot's own actions, as in test_pi0_golden.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets.sync.client as ws_client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from test_server import (ATOL, CAMERAS, GENERATIONS, MSGPACK, ServerProcess, make_noise, make_observation,
                         openpi_observation, request_body)

from conftest import fixture_dir
from vlaserve import Policy
from vlaserve.cli import main
from vlaserve.info import checkpoint_info
from vlaserve.errors import CheckpointError
from vlaserve.golden import FLOAT_TOLERANCE, GoldenCase

pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

GOLDEN = fixture_dir("pi0_golden")
CHECKPOINT = GOLDEN / "checkpoint"


@pytest.fixture(scope="module")
def pi0_policy():
    return Policy.from_pretrained(CHECKPOINT, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def pi0_server(tmp_path_factory):
    proc = ServerProcess([str(CHECKPOINT), "--device", "cpu", "--dtype", "float32", "--batch-delay-ms", "5"],
                         tmp_path_factory.mktemp("pi0_server") / "server.log")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def _assert_close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=atol)


def _actions(envelope: dict) -> np.ndarray:
    return np.asarray(envelope["data"][0]["action"]["values"], dtype=np.float32)


def test_openpi_client_gets_pi0_metadata_and_the_python_apis_actions(pi0_server, pi0_policy):
    client = WebsocketClientPolicy(host=f"{pi0_server.ws_url}/openpi/policy")
    metadata = client.get_server_metadata()
    assert (metadata["policy_type"], metadata["max_token_len"], metadata["is_demo"]) == ("pi0", 48, False)
    for seed in (1, 2):
        obs = make_observation(seed, cameras=("base_0_rgb", "left_wrist_0_rgb"))
        noise = make_noise(seed)
        out = client.infer(openpi_observation(obs, noise))
        assert out["actions"].shape == (50, 14)
        _assert_close(out["actions"], pi0_policy.infer(obs, noise=noise).actions)


def test_http_golden_case_matches_lerobot(pi0_server):
    # The golden case's own inputs (float CHW images in [0, 1], as LeRobot was fed) through /v1.
    case = GoldenCase.load(GOLDEN / "cases" / "three_cams_224")
    obs = case.observations()[0]
    body = request_body(obs, case.tensors["input.noise"][0])
    response = httpx.post(pi0_server.url + GENERATIONS, content=msgpack_numpy.packb(body),
                          headers={"Content-Type": MSGPACK, "Accept": MSGPACK})
    assert response.status_code == 200, response.text
    _assert_close(_actions(msgpack_numpy.unpackb(response.content)), case.tensors["expected.actions"][0],
                  FLOAT_TOLERANCE)


def test_http_json_rtc_and_metadata(pi0_server, pi0_policy):
    meta = httpx.get(pi0_server.url + "/v1/actions/metadata").json()
    assert (meta["policy_type"], meta["cameras"], meta["state_dim"]) == ("pi0", list(CAMERAS), 14)
    obs, noise = make_observation(3, size=(48, 64)), make_noise(3)
    previous = pi0_policy.infer(obs, noise=make_noise(4)).model_actions[25:, :14]
    rtc = {"prev_chunk": previous.tolist(), "inference_delay": 3, "execution_horizon": 10}
    response = httpx.post(pi0_server.url + GENERATIONS, json=request_body(obs, noise, lists=True, rtc=rtc))
    assert response.status_code == 200, response.text
    guided = _actions(response.json())
    _assert_close(guided, pi0_policy.infer(obs, noise=noise, rtc=rtc).actions)
    assert np.abs(guided - pi0_policy.infer(obs, noise=noise).actions).max() > 100 * ATOL  # RTC acted


def test_realtime_websocket(pi0_server, pi0_policy):
    obs, noise = make_observation(5), make_noise(5)
    with ws_client.connect(f"{pi0_server.ws_url}/v1/actions/realtime") as ws:
        assert msgpack_numpy.unpackb(ws.recv())["policy_type"] == "pi0"
        ws.send(msgpack_numpy.packb(request_body(obs, noise)))
        _assert_close(_actions(msgpack_numpy.unpackb(ws.recv())), pi0_policy.infer(obs, noise=noise).actions)


# ---- the DEMO (`vlaserve serve --demo pi0`: tests/test_demo.py) ---------------------------------
def test_pi0_demo_mirrors_the_pi0_golden_checkpoint_formats(tmp_path):
    from vlaserve.demo import demo_checkpoint

    demo = demo_checkpoint(tmp_path, "pi0")
    ours = {p.relative_to(demo) for p in demo.rglob("*") if p.is_file()}
    theirs = {p.relative_to(CHECKPOINT) for p in CHECKPOINT.rglob("*") if p.is_file()}
    assert ours - theirs == {Path("README.md")} and theirs <= ours
    config, golden = (json.loads((d / "config.json").read_text()) for d in (demo, CHECKPOINT))
    assert list(config) == list(golden) and config["type"] == "pi0"
    assert config["normalization_mapping"] == golden["normalization_mapping"]
    steps = [[s["registry_name"] for s in json.loads((d / "policy_preprocessor.json").read_text())["steps"]]
             for d in (demo, CHECKPOINT)]
    assert steps[0] == steps[1]
    arch, golden_arch = (json.loads((d / "architecture.json").read_text()) for d in (demo, CHECKPOINT))
    assert arch["demo"] is True and arch["format"] == golden_arch["format"]
    for part in ("vlm", "expert", "vision"):
        assert arch[part] == golden_arch[part], part
    assert set(arch["policy"]) == set(golden_arch["policy"])
    assert "DEMO" in (demo / "README.md").read_text() and "Pi0 " in (demo / "README.md").read_text()


# ---- vlaserve info, and a config.json type that does not match the weights ----------------------
def test_info_on_a_pi0_checkpoint(capsys):
    info = checkpoint_info(str(CHECKPOINT), "bfloat16", 8)
    assert (info["policy_type"], info["max_token_len"], info["normalization"]) == ("pi0", 48, "lerobot")
    # 333,664 stored parameters, less the two unused lm_heads (1024 x 64 and 1024 x 32).
    assert info["parameters"]["total"] == 333_664 - 1024 * 64 - 1024 * 32
    assert main(["info", str(CHECKPOINT)]) == 0
    assert "policy type     pi0" in capsys.readouterr().out


def test_info_demo_pi0(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLASERVE_CACHE", str(tmp_path))
    assert main(["info", "--demo", "pi0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["policy_type"], info["is_demo"]) == ("pi0", True)
    assert main(["info", str(CHECKPOINT), "--demo", "pi0"]) == 2  # a checkpoint or a demo, not both


def _mixed(tmp_path, config_from, weights_from):
    directory = tmp_path / "mixed"
    shutil.copytree(config_from, directory)
    shutil.copy(weights_from / "model.safetensors", directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("config_from, weights_from, message", [
    ("pi0_golden", "pi05_golden", r"does not match the Pi0 architecture; missing tensors: .*state_proj.*"
                                  r"The weights are a Pi0\.5 checkpoint .*config\.json's type is 'pi0'"),
    ("pi05_golden", "pi0_golden", r"does not match the Pi0\.5 architecture; missing tensors: .*norm\.dense.*"
                                  r"The weights are a Pi0 checkpoint .*config\.json's type is 'pi05'"),
])
def test_config_type_and_weights_of_different_families_are_refused(tmp_path, caplog, config_from, weights_from,
                                                                   message):
    directory = _mixed(tmp_path, fixture_dir(config_from) / "checkpoint", fixture_dir(weights_from) / "checkpoint")
    with pytest.raises(CheckpointError, match=message):
        Policy.from_pretrained(directory, device="cpu", dtype="float32", progress=False)
    assert main(["info", str(directory)]) == 2
    assert "The weights are a" in caplog.text


def test_unknown_policy_type_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "type": "smolvla"}))
    with pytest.raises(CheckpointError, match=r"type 'smolvla'; vlaserve serves pi05 and pi0"):
        Policy.from_pretrained(directory, device="cpu", progress=False)
