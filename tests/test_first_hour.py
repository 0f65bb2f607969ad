"""What a newcomer hit in the first hour (issue 79), in process on the golden checkpoint (float32, CPU):
batched PNG / JPEG frames, per-observation errors naming the observation and the expected size, an
all-failed batch answered with its items' status, SGLang's model names, messages that carry their fix,
/metrics labels of every served path, OpenPI's transforms warned about where an OpenPI user looks.

Equalities are exact: a batch item runs the same code as a lone request with the same noise, and a JPEG
decodes to the pixels Pillow gives for it here (test_request_intake.py).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openpi_client import msgpack_numpy

from test_request_intake import NOISE, STATE, actions, decoded, encode, error, frame, post, reply
from test_server import GENERATIONS, assert_actions
from vlaserve.server import ServerSettings, create_app
from vlaserve.server.openpi import TRANSFORMS_WARNING

CAM = "base_0_rgb"


@pytest.fixture(scope="module")
def client(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings())) as c:
        yield c


def batch(images, states, noise=None, task="pick up the red block") -> dict:
    observation = {"images": {CAM: images}, "state": states}
    if noise is not None:
        observation["noise"] = noise
    return {"input": {"task": task, "observation": observation}}


def values(response, i: int) -> np.ndarray:
    return np.asarray(reply(response)["data"][i]["action"]["values"], np.float32)


def lone(client, pixels: np.ndarray, state=STATE) -> np.ndarray:
    return actions(post(client, {"input": {"task": "pick up the red block", "observation": {
        "images": {CAM: pixels}, "state": state, "noise": NOISE}}}))


# ---- row 3: batched encoded frames ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_batch_of_encoded_frames_equals_their_decoded_pixels_sent_alone(client, fmt):
    frames = [encode(frame(s, size=(48, 64)), fmt) for s in range(3)]
    states, noise = np.stack([STATE] * 3), np.stack([NOISE] * 3)
    got = post(client, batch(frames, states, noise))
    assert got.status_code == 200, got.content[:300]
    pixels = post(client, batch(np.stack([decoded(f) for f in frames]), states, noise))  # the same batch, raw
    for i in range(3):
        assert np.array_equal(values(got, i), values(pixels, i))


def test_batched_base64_frames_over_json(client):
    import base64

    frames = [encode(frame(s, size=(32, 32)), "PNG") for s in range(2)]
    body = batch([base64.b64encode(f).decode() for f in frames], np.stack([STATE] * 2).tolist(),
                 np.stack([NOISE] * 2).tolist())
    got = post(client, body, as_json=True)
    assert got.status_code == 200, got.text
    pixels = post(client, batch(np.stack([decoded(f) for f in frames]), np.stack([STATE] * 2), np.stack([NOISE] * 2)))
    assert np.array_equal(values(got, 1), values(pixels, 1))


# ---- row 4: a per-observation mistake fails that observation alone, saying which and what size --------
def test_a_wrong_state_size_fails_its_observation_alone_naming_it_and_the_expected_size(client):
    states = [STATE, STATE[:13], STATE]  # a list: msgpack (or ragged JSON) states of their own sizes
    got = post(client, batch([frame(s, size=(16, 16)) for s in range(3)], states, np.stack([NOISE] * 3)))
    assert got.status_code == 200, got.content[:300]
    data = reply(got)["data"]
    assert data[1]["error"]["field"] == "input.observation.state" and "action" not in data[1]
    assert data[1]["error"]["message"].startswith("observation 1 of 3:")
    assert "[14]" in data[1]["error"]["message"] and "[13]" in data[1]["error"]["message"]
    for i in (0, 2):  # a batch of 2 ran them: the batch tolerance (test_server.ATOL)
        assert_actions(values(got, i), lone(client, frame(i, size=(16, 16))))


# ---- row 5: an all-failed batch is no success ------------------------------------------------------------
@pytest.mark.parametrize("as_json", [False, True])
def test_a_batch_where_every_observation_fails_answers_their_status(client, as_json):
    states = np.zeros((2, 15), np.float32)  # every state one number too long
    images = np.stack([frame(s, size=(16, 16)) for s in range(2)])
    body = batch(images.tolist() if as_json else images, states.tolist() if as_json else states)
    got = post(client, body, as_json=as_json)
    assert got.status_code == 422  # what raise_for_status() (SGLang's cookbook) sees
    answer = reply(got)
    assert answer["error"]["field"] == "input.observation.state"
    assert answer["error"]["message"].startswith("every observation of the batch failed; observation 0 of 2:")
    assert [item["error"]["field"] for item in answer["data"]] == ["input.observation.state"] * 2


def test_an_all_failed_batch_over_the_realtime_socket_keeps_its_items(client):
    with client.websocket_connect("/v1/actions/realtime") as ws:
        ws.receive_bytes()
        ws.send_bytes(msgpack_numpy.packb(batch(np.zeros((2, 8, 8, 3), np.uint8), np.zeros((2, 15), np.float32))))
        answer = msgpack_numpy.unpackb(ws.receive_bytes())
    assert "error" not in answer and all(item["error"]["field"] == "input.observation.state" for item in answer["data"])
    metrics = client.get("/metrics").text
    assert 'vlaserve_requests_total{route="/v1/actions/realtime",status="422"}' in metrics


# ---- row 6: SGLang's model names ------------------------------------------------------------------------
def test_the_checkpoints_recorded_hub_id_is_accepted_as_the_model(golden_policy):
    from dataclasses import replace

    recorded = type(golden_policy).__new__(type(golden_policy))
    recorded.__dict__.update(golden_policy.__dict__, config=replace(golden_policy.config, hub_id="lerobot/pi05_base"))
    body = {"model": "lerobot/pi05_base", "input": {"task": "pick up the red block", "observation": {
        "images": {CAM: frame(1, size=(16, 16))}, "state": STATE, "noise": NOISE}}}
    with TestClient(create_app(recorded, ServerSettings())) as c:
        assert post(c, body).status_code == 200


def test_another_model_name_is_refused_with_the_option_that_fixes_it(client):
    body = {"model": "lerobot/pi05_base", "input": {"task": "pick", "observation": {
        "images": {CAM: frame(1, size=(16, 16))}, "state": STATE}}}
    e = error(post(client, body))
    assert e["field"] == "model" and "--served-model-name lerobot/pi05_base" in e["message"]


# ---- row 10: messages carry their fix -------------------------------------------------------------------
def test_a_task_of_the_wrong_type_names_the_field_not_pydantics_union_member(client):
    body = {"input": {"task": 5, "observation": {"images": {CAM: frame(1, size=(8, 8)).tolist()}, "state": STATE.tolist()}}}
    e = error(post(client, body, as_json=True))
    assert e["field"] == "input.task" and "a string, or a list of strings" in e["message"]


def test_openpi_keys_posted_to_v1_are_pointed_at_the_openpi_socket(client):
    openpi = {"observation/image": frame(1, size=(8, 8)).tolist(), "observation/state": STATE.tolist(), "prompt": "pick"}
    e = error(post(client, openpi, as_json=True))
    assert e["field"] == "input" and "OpenPI websocket" in e["message"] and '{"input": {"task"' in e["message"]


def test_a_msgpack_body_labelled_json_is_told_its_content_type(client):
    got = client.post(GENERATIONS, content=msgpack_numpy.packb({"input": {"task": "x"}}),
                      headers={"Content-Type": "application/json"})
    assert got.status_code == 400 and "Content-Type: application/msgpack" in got.json()["error"]["message"]


def test_the_camera_alias_hint_says_where_aliases_go(client):
    e = error(post(client, {"input": {"task": "pick", "observation": {"images": {"front_cam": frame(1, size=(8, 8))},
                                                                      "state": STATE}}}))
    assert "--config file: camera_aliases {'front_cam': CAMERA}" in e["message"]


# ---- row 11: /metrics labels every served path ------------------------------------------------------------
def test_openapi_and_the_docs_assets_are_counted_under_their_routes(client):
    page = client.get("/docs").text
    asset = re.search(r'(?:src|href)="(/[^"]+)"', page).group(1)  # a script or style the page loads from here
    assert client.get(asset).status_code == 200 and client.get("/openapi.json").status_code == 200
    assert client.get("/page-assets/page.css").status_code == 200  # the page's own assets, a mount as the docs'
    client.get("/no-such-path")
    counted = re.findall(r'^vlaserve_requests_total\{route="([^"]+)",status="(\d+)"\}', client.get("/metrics").text, re.M)
    assert ("/openapi.json", "200") in counted and ("/page-assets", "200") in counted
    assert [status for route, status in counted if route == "unmatched"] == ["404"]  # only what no route serves


# ---- row 12: OpenPI's transforms, said where an OpenPI user looks ------------------------------------------
def test_the_openpi_socket_warns_that_openpis_transforms_are_not_applied(client, caplog):
    caplog.set_level(logging.WARNING, logger="vlaserve.server.openpi")
    with client.websocket_connect("/openpi/policy") as ws:
        metadata = msgpack_numpy.unpackb(ws.receive_bytes())
    assert metadata["warnings"] == [TRANSFORMS_WARNING] and "not applied" in TRANSFORMS_WARNING
    # The log says it once per server process; this module's server may not be the first to connect.
    from vlaserve.server.openpi import _log_transforms_warning

    _log_transforms_warning.cache_clear()
    with client.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()
    assert any(TRANSFORMS_WARNING in r.getMessage() for r in caplog.records)


# ---- rows 7 and 8: install lines that work as written -------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def test_the_readmes_cpu_lines_name_pytorchs_cpu_index_and_ci_runs_its_test_line():
    """A plain package index resolves `torch==2.13.0` to the CUDA build and its CUDA libraries: every CPU
    line installs torch from PyTorch's CPU index first; .ci/run runs the README's test line, the slow tests
    included."""
    readme = (ROOT / "README.md").read_text()
    torch_lines = [line for line in readme.splitlines() if "pip install torch==" in line]
    assert len(torch_lines) == 2 and all(f"pip install torch==2.13.0 {CPU_INDEX} && " in line for line in torch_lines)
    test_line = next(line for line in torch_lines if ".[test]" in line)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_line.replace(' -m "not slow"', "") in ci.splitlines()


def test_no_install_line_names_a_package_or_address_that_does_not_exist():
    """vlaserve is installed from its clone, not from a package index; no placeholder account in a URL."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src" / "vlaserve" / "fleet").glob("*.py")]
    for page in pages:
        text = page.read_text()
        assert 'install "vlaserve[' not in text and "install vlaserve[" not in text, page
        assert "github.com/OWNER" not in text, page
    assert "git clone" in (ROOT / "README.md").read_text()
