"""The server as a real process on 127.0.0.1, serving the tiny golden checkpoint in float32 on the CPU.

Every answer is compared with an in-process `Policy.infer` on the same checkpoint, in float32, with
the same noise. Tolerance (ATOL below): the two runs do the same float32 arithmetic except for
reduction order (batching changes the GEMM shapes, measured up to 7e-7; a different torch thread
count up to 1e-5 on actions of magnitude up to ~5). The golden README measures the smallest effect
of a real bug (one token id, a position off by one) at 1.2e-3 on these outputs, so 1e-4 keeps a
10x margin below bugs and 10x above rounding.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
import websockets.sync.client as ws_client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosedError, InvalidStatus

ATOL = 1e-4
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
HORIZON, ACTION_DIM, MODEL_DIM, STATE_DIM = 50, 14, 32, 14
MSGPACK = "application/msgpack"
GENERATIONS = "/v1/actions/generations"

pytestmark = pytest.mark.filterwarnings(
    # openpi-client 0.1.2 calls websockets' connect() without a context manager.
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


# ---- a server process -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m vlaserve.cli serve ...` on a free port, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, preexec_fn=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vlaserve.cli", "serve", *args, "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Polls /healthz until it answers; fails (with the log) if the process exits first."""
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before it was ready:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait()


@pytest.fixture(scope="session")
def server(golden, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    config = tmp / "serve.json"
    config.write_text(json.dumps({
        "dtype": "bfloat16",  # the command line's --dtype float32 must win
        "api_key": API_KEY,
        "max-payload-mb": 1,
        "batch_delay_ms": 5,
        "camera_aliases": {"observation.images.top": "base_0_rgb", "images.cam_low": "base_0_rgb"},
    }))
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32", "--config", str(config)],
                         tmp / "server.log")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH) as client:
        yield client


# ---- inputs and references --------------------------------------------------------------------
def make_observation(seed: int, cameras=CAMERAS, size=(224, 224)) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": {cam: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for cam in cameras},
            "state": rng.normal(size=STATE_DIM).astype(np.float32), "task": f"pick up block {seed}"}


def make_noise(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((HORIZON, MODEL_DIM)).astype(np.float32)


def request_body(obs: dict, noise=None, lists: bool = False, **sections) -> dict:
    """A /v1 generation request for `obs`; `lists` turns the arrays into nested lists (JSON)."""
    convert = (lambda a: a.tolist()) if lists else (lambda a: a)
    observation = {"images": {c: convert(img) for c, img in obs["images"].items()}, "state": convert(obs["state"])}
    if noise is not None:
        observation["noise"] = convert(noise)
    return {"input": {"task": obs["task"], "observation": observation}, **sections}


def openpi_observation(obs: dict, noise: np.ndarray) -> dict:
    """`obs` (base and left wrist cameras) in the DROID/LIBERO keys an OpenPI client sends."""
    return {"observation/image": obs["images"]["base_0_rgb"], "observation/wrist_image": obs["images"]["left_wrist_0_rgb"],
            "observation/state": obs["state"].astype(np.float64), "prompt": obs["task"], "noise": noise}


def post_msgpack(http: httpx.Client, body: dict, accept: str = MSGPACK) -> httpx.Response:
    return http.post(GENERATIONS, content=msgpack_numpy.packb(body),
                     headers={"Content-Type": MSGPACK, "Accept": accept})


def envelope_actions(envelope: dict) -> np.ndarray:
    action = envelope["data"][0]["action"]
    values = np.asarray(action["values"], dtype=np.float32)
    assert list(values.shape) == action["shape"] == [HORIZON, ACTION_DIM] and action["dtype"] == "float32"
    return values


def assert_actions(actual, expected) -> None:
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=ATOL)


# ---- OpenPI compatibility (unmodified openpi-client) -------------------------------------------
def test_openpi_client_metadata_and_infer(server, golden_policy):
    client = WebsocketClientPolicy(host=f"{server.ws_url}/openpi/policy", api_key=API_KEY)
    metadata = client.get_server_metadata()
    assert metadata["cameras"] == list(CAMERAS)
    dims = (metadata["action_horizon"], metadata["action_dim"], metadata["state_dim"])
    assert dims == (HORIZON, ACTION_DIM, STATE_DIM)
    assert metadata["dtype"] == "float32" and metadata["is_demo"] is False

    for seed in (1, 2):
        obs = make_observation(seed, cameras=("base_0_rgb", "left_wrist_0_rgb"))
        noise = make_noise(seed)
        out = client.infer(openpi_observation(obs, noise))
        assert out["actions"].dtype == np.float32 and out["actions"].shape == (HORIZON, ACTION_DIM)
        assert_actions(out["actions"], golden_policy.infer(obs, noise=noise).actions)
        assert out["server_timing"]["infer_ms"] > 0
        assert ("prev_total_ms" in out["server_timing"]) == (seed == 2)  # reported from the 2nd reply on
        assert {"preprocess_ms", "prefix_ms", "denoise_ms", "device_ms", "postprocess_ms"} <= set(out["policy_timing"])
        assert out["policy_timing"]["batch_size"] == 1  # one client: every batch holds its request alone


def test_openpi_client_aloha_keys_at_root_path(server, golden_policy):
    # openpi-client's default URI has no path: ws://host:port.
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.port, api_key=API_KEY)
    obs = make_observation(3)
    noise = make_noise(3)
    chw = {cam: np.ascontiguousarray(img.transpose(2, 0, 1)) for cam, img in obs["images"].items()}
    out = client.infer({"images": {"cam_high": chw["base_0_rgb"], "cam_left_wrist": chw["left_wrist_0_rgb"],
                                   "cam_right_wrist": chw["right_wrist_0_rgb"]},
                        "state": obs["state"], "prompt": obs["task"], "noise": noise})
    assert_actions(out["actions"], golden_policy.infer(obs, noise=noise).actions)


def test_openpi_client_lerobot_keys_and_configured_alias(server, golden_policy):
    client = WebsocketClientPolicy(host=f"{server.ws_url}/openpi/policy", api_key=API_KEY)
    obs = make_observation(4)
    noise = make_noise(4)
    out = client.infer({"observation.images.top": obs["images"]["base_0_rgb"],  # alias from serve.json
                        "observation.images.left_wrist_0_rgb": obs["images"]["left_wrist_0_rgb"],
                        "observation.images.right_wrist_0_rgb": obs["images"]["right_wrist_0_rgb"],
                        "observation.state": obs["state"], "task": obs["task"], "noise": noise})
    assert_actions(out["actions"], golden_policy.infer(obs, noise=noise).actions)


def test_openpi_error_is_a_text_frame_then_close_1011(server):
    client = WebsocketClientPolicy(host=f"{server.ws_url}/openpi/policy", api_key=API_KEY)
    obs = make_observation(5)
    with pytest.raises(RuntimeError, match="observation/left_image: maps to no camera"):
        client.infer({"observation/left_image": obs["images"]["base_0_rgb"], "observation/state": obs["state"],
                      "prompt": obs["task"]})

    with ws_client.connect(f"{server.ws_url}/openpi/policy", additional_headers=AUTH) as ws:
        ws.recv()  # metadata
        ws.send(msgpack_numpy.packb({"observation/state": obs["state"][:3], "prompt": "x",
                                     "observation/image": obs["images"]["base_0_rgb"]}))
        reason = ws.recv()
        assert isinstance(reason, str) and "state" in reason and "[14]" in reason
        with pytest.raises(ConnectionClosedError):
            ws.recv()
        assert ws.close_code == 1011


# ---- HTTP ---------------------------------------------------------------------------------------
def test_http_json_round_trip(http, golden_policy):
    obs = make_observation(10, size=(48, 64))  # small images keep the JSON under the 1 MiB test limit
    noise = make_noise(10)
    response = http.post(GENERATIONS, json=request_body(obs, noise, lists=True, runtime={"return_timing": True},
                                                        model="checkpoint"))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    envelope = response.json()
    assert envelope["object"] == "action.generation" and envelope["model"] == "checkpoint"
    assert envelope["id"].startswith("actgen-") and envelope["data"][0]["index"] == 0
    assert_actions(envelope_actions(envelope), golden_policy.infer(obs, noise=noise).actions)
    stages = ("decode", "queue", "preprocess", "prefix", "denoise", "postprocess", "encode")
    assert all(envelope["timings"][f"{s}_ms"] >= 0 for s in stages)
    assert envelope["timings"]["total_ms"] >= envelope["timings"]["queue_ms"] + envelope["timings"]["device_ms"]


def test_http_json_prompt_seed_steps_and_missing_camera(http, golden_policy):
    obs = make_observation(11, cameras=("left_wrist_0_rgb",), size=(40, 40))
    body = request_body(obs, lists=True, parameters={"seed": 7, "num_inference_steps": 3})
    body["input"]["prompt"] = body["input"].pop("task")
    first, second = (http.post(GENERATIONS, json=body) for _ in range(2))
    assert first.status_code == second.status_code == 200
    assert first.json()["timings"]["total_ms"] > 0  # return_timing defaults to true (SGLang's default)
    # A seed fixes the noise: same answer twice, and the same as in-process with that seed.
    assert envelope_actions(first.json()).tolist() == envelope_actions(second.json()).tolist()
    assert_actions(envelope_actions(first.json()), golden_policy.infer(obs, seed=7, num_steps=3).actions)


def test_http_float_images_already_normalized(http, golden_policy):
    obs = make_observation(12, cameras=("base_0_rgb",), size=(30, 30))
    floats = {"base_0_rgb": obs["images"]["base_0_rgb"].astype(np.float32) / 127.5 - 1.0}
    noise = make_noise(12)
    body = request_body({**obs, "images": floats}, noise, lists=True)
    body["input"]["observation"]["images_normalized"] = True
    response = http.post(GENERATIONS, json=body)
    assert response.status_code == 200, response.text
    expected = golden_policy.infer({**obs, "images": floats, "images_normalized": True}, noise=noise).actions
    assert_actions(envelope_actions(response.json()), expected)


def test_http_msgpack_round_trip(http, golden_policy):
    obs = make_observation(13)
    noise = make_noise(13)
    expected = golden_policy.infer(obs, noise=noise).actions

    response = post_msgpack(http, request_body(obs, noise, runtime={"return_timing": True}))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == MSGPACK
    envelope = msgpack_numpy.unpackb(response.content)
    values = envelope["data"][0]["action"]["values"]
    assert isinstance(values, np.ndarray) and values.dtype == np.float32  # numpy is the msgpack default
    assert_actions(values, expected)
    assert "encode_ms" in envelope["timings"]

    # msgpack in without Accept: msgpack out (either header names the reply's format); the raw OpenPI-style response.
    response = post_msgpack(http, request_body(obs, noise, runtime={"response_format": "raw"}), accept="*/*")
    assert response.headers["content-type"] == MSGPACK
    raw = msgpack_numpy.unpackb(response.content)
    assert set(raw) == {"actions", "server_timing", "policy_timing"}
    assert_actions(raw["actions"], expected)

    response = post_msgpack(http, request_body(obs, noise, runtime={"output_format": "list", "response_format": "raw"}))
    raw = msgpack.unpackb(response.content)
    assert isinstance(raw["actions"], list)
    assert_actions(raw["actions"], expected)


def test_http_rtc_is_passed_through(http, golden_policy):
    obs = make_observation(14)
    noise = make_noise(14)
    previous = golden_policy.infer(obs, noise=make_noise(15)).model_actions[25:, :ACTION_DIM]
    rtc = {"prev_chunk": previous, "inference_delay": 3, "execution_horizon": 10, "max_guidance_weight": 10.0}
    response = post_msgpack(http, request_body(obs, noise, rtc=rtc))
    assert response.status_code == 200, response.text
    guided = msgpack_numpy.unpackb(response.content)["data"][0]["action"]["values"]
    assert_actions(guided, golden_policy.infer(obs, noise=noise, rtc=rtc).actions)
    # And the guidance did something, so the comparison above is not vacuous.
    assert np.abs(guided - golden_policy.infer(obs, noise=noise).actions).max() > 100 * ATOL


def test_metadata_route(http):
    meta = http.get("/v1/actions/metadata").json()
    assert meta["cameras"] == list(CAMERAS) and meta["state_dim"] == STATE_DIM
    assert (meta["action_horizon"], meta["action_dim"]) == (HORIZON, ACTION_DIM)
    assert meta["defaults"]["num_inference_steps"] == 10
    assert (meta["dtype"], meta["device"], meta["is_demo"]) == ("float32", "cpu", False)
    assert set(meta["protocols"]) == {"http", "realtime", "openpi"}
    assert meta["camera_aliases"]["observation.images.top"] == "base_0_rgb"  # merged from serve.json
    assert meta["limits"]["max_payload_bytes"] == 2**20


# ---- realtime websocket -------------------------------------------------------------------------
def test_realtime_websocket(server, golden_policy):
    obs = make_observation(20)
    noise = make_noise(20)
    expected = golden_policy.infer(obs, noise=noise).actions
    with ws_client.connect(f"{server.ws_url}/v1/actions/realtime", additional_headers=AUTH) as ws:
        metadata = msgpack_numpy.unpackb(ws.recv())
        assert metadata["object"] == "action.metadata" and metadata["input"]["image_keys"] == list(CAMERAS)

        ws.send(msgpack_numpy.packb(request_body(obs, noise, runtime={"return_timing": True})))
        envelope = msgpack_numpy.unpackb(ws.recv())
        assert_actions(envelope["data"][0]["action"]["values"], expected)
        assert envelope["timings"]["denoise_ms"] > 0

        # Bad requests get an error envelope and the connection stays usable.
        bad = request_body(obs, noise)
        del bad["input"]["observation"]["state"]
        ws.send(msgpack_numpy.packb(bad))
        assert msgpack.unpackb(ws.recv())["error"] == {
            "type": "invalid_request", "field": "input.observation.state", "message": "Field required"}
        ws.send(b"\xc1 not msgpack")
        assert msgpack.unpackb(ws.recv())["error"]["type"] == "invalid_msgpack"
        ws.send("a text frame")
        assert msgpack.unpackb(ws.recv())["error"]["type"] == "invalid_frame"

        ws.send(msgpack_numpy.packb(request_body(obs, noise)))
        assert_actions(msgpack_numpy.unpackb(ws.recv())["data"][0]["action"]["values"], expected)


# ---- concurrency and batching -------------------------------------------------------------------
def batch_histogram(http: httpx.Client) -> tuple[float, float]:
    """(batches of size 1, all batches) so far."""
    text = http.get("/metrics").text
    ones = total = 0.0
    for line in text.splitlines():
        if line.startswith('vlaserve_batch_size_bucket{le="1.0"}'):
            ones = float(line.split()[-1])
        elif line.startswith("vlaserve_batch_size_count"):
            total = float(line.split()[-1])
    return ones, total


@pytest.mark.slow  # 16 concurrent clients; tests/test_server_batcher.py checks batching in process
def test_concurrent_clients_get_their_own_answers(server, http, golden_policy):
    n = 16
    observations = [make_observation(100 + i) for i in range(n)]
    noises = [make_noise(100 + i) for i in range(n)]
    steps = [10 if i % 2 else 4 for i in range(n)]  # two step counts: only equal ones share a batch
    expected = [golden_policy.infer(o, noise=z, num_steps=s).actions for o, z, s in zip(observations, noises, steps)]
    ones_before, total_before = batch_histogram(http)

    start = threading.Barrier(n)
    answers: list = [None] * n

    def client(i: int) -> None:
        body = request_body(observations[i], noises[i], parameters={"num_inference_steps": steps[i]})
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=None) as own:
            start.wait()
            answers[i] = post_msgpack(own, body)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    for i, response in enumerate(answers):
        assert response.status_code == 200, response.text
        assert_actions(msgpack_numpy.unpackb(response.content)["data"][0]["action"]["values"], expected[i])
    ones_after, total_after = batch_histogram(http)
    batches, singles = total_after - total_before, ones_after - ones_before
    assert batches < n and singles < batches, "16 simultaneous requests should have been batched"


# ---- bad input ----------------------------------------------------------------------------------
def _good_body(**sections) -> dict:
    obs = make_observation(30, cameras=("base_0_rgb",), size=(24, 24))
    return request_body(obs, lists=True, **sections)


def _with(path: str, value) -> dict:
    body = _good_body()
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return body


_DELETE = object()
_IMAGE = np.zeros((24, 24, 3), np.uint8)


def _raw_json(text: str):
    return {"content": text.encode(), "headers": {"Content-Type": "application/json"}}


def _msgpack(obj):
    return {"content": msgpack.packb(obj), "headers": {"Content-Type": MSGPACK}}


def _ndarray(dtype: str, data: bytes, shape: list) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


BAD_REQUESTS = {
    "malformed json": (_raw_json('{"input": '), 400, "invalid_json", None),
    "malformed msgpack": ({"content": b"\xc1\xc1", "headers": {"Content-Type": MSGPACK}}, 400, "invalid_msgpack", None),
    "object dtype is never unpickled": (
        _msgpack({"input": {"task": "x", "observation": {"images": {}, "state": _ndarray("|O", b"\x80\x04N.", [1])}}}),
        400, "invalid_msgpack", None),
    "array bytes do not match shape": (
        _msgpack({"input": {"task": "x", "observation": {"images": {}, "state": _ndarray("<f4", b"\0" * 12, [14])}}}),
        400, "invalid_msgpack", None),
    "unsupported content type": ({"content": b"x", "headers": {"Content-Type": "text/plain"}}, 415,
                                 "unsupported_media_type", None),
    "body not an object": ({"json": [1, 2]}, 422, "invalid_request", None),
    "missing state": ({"json": _with("input.observation.state", _DELETE)}, 422, "invalid_request",
                      "input.observation.state"),
    "missing task": ({"json": _with("input.task", _DELETE)}, 422, "invalid_request", "input.task"),
    "extra field": ({"json": _with("input.observation.depth", [1])}, 422, "invalid_request", "input.observation.depth"),
    "extra top-level field": ({"json": _with("temperature", 1.0)}, 422, "invalid_request", "temperature"),
    "wrong model": ({"json": _with("model", "pi0-other")}, 422, "invalid_request", "model"),
    "state of strings": ({"json": _with("input.observation.state", ["a"] * 14)}, 422, "invalid_request",
                         "input.observation.state"),
    "wrong state dim": ({"json": _with("input.observation.state", [0.0] * 13)}, 422, "invalid_observation",
                        "input.observation.state"),
    "NaN in state": (_raw_json(json.dumps(_with("input.observation.state", [float("nan")] * 14))), 422,
                     "invalid_request", "input.observation.state"),
    "inf in noise": (_raw_json(json.dumps(_with("input.observation.noise", [[0.0] * 31 + [float("inf")]] * 50))), 422,
                     "invalid_request", "input.observation.noise"),
    "bad noise shape": ({"json": _with("input.observation.noise", [[0.0] * 14] * 50)}, 422, "invalid_request",
                        "input.observation.noise"),
    "image of rank 2": ({"json": _with("input.observation.images", {"base_0_rgb": [[0, 1], [2, 3]]})}, 422,
                        "invalid_observation", "input.observation.images.base_0_rgb"),
    "image with 4 channels": ({"json": _with("input.observation.images", {"base_0_rgb": [[[0] * 4] * 5] * 5})},
                              422, "invalid_observation", "input.observation.images.base_0_rgb"),
    "pixel out of uint8 range": ({"json": _with("input.observation.images", {"base_0_rgb": [[[0, 0, 300]] * 5] * 5})},
                                 422, "invalid_request", "input.observation.images.base_0_rgb"),
    "float pixels out of range": (
        {"json": _with("input.observation.images", {"base_0_rgb": [[[0.5, 0.5, 2.0]] * 5] * 5})},
        422, "invalid_observation", "input.observation.images.base_0_rgb"),
    "ragged image": ({"json": _with("input.observation.images", {"base_0_rgb": [[[0, 0, 0]], [[0, 0]]]})}, 422,
                     "invalid_request", "input.observation.images.base_0_rgb"),
    "unknown camera": ({"json": _with("input.observation.images", {"front": _IMAGE.tolist()})}, 422,
                       "invalid_observation", "input.observation.images.front"),
    "no image at all": ({"json": _with("input.observation.images", {})}, 422, "invalid_observation",
                        "input.observation.images"),
    "zero steps": ({"json": _with("parameters", {"num_inference_steps": 0})}, 422, "invalid_request",
                   "parameters.num_inference_steps"),
    "string steps": ({"json": _with("parameters", {"num_inference_steps": "10"})}, 422, "invalid_request",
                     "parameters.num_inference_steps"),
    "negative seed": ({"json": _with("parameters", {"seed": -1})}, 422, "invalid_request", "parameters.seed"),
    "bad rtc chunk": ({"json": _with("rtc", {"prev_chunk": [[0.0] * 40] * 5})}, 422, "invalid_request",
                      "rtc.prev_chunk"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_rejected_and_the_server_keeps_serving(http, case):
    kwargs, status, kind, field = BAD_REQUESTS[case]
    response = http.post(GENERATIONS, **kwargs)
    assert response.status_code == status, response.text
    assert response.json() == {"error": {"type": kind, "field": field, "message": response.json()["error"]["message"]}}
    assert response.json()["error"]["message"]

    good = http.post(GENERATIONS, json=_good_body(parameters={"num_inference_steps": 1}))
    assert good.status_code == 200, good.text


def test_missing_or_wrong_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(server.url + GENERATIONS, json=_good_body(), headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "unauthorized"
        assert httpx.get(server.url + "/v1/actions/metadata", headers=headers).status_code == 401
    assert httpx.get(server.url + "/v1/actions/metadata", headers={"X-API-Key": API_KEY}).status_code == 200
    for path in ("/v1/actions/realtime", "/openpi/policy", "/"):
        with pytest.raises(InvalidStatus) as refused:
            ws_client.connect(server.ws_url + path)
        assert refused.value.response.status_code == 401


def test_payload_limit_from_content_length_before_reading_the_body(server):
    head = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head.encode())  # and no body: the answer must come from the header alone
        s.settimeout(30)  # a server that waited for the 5 MB would hang here
        assert s.recv(4096).startswith(b"HTTP/1.1 413 ")


@pytest.mark.parametrize("times_the_limit", [1.5, 4])
def test_a_client_that_uploads_before_reading_gets_its_413_up_to_4x_the_limit(server, times_the_limit):
    """urllib sends no `Expect: 100-continue` and asks `Connection: close`: it writes the whole body, then
    reads. The server reads (and discards) bodies up to 4x the limit (1 MiB here) before answering, so
    closing after the 413 never resets the upload; beyond that a reset is documented (docs/server.md)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + GENERATIONS, data=b" " * int(times_the_limit * 2**20),
                                     headers={**AUTH, "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as answered:
        urllib.request.urlopen(request, timeout=60)
    assert answered.value.code == 413
    assert json.loads(answered.value.read())["error"]["type"] == "payload_too_large"


def test_payload_limit_while_streaming(http):
    def chunks():  # chunked transfer: no Content-Length to check up front
        for _ in range(12):
            yield b" " * 100_000

    response = http.post(GENERATIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "payload_too_large"
    assert http.post(GENERATIONS, json=_good_body(parameters={"num_inference_steps": 1})).status_code == 200


def test_payload_limit_on_websocket_messages(server):
    with ws_client.connect(f"{server.ws_url}/v1/actions/realtime", additional_headers=AUTH) as ws:
        ws.recv()  # metadata
        # The server may close while the client is still writing the frame (it reads the header, sees the
        # length, and answers 1009 without the rest), so the close can surface in send or in recv.
        with pytest.raises(ConnectionClosedError) as closed:
            ws.send(b"\0" * (2**20 + 1))
            ws.recv()
        assert closed.value.rcvd.code == 1009 and ws.close_code == 1009  # message too big


# ---- health, metrics, docs ----------------------------------------------------------------------
def test_health_metrics_and_docs(server, http):
    # The eager model on a CPU: no CUDA graphs, none to capture.
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok", "model": "checkpoint", "is_demo": False,
                                                         "graphs": {"captured": 0, "total": 0}, "weight_version": 0}
    http.post(GENERATIONS, json=_good_body(parameters={"num_inference_steps": 1}))
    metrics = httpx.get(server.url + "/metrics").text
    # Set by the first answer (this module's tests sent some before): seconds since the process began.
    first_action = float(re.search(r"^vlaserve_first_action_seconds (\S+)$", metrics, re.MULTILINE).group(1))
    assert first_action > 0
    assert 'vlaserve_requests_total{route="/v1/actions/generations",status="200"}' in metrics
    for stage in ("decode", "queue", "preprocess", "prefix", "denoise", "postprocess", "encode"):
        assert f'vlaserve_stage_seconds_count{{stage="{stage}"}}' in metrics
    assert "vlaserve_batch_size_bucket" in metrics and "vlaserve_request_seconds_bucket" in metrics
    assert httpx.get(server.url + "/docs").status_code == 200
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "GenerationRequest" in spec["components"]["schemas"]
    assert MSGPACK in spec["paths"][GENERATIONS]["post"]["requestBody"]["content"]


# ---- shutdown -----------------------------------------------------------------------------------
@pytest.mark.slow  # a server of its own and a 100-step request
def test_sigterm_finishes_the_in_flight_request_then_exits_0(golden, tmp_path, golden_policy):
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32"], tmp_path / "log")
    try:
        proc.wait_ready()
        obs, noise = make_observation(40), make_noise(40)
        # 100 steps: long enough (about a second here) to still be running when the signal lands.
        body = request_body(obs, noise, parameters={"num_inference_steps": 100})
        result = {}
        request = threading.Thread(target=lambda: result.update(response=httpx.post(
            proc.url + GENERATIONS, content=msgpack_numpy.packb(body), timeout=None,
            headers={"Content-Type": MSGPACK, "Accept": MSGPACK})))
        request.start()
        while "vlaserve_inferences_in_flight 1.0" not in httpx.get(proc.url + "/metrics").text:
            assert request.is_alive(), "the request finished before the signal could be sent"
            time.sleep(0.01)
        proc.proc.send_signal(signal.SIGTERM)
        request.join()
        assert proc.proc.wait() == 0, proc.log()
    finally:
        proc.stop()
    response = result["response"]
    assert response.status_code == 200
    actions = msgpack_numpy.unpackb(response.content)["data"][0]["action"]["values"]
    assert_actions(actions, golden_policy.infer(obs, noise=noise, num_steps=100).actions)
    assert "Application shutdown complete" in proc.log() and "Traceback" not in proc.log()
