"""Reproducible runs (docs/server.md#reproducible-runs): per-item seeds, the noise out and back in, the
denoising trace. Through the Python API, the runners (the eager one, and the fast path's runner with
stock kernels on the CPU; its fused Euler step in Triton's interpreter), the /v1 route (JSON and
msgpack), and vlaserve_client against a live server; the golden checkpoint in float32 on the CPU.
(Traced requests batched apart from graphed ones: test_server_batcher.py.)

Noise is compared bit for bit everywhere: a seeded item's noise is drawn on the host from its own seed,
whatever batch it runs in. Actions are bit-equal where the same batch runs the same arithmetic (a noise
round trip, a traced run against an untraced one); across batch compositions they move by float
reassociation (batching changes the GEMM shapes), compared at test_server's ATOL (1e-4, justified there).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from fixtures import tiny_interpreted_model
from test_fast_path import _HostEvent
from test_server import free_port
from vlaserve.errors import InvalidRequest
from vlaserve.server import ServerSettings, create_app
from vlaserve_client import AsyncClient, Client
from vlaserve_client.codec import packb, unpackb

ATOL = 1e-4
GENERATIONS = "/v1/actions/generations"
STEPS = 2  # few Euler steps keep each call short; the trace has STEPS + 1 rows


def observation(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": {"base_0_rgb": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)},
            "state": rng.normal(size=14).astype(np.float32), "task": f"pick up block {seed}"}


def seeded_noise(seed: int, policy) -> np.ndarray:
    """The generator docs/server.md documents, written out as a user would reproduce it."""
    horizon, width = policy.config.action_horizon, policy.config.model.max_action_dim
    return torch.randn(horizon, width, generator=torch.Generator().manual_seed(seed)).numpy()


# ---- the Python API ---------------------------------------------------------------------------------
def test_a_seeded_items_noise_is_a_function_of_its_seed_alone(golden_policy):
    """Seed s alone, as item 0 of a batch of 2 and as item 5 of a batch of 8 with other seeds: the same noise
    bits (the documented generator's), and the same actions up to batching's reassociation."""
    s, target = 1234, observation(1)
    alone = golden_policy.infer(target, seed=s, num_steps=STEPS, return_noise=True)
    first = golden_policy.infer_batch([target, observation(2)], seeds=[s, 7], num_steps=STEPS, return_noise=True)
    seeds = [11, 12, 13, 14, 15, s, 16, 17]
    batch = [observation(20 + i) for i in range(8)]
    batch[5] = target
    fifth = golden_policy.infer_batch(batch, seeds=seeds, num_steps=STEPS, return_noise=True)
    expected = seeded_noise(s, golden_policy)
    assert alone.noise.dtype == np.float32 and alone.noise.shape == expected.shape
    for result in (alone, first[0], fifth[5]):
        assert np.array_equal(result.noise, expected)
        np.testing.assert_allclose(result.actions, alone.actions, rtol=0, atol=ATOL)
    for result, seed in zip(fifth, seeds):  # every item its own seed's noise
        assert np.array_equal(result.noise, seeded_noise(seed, golden_policy))
    assert not np.array_equal(fifth[0].noise, fifth[1].noise)


def test_noise_round_trip_and_trace(golden_policy):
    """The noise sent back gives the same actions bit for bit; the trace starts at the noise and ends at the
    model-space actions; asking for the trace changes no bit of the actions."""
    obs = observation(3)
    traced = golden_policy.infer(obs, seed=5, num_steps=STEPS, return_noise=True, return_trace=True)
    plain = golden_policy.infer(obs, seed=5, num_steps=STEPS)
    assert plain.noise is None and plain.trace is None  # nothing unless asked
    assert np.array_equal(traced.actions, plain.actions) and np.array_equal(traced.model_actions, plain.model_actions)
    h, a = traced.model_actions.shape
    assert traced.trace.shape == (STEPS + 1, h, a) and traced.trace.dtype == np.float32
    assert np.array_equal(traced.trace[0], traced.noise)
    assert np.array_equal(traced.trace[-1], traced.model_actions)
    assert not np.array_equal(traced.trace[1], traced.trace[0])  # x moves at every step
    again = golden_policy.infer(obs, noise=traced.noise, num_steps=STEPS, return_noise=True)
    assert np.array_equal(again.actions, traced.actions) and np.array_equal(again.noise, traced.noise)


def test_python_api_refuses_a_seed_list_of_the_wrong_length_and_non_bool_flags(golden_policy):
    with pytest.raises(InvalidRequest) as error:
        golden_policy.infer_batch([observation(1), observation(2)], seeds=[1])
    assert error.value.field == "seed"
    with pytest.raises(InvalidRequest) as error:
        golden_policy.request(observation(1), return_trace="yes")
    assert error.value.field == "return_trace"


def test_the_fast_runner_traces_its_euler_loop_without_changing_the_actions(golden_policy, monkeypatch):
    """FastRunner (stock kernels, no graphs: the CPU) with a trace tensor, RTC on one item: the same actions bit
    for bit as without, the trace's first row the noise and its last the actions, its middle rows the eager
    model's x at each step (the same function, other summation orders: test_fast_path's 1e-5)."""
    from vlaserve.runtime.graphs import FastRunner

    policy = golden_policy
    rtc = {"prev_chunk": np.full((10, 32), 0.5, np.float32), "inference_delay": 2}
    requests = [policy.request(observation(4), seed=4), policy.request(observation(5), seed=5, rtc=rtc)]
    inputs, noise, guidance = policy.preprocessor.collate(requests)
    runner = FastRunner(policy.model, policy.config, use_graphs=False, use_triton=False)
    monkeypatch.setattr(runner, "_events", lambda: (_HostEvent(), _HostEvent(), _HostEvent()))
    trace = torch.full((2, STEPS + 1, *noise.shape[1:]), float("nan"))
    with torch.no_grad():
        plain = runner.dispatch(inputs, noise, STEPS, guidance)[0].clone()
        traced = runner.dispatch(inputs, noise, STEPS, guidance, trace=trace)[0]
    assert torch.equal(traced, plain)
    assert torch.equal(trace[:, 0], noise) and torch.equal(trace[:, -1], traced)
    eager = policy.runtime.enqueue(inputs, noise, STEPS, guidance, trace=True)
    eager.wait()
    assert (trace - torch.from_numpy(eager.trace)).abs().max() < 1e-5


# ---- the /v1 route ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        yield client


def batch_body(seeds, indices=(1, 2), **runtime) -> dict:
    observations = [observation(i) for i in indices]
    return {"input": {"task": [o["task"] for o in observations],
                      "observation": {"images": {"base_0_rgb": np.stack([o["images"]["base_0_rgb"] for o in observations])},
                                      "state": np.stack([o["state"] for o in observations])}},
            "parameters": {"num_inference_steps": STEPS, "seed": seeds}, "runtime": runtime}


def post(http, body: dict) -> httpx.Response:
    return http.post(GENERATIONS, content=packb(body), headers={"Content-Type": "application/msgpack"})


def test_http_seed_list_noise_and_trace_in_the_envelope(http, golden_policy):
    reply = post(http, batch_body([41, 40], return_noise=True, return_trace=True))
    assert reply.status_code == 200, reply.text
    data = unpackb(reply.content)["data"]
    for item, seed, index in zip(data, (41, 40), (1, 2)):
        noise, trace = item["output"]["noise"], item["output"]["trace"]
        assert noise["dtype"] == trace["dtype"] == "float32"
        assert noise["shape"] == [50, 32] and trace["shape"] == [STEPS + 1, 50, 32]
        assert np.array_equal(noise["values"], seeded_noise(seed, golden_policy))
        assert np.array_equal(trace["values"][0], noise["values"])
        alone = golden_policy.infer(observation(index), seed=seed, num_steps=STEPS, return_trace=True)
        np.testing.assert_allclose(trace["values"], alone.trace, rtol=0, atol=ATOL)
        np.testing.assert_allclose(item["action"]["values"], alone.actions, rtol=0, atol=ATOL)
    plain = unpackb(post(http, batch_body([41, 40])).content)["data"]
    assert all("output" not in item for item in plain)  # nothing unless asked
    assert all(np.array_equal(p["action"]["values"], d["action"]["values"]) for p, d in zip(plain, data))


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_http_noise_round_trip_is_exact(http, encoding):
    """output.noise, sent back unchanged as input.observation.noise, gives the same actions bit for bit: in
    JSON too (a float32 written as the shortest double that holds it parses back to the same float32)."""
    obs = observation(6)
    body = {"input": {"task": obs["task"], "observation": {"images": obs["images"], "state": obs["state"]}},
            "parameters": {"num_inference_steps": STEPS, "seed": 77}, "runtime": {"return_noise": True}}

    def send(body) -> dict:
        if encoding == "json":
            return http.post(GENERATIONS, content=json.dumps(body, default=lambda a: a.tolist()),
                             headers={"Content-Type": "application/json"}).json()["data"][0]
        return unpackb(post(http, body).content)["data"][0]

    first = send(body)
    body["input"]["observation"]["noise"] = first["output"]["noise"]
    del body["parameters"]["seed"]
    again = send(body)
    for key in ("action", "output"):
        a, b = (item[key] if key == "action" else item[key]["noise"] for item in (again, first))
        assert np.array_equal(np.asarray(a["values"], np.float32), np.asarray(b["values"], np.float32))


def test_http_raw_reply_carries_noise_and_trace(http, golden_policy):
    raw = unpackb(post(http, batch_body([3, 4], response_format="raw", return_noise=True,
                                        return_trace=True)).content)
    assert raw["actions"].shape == (2, 50, 14) and raw["noise"].shape == (2, 50, 32)
    assert raw["trace"].shape == (2, STEPS + 1, 50, 32)
    assert np.array_equal(raw["noise"][1], seeded_noise(4, golden_policy))
    assert np.array_equal(raw["trace"][:, 0], raw["noise"])


def test_an_int_seed_on_a_batch_seeds_item_i_with_seed_plus_i(http, golden_policy):
    data = unpackb(post(http, batch_body(9, return_noise=True)).content)["data"]
    for i, item in enumerate(data):
        assert np.array_equal(item["output"]["noise"]["values"], seeded_noise(9 + i, golden_policy))


@pytest.mark.parametrize("seeds, indices", [([1, 2, 3], (1, 2)), ([1], (1, 2)), ([], (1, 2))])
def test_a_seed_list_not_one_per_observation_is_422(http, seeds, indices):
    reply = post(http, batch_body(seeds, indices))
    assert reply.status_code == 422
    error = reply.json()["error"]  # a request refused whole is answered in JSON
    assert error["field"] == "parameters.seed" and f"{len(seeds)} given" in error["message"]


def test_bad_seed_lists_name_parameters_seed(http):
    obs = observation(1)
    lone = {"input": {"task": obs["task"], "observation": {"images": obs["images"], "state": obs["state"]}},
            "runtime": {"return_noise": True}}
    refused = post(http, {**lone, "parameters": {"seed": [1, 2]}})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "parameters.seed"
    listed, plain = (unpackb(post(http, {**lone, "parameters": {"seed": seed, "num_inference_steps": 1}}).content)
                     ["data"][0]["output"]["noise"]["values"] for seed in ([8], 8))
    assert np.array_equal(listed, plain)  # a lone observation may send a list of one
    words = post(http, batch_body(["a", "b"]))
    assert words.status_code == 422 and words.json()["error"]["field"] == "parameters.seed"
    negative = unpackb(post(http, batch_body([5, -1])).content)  # one bad value fails its own item
    assert "action" in negative["data"][0] and negative["data"][1]["error"]["field"] == "parameters.seed"


def test_metadata_names_the_options(http):
    meta = http.get("/v1/actions/metadata").json()
    assert meta["defaults"]["return_noise"] is False and meta["defaults"]["return_trace"] is False
    assert {k: meta["capabilities"][k] for k in ("per_item_seeds", "return_noise", "return_trace")} == {
        "per_item_seeds": True, "return_noise": True, "return_trace": True}


# ---- vlaserve_client against a live server ------------------------------------------------------------
@pytest.fixture(scope="module")
def live_url(golden_policy):
    """The app on a real socket (uvicorn in a thread, the policy already loaded)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(golden_policy, ServerSettings()), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            pytest.fail("the test server stopped before it started")
        threading.Event().wait(0.05)
    yield f"ws://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join()


def test_client_seeds_noise_and_trace(live_url, golden_policy):
    obs = observation(7)
    with Client(live_url, timeout=120) as client:
        reply = client.infer(obs, seed=21, num_inference_steps=STEPS, return_noise=True, return_trace=True)
        assert np.array_equal(reply.noise, seeded_noise(21, golden_policy))
        assert reply.trace.shape == (STEPS + 1, 50, 32) and np.array_equal(reply.trace[0], reply.noise)
        again = client.infer(dict(obs, noise=reply.noise), num_inference_steps=STEPS)
        assert np.array_equal(again.actions, reply.actions) and again.noise is None and again.trace is None

        replies = client.infer_batch([observation(8), obs], seeds=[5, 21], num_inference_steps=STEPS,
                                     return_noise=True)
        assert np.array_equal(replies[0].noise, seeded_noise(5, golden_policy))
        assert np.array_equal(replies[1].noise, reply.noise) and replies[1].trace is None
        np.testing.assert_allclose(replies[1].actions, reply.actions, rtol=0, atol=ATOL)
        with pytest.raises(ValueError, match="one seed per observation"):
            client.infer_batch([obs, obs], seeds=[1])

    async def awaited():
        async with AsyncClient(live_url, timeout=120) as aclient:
            return await aclient.infer(obs, seed=21, num_inference_steps=STEPS, return_noise=True)

    assert np.array_equal(asyncio.run(awaited()).noise, reply.noise)


# ---- the fast path's fused Euler step, in Triton's interpreter -----------------------------------------
FUSED_TRACE_SCRIPT = tiny_interpreted_model(depth=1, cameras=1, steps=3) + r'''
from vlaserve.model.rtc import RTCGuidance
from vlaserve.runtime.fast.model import StaticRTC

noise = torch.randn(b, horizon, 32)
fast = FastPi05(random_model(cfg, torch.float16, "cpu", seed=1, std=0.05), use_triton=True)
assert fast._fused_action_io  # the Euler loop of kernels.action_step, x in two alternating buffers
sched = fast.schedule(steps)
rtc = StaticRTC.allocate(b, horizon, 32, steps, "cpu")
rtc.fill(RTCGuidance(torch.randn(b, horizon, 32), torch.rand(b, horizon), torch.full((b,), 5.0)), sched.times)
k = torch.zeros(1, b, 64, 128, dtype=torch.float16)
v = torch.zeros_like(k)
report = {}
with torch.no_grad():
    pad = fast.prefix(images, torch.ones(b, cams, dtype=torch.bool), torch.randint(1, 64, (b, tokens)),
                      torch.ones(b, tokens, dtype=torch.bool), k, v, cams)
    for name, guidance in (("plain", None), ("rtc", rtc)):
        plain = fast.denoise(pad, noise, sched, k, v, guidance).clone()
        trace = torch.full((b, steps + 1, horizon, 32), float("nan"))
        traced = fast.denoise(pad, noise, sched, k, v, guidance, trace)
        report[name] = {"actions_equal": torch.equal(traced, plain), "first_is_noise": torch.equal(trace[:, 0], noise),
                        "last_is_actions": torch.equal(trace[:, -1], traced),
                        "rows_distinct": all(not torch.equal(trace[:, i], trace[:, i + 1]) for i in range(steps))}
print(json.dumps(report))
'''


@pytest.mark.slow  # the interpreter runs every kernel program in Python
def test_the_fused_euler_step_writes_the_trace_in_tritons_interpreter():
    """Pi0.5's fused action step (kernels.action_step: x alternates between two buffers) on a tiny model:
    the trace's rows are copied out before the next step overwrites them, and the actions keep every bit."""
    pytest.importorskip("triton")
    from test_triton_kernels import interpreted_report

    report = interpreted_report(FUSED_TRACE_SCRIPT, timeout=1800)
    for name, checks in report.items():
        assert all(checks.values()), (name, checks)
