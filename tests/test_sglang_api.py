"""SGLang's Pi0.5 action API, verbatim (issue 42): each request form of SGLang's cookbook, benchmark
(bench_pi05_openpi.py) and protocol code, sent to a real server process on the golden checkpoint
(float32, CPU) and read back as SGLang's clients read it (data[i].action.values, timings, metadata's
input/output/defaults/capabilities). Every answer is compared with an in-process `Policy.infer` with
the same noise, at test_server's ATOL (1e-4, justified there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
import websockets.sync.client as ws_client
from openpi_client import msgpack_numpy
from vlaserve_client import BatchError, Client

from test_server import (ACTION_DIM, API_KEY, AUTH, CAMERAS, GENERATIONS, HORIZON, MODEL_DIM, MSGPACK, STATE_DIM,
                         ServerProcess, assert_actions, make_noise, make_observation)

BATCH_LIMIT = 3  # the server's --max-batch-size: batches of B > 3 are split, never refused

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def server(golden, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang")
    # No API key, so docs/server.md's examples run against it as written (auth: test_server.py).
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32",
                          "--prefix-cache", "8", "--max-batch-size", str(BATCH_LIMIT)], tmp / "server.log")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        yield client


def small_observation(seed: int) -> dict:
    return make_observation(seed, size=(32, 40))  # small images keep JSON bodies quick


def json_tensor(array: np.ndarray) -> dict:
    """How SGLang's benchmark sends every array in JSON."""
    return {"dtype": str(array.dtype), "shape": list(array.shape), "values": array.tolist()}


def sglang_payload(obs: dict, noise: np.ndarray, **runtime) -> dict:
    """bench_pi05_openpi.build_sglang_payload's form: tensor objects, parameters, runtime toggles."""
    return {"input": {"task": obs["task"], "observation": {
                "images": {cam: json_tensor(img) for cam, img in obs["images"].items()},
                "state": json_tensor(obs["state"]), "noise": json_tensor(noise)}},
            "parameters": {"num_inference_steps": 10},
            "runtime": {"return_timing": True, **runtime}}


def read_values(envelope: dict, index: int = 0) -> np.ndarray:
    """SGLang's client: data[i].action.values."""
    return np.asarray(envelope["data"][index]["action"]["values"], dtype=np.float32)


def expected(golden_policy, obs, noise) -> np.ndarray:
    return golden_policy.infer(obs, noise=noise).actions


def cache_stats(http) -> dict:
    return http.get("/v1/actions/metadata").json()["prefix_cache"]


# ---- metadata -----------------------------------------------------------------------------------------
def check_metadata(metadata: dict) -> None:
    assert metadata["object"] == "action.metadata"
    assert metadata["input"]["image_keys"] == list(CAMERAS) and metadata["input"]["state_dim"] == STATE_DIM
    out = metadata["output"]
    assert (out["action_horizon"], out["action_dim"], out["padded_action_dim"]) == (HORIZON, ACTION_DIM, MODEL_DIM)
    assert metadata["defaults"]["num_inference_steps"] == 10 and metadata["defaults"]["prefix_cache"] == "auto"
    assert metadata["defaults"]["cuda_graph"] is False  # the CPU has no graphs
    caps = metadata["capabilities"]
    assert caps["realtime_websocket"] and caps["openpi_websocket"] and caps["batch_inputs"]
    assert caps["max_batch_size"] == BATCH_LIMIT and caps["exact_prefix_cache"] is True
    assert metadata["cameras"] == list(CAMERAS)  # the flat fields OpenPI clients read stay beside


def test_metadata_on_all_three_routes(server, http):
    check_metadata(http.get("/v1/actions/metadata").json())
    for path in ("/v1/actions/realtime", "/openpi/policy"):
        with ws_client.connect(server.ws_url + path, additional_headers=AUTH) as ws:
            check_metadata(msgpack_numpy.unpackb(ws.recv()))


# ---- JSON ---------------------------------------------------------------------------------------------
def test_benchmark_json_payload_with_tensor_objects_and_toggles(http, golden_policy):
    obs, noise = small_observation(1), make_noise(1)
    reply = http.post(GENERATIONS, json=sglang_payload(obs, noise, prefix_cache=True, cuda_graph=True))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "action.generation" and {"prefix_ms", "denoise_ms", "total_ms"} <= set(body["timings"])
    assert body["data"][0]["action"]["shape"] == [HORIZON, ACTION_DIM]
    assert_actions(read_values(body), expected(golden_policy, obs, noise))


@pytest.mark.parametrize("toggle", [False, "auto"])
def test_cuda_graph_toggle_gives_the_same_actions(http, golden_policy, toggle):
    obs, noise = small_observation(2), make_noise(2)
    reply = http.post(GENERATIONS, json=sglang_payload(obs, noise, cuda_graph=toggle))
    assert reply.status_code == 200, reply.text
    assert_actions(read_values(reply.json()), expected(golden_policy, obs, noise))


def test_prefix_cache_false_skips_lookup_and_store(http, golden_policy):
    obs, noise = small_observation(3), make_noise(3)
    before = cache_stats(http)
    for _ in range(2):
        reply = http.post(GENERATIONS, json=sglang_payload(obs, noise, prefix_cache=False))
        assert_actions(read_values(reply.json()), expected(golden_policy, obs, noise))
    assert cache_stats(http) == before  # neither looked up (no miss, no hit) nor stored
    for _ in range(2):  # "auto": a miss that stores, then a hit with the same actions
        reply = http.post(GENERATIONS, json=sglang_payload(obs, noise, prefix_cache="auto"))
        assert_actions(read_values(reply.json()), expected(golden_policy, obs, noise))
    after = cache_stats(http)
    assert (after["misses"], after["hits"], after["entries"]) == (before["misses"] + 1, before["hits"] + 1,
                                                                  before["entries"] + 1)


def test_runtime_omitted_still_returns_timings(http):
    obs, noise = small_observation(4), make_noise(4)
    body = {"input": {"prompt": obs["task"], "observation": {
        "images": {c: i.tolist() for c, i in obs["images"].items()}, "state": obs["state"].tolist(),
        "noise": noise.tolist()}}}
    reply = http.post(GENERATIONS, json=body).json()
    assert reply["timings"]["total_ms"] > 0


def test_numpy_output_format_with_a_json_reply_answers_lists(http, golden_policy):
    obs, noise = small_observation(5), make_noise(5)
    reply = http.post(GENERATIONS, json=sglang_payload(obs, noise, output_format="numpy"))
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert_actions(read_values(reply.json()), expected(golden_policy, obs, noise))


def test_action_horizon_and_padded_action_dim(http, golden_policy):
    obs, noise = small_observation(6), make_noise(6)
    payload = sglang_payload(obs, noise)
    payload["parameters"].update(action_horizon=HORIZON, action_dim=MODEL_DIM)  # the defaults, spelled out
    assert_actions(read_values(http.post(GENERATIONS, json=payload).json()), expected(golden_policy, obs, noise))
    payload["parameters"]["action_horizon"] = 10
    body = http.post(GENERATIONS, json=payload).json()
    assert body["data"][0]["action"]["shape"] == [10, ACTION_DIM]
    assert_actions(read_values(body), expected(golden_policy, obs, noise)[:10])


@pytest.mark.parametrize("parameters, field, limit", [({"action_horizon": HORIZON + 1}, "parameters.action_horizon",
                                                        f"[1, {HORIZON}]"),
                                                       ({"action_horizon": 0}, "parameters.action_horizon", f"[1, {HORIZON}]"),
                                                       ({"action_dim": ACTION_DIM}, "parameters.action_dim", str(MODEL_DIM))])
def test_shape_parameters_past_the_checkpoint_are_422_naming_the_limit(http, parameters, field, limit):
    obs, noise = small_observation(7), make_noise(7)
    payload = sglang_payload(obs, noise)
    payload["parameters"].update(parameters)
    reply = http.post(GENERATIONS, json=payload)
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["field"] == field and limit in error["message"]


def test_malformed_tensor_object_is_422_naming_the_field(http):
    obs, noise = small_observation(8), make_noise(8)
    payload = sglang_payload(obs, noise)
    payload["input"]["observation"]["state"]["shape"] = [STATE_DIM + 1]
    error = http.post(GENERATIONS, json=payload).json()["error"]
    assert error["field"] == "input.observation.state" and f"{STATE_DIM + 1}" in error["message"]


# ---- msgpack ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{"Content-Type": MSGPACK},  # no Accept: still a msgpack reply
                                     {"Content-Type": "application/json", "Accept": MSGPACK}])
def test_msgpack_reply_when_either_header_names_it(http, golden_policy, headers):
    obs, noise = small_observation(9), make_noise(9)
    payload = {"input": {"task": obs["task"], "observation": {"images": obs["images"], "state": obs["state"],
                                                              "noise": noise}},
               "parameters": {"num_inference_steps": np.int64(10)}, "runtime": {"prefix_cache": "auto"}}
    if headers["Content-Type"] == MSGPACK:
        content = msgpack_numpy.packb(payload)
    else:
        content = json.dumps(sglang_payload(obs, noise)).encode()
    reply = http.post(GENERATIONS, content=content, headers=headers)
    assert reply.status_code == 200 and reply.headers["content-type"] == MSGPACK
    body = msgpack_numpy.unpackb(reply.content)  # SGLang's client: unpackb, then data[0].action.values
    assert "timings" in body
    assert_actions(read_values(body), expected(golden_policy, obs, noise))


# ---- realtime websocket -------------------------------------------------------------------------------
def test_realtime_frames_with_runtime_toggles(server, golden_policy):
    obs, noise = small_observation(10), make_noise(10)
    with ws_client.connect(server.ws_url + "/v1/actions/realtime", additional_headers=AUTH) as ws:
        check_metadata(msgpack_numpy.unpackb(ws.recv()))
        for runtime in ({"prefix_cache": False, "cuda_graph": False}, {"output_format": "list"}):
            ws.send(msgpack_numpy.packb({"input": {"task": obs["task"], "observation": {
                "images": obs["images"], "state": obs["state"], "noise": noise}}, "runtime": runtime}))
            body = msgpack_numpy.unpackb(ws.recv())
            assert body["object"] == "action.generation" and "timings" in body
            assert_actions(read_values(body), expected(golden_policy, obs, noise))


# ---- OpenPI websocket ---------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{"num_inference_steps": 10, "enable_pi_prefix_cache": False,
                                      "enable_pi_cuda_graph": True},
                                     {"enable_prefix_cache": "auto", "enable_cuda_graph": False}])
def test_openpi_socket_takes_sglangs_observation_keys(server, golden_policy, options):
    obs, noise = small_observation(11), make_noise(11)
    frame = {"task": obs["task"], "observation.state": obs["state"], "observation.noise": noise, **options}
    frame.update({f"observation.images.{cam}": img for cam, img in obs["images"].items()})
    with ws_client.connect(server.ws_url + "/openpi/policy", additional_headers=AUTH) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb(frame))
        reply = msgpack_numpy.unpackb(ws.recv())
    assert_actions(reply["actions"], expected(golden_policy, obs, noise))


def test_openpi_socket_steps_count(server, golden_policy):
    obs, noise = small_observation(12), make_noise(12)
    frame = {"prompt": obs["task"], "state": obs["state"], "noise": noise, "images": obs["images"],
             "num_inference_steps": 3}
    with ws_client.connect(server.ws_url + "/openpi/policy", additional_headers=AUTH) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb(frame))
        reply = msgpack_numpy.unpackb(ws.recv())
    assert_actions(reply["actions"], golden_policy.infer(obs, noise=noise, num_steps=3).actions)


# ---- batches (sgl-project/sglang#36301's form: a leading batch dimension on every array) -----------------
def batch_of(seeds) -> tuple[list[dict], np.ndarray, dict]:
    observations = [small_observation(s) for s in seeds]
    noise = np.stack([make_noise(s) for s in seeds])
    observation = {"images": {c: np.stack([o["images"][c] for o in observations]) for c in CAMERAS},
                   "state": np.stack([o["state"] for o in observations]), "noise": noise}
    return observations, noise, {"input": {"task": [o["task"] for o in observations], "observation": observation}}


def to_lists(value):
    if isinstance(value, dict):
        return {k: to_lists(v) for k, v in value.items()}
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_batch_over_the_server_limit_is_split_and_answered_in_order(http, golden_policy, encoding):
    seeds = range(20, 27)  # B = 7 > the limit of 3: three batches
    observations, noise, body = batch_of(seeds)
    if encoding == "json":
        reply = http.post(GENERATIONS, json=to_lists(body))
        envelope = reply.json()
    else:
        reply = http.post(GENERATIONS, content=msgpack_numpy.packb(body), headers={"Content-Type": MSGPACK})
        envelope = msgpack_numpy.unpackb(reply.content)
    assert reply.status_code == 200, reply.text
    assert len(envelope["data"]) == 7 and envelope["usage"]["batch_size"] == 7
    for i, obs in enumerate(observations):
        assert envelope["data"][i]["index"] == i
        assert_actions(read_values(envelope, i), expected(golden_policy, obs, noise[i]))


def test_a_batch_larger_than_the_prepare_backlog_is_answered_whole(http, golden_policy):
    """B = 70 > the 64 requests that may be decoded or prepared at once (503 overloaded past it): a
    batch takes a bounded share of that backlog, so it is never refused for its size."""
    size = 70
    rng = np.random.default_rng(70)
    images = rng.integers(0, 256, (size, 8, 8, 3), dtype=np.uint8)
    states = rng.normal(size=(size, STATE_DIM)).astype(np.float32)
    body = {"input": {"task": "stack", "observation": {"images": {"base_0_rgb": images}, "state": states}},
            "parameters": {"num_inference_steps": 1, "seed": 5}, "runtime": {"response_format": "raw"}}
    reply = http.post(GENERATIONS, content=msgpack_numpy.packb(body), headers={"Content-Type": MSGPACK})
    assert reply.status_code == 200, reply.text
    actions = msgpack_numpy.unpackb(reply.content)["actions"]
    assert actions.shape == (size, HORIZON, ACTION_DIM)
    for i in (0, 69):  # item i is seeded with seed + i
        obs = {"images": {"base_0_rgb": images[i]}, "state": states[i], "task": "stack"}
        assert_actions(actions[i], golden_policy.infer(obs, seed=5 + i, num_steps=1).actions)


def test_batch_raw_reply_is_b_h_d(http, golden_policy):
    observations, noise, body = batch_of(range(30, 34))
    body["runtime"] = {"response_format": "raw"}
    reply = msgpack_numpy.unpackb(http.post(GENERATIONS, content=msgpack_numpy.packb(body),
                                            headers={"Content-Type": MSGPACK}).content)
    assert reply["actions"].shape == (4, HORIZON, ACTION_DIM)
    for i, obs in enumerate(observations):
        assert_actions(reply["actions"][i], expected(golden_policy, obs, noise[i]))


def test_batch_item_errors_do_not_fail_the_others(http, golden_policy):
    observations, noise, body = batch_of(range(40, 43))
    body["input"]["observation"]["noise"][1, 0, 0] = np.nan  # item 1 alone is invalid
    body["input"]["task"] = observations[0]["task"]  # one task for all: broadcast
    envelope = msgpack_numpy.unpackb(http.post(GENERATIONS, content=msgpack_numpy.packb(body),
                                               headers={"Content-Type": MSGPACK}).content)
    assert envelope["data"][1]["error"]["field"] == "input.observation.noise" and "action" not in envelope["data"][1]
    for i in (0, 2):
        obs = dict(observations[i], task=observations[0]["task"])
        assert_actions(read_values(envelope, i), expected(golden_policy, obs, noise[i]))
    body["runtime"] = {"response_format": "raw", "output_format": "list"}
    raw = msgpack.unpackb(http.post(GENERATIONS, content=msgpack_numpy.packb(body),
                                    headers={"Content-Type": MSGPACK}).content)
    assert raw["actions"][1] is None and raw["errors"][1]["field"] == "input.observation.noise"
    assert raw["errors"][0] is None and len(raw["actions"][0]) == HORIZON


def test_batch_with_mismatched_sizes_is_422_naming_the_field(http):
    _, _, body = batch_of(range(50, 53))
    body["input"]["observation"]["state"] = body["input"]["observation"]["state"][:2]
    error = http.post(GENERATIONS, content=msgpack_numpy.packb(body), headers={"Content-Type": MSGPACK}).json()["error"]
    assert error["field"] == "input.observation.state" and "2 observations" in error["message"]


def test_client_infer_batch(server, golden_policy):
    observations = [small_observation(s) for s in range(60, 65)]
    noises = [make_noise(s) for s in range(60, 65)]
    with Client(server.ws_url, api_key=API_KEY) as client:
        replies = client.infer_batch([dict(o, noise=n) for o, n in zip(observations, noises)])
        assert client.metadata()["output"]["action_horizon"] == HORIZON
        for reply, obs, noise in zip(replies, observations, noises):
            assert_actions(reply.actions, expected(golden_policy, obs, noise))
        bad = [dict(o, noise=n) for o, n in zip(observations[:2], noises[:2])]
        bad[0]["state"] = bad[0]["state"][:3]
        bad[1]["state"] = bad[1]["state"][:3]
        bad.append(dict(observations[2], noise=noises[2], state=observations[2]["state"]))
        with pytest.raises(ValueError):  # states of different lengths cannot be stacked
            client.infer_batch(bad)
        bad = [dict(o, noise=n) for o, n in zip(observations[:3], noises[:3])]
        bad[1]["noise"] = np.full_like(noises[1], np.inf)
        with pytest.raises(BatchError) as failed:
            client.infer_batch(bad)
        assert failed.value.replies[1] is None and failed.value.errors[1].field == "input.observation.noise"
        assert_actions(failed.value.replies[0].actions, expected(golden_policy, observations[0], noises[0]))


# ---- docs/server.md's examples of these forms -----------------------------------------------------------
def doc_examples(*sections: str) -> list[str]:
    text = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    blocks = []
    for title in sections:
        body = text.split(title + "\n", 1)[1]
        body = body[:re.search(r"^#{2,3} ", body, re.M).start()]
        blocks += re.findall(r"```python\n(.*?)```", body, re.S)
    return blocks


def test_docs_examples_run(server):
    examples = doc_examples("## Coming from SGLang", "### Batches")
    assert len(examples) == 2
    for code in examples:
        scope = {}
        exec(code.replace("http://127.0.0.1:8000", server.url), scope)  # noqa: S102 - our own docs
        assert scope["actions"].shape in ((HORIZON, ACTION_DIM), (8, HORIZON, ACTION_DIM))
