"""Weight updates in place (Policy.update_weights, POST /update_weights_from_disk) on the golden Pi0.5 checkpoint,
CPU float32: a swap gives exactly what a policy loaded from the new checkpoint gives, a swap back the original's;
every refused swap changes nothing; a batch runs wholly on one version; the route's auth, body and errors."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from vlaserve import Policy
from vlaserve.errors import WeightUpdateRefused
from vlaserve.server import create_app
from vlaserve.server.settings import ServerSettings

WEIGHTS = "model.safetensors"


def load(checkpoint: Path, **options) -> Policy:
    return Policy.from_pretrained(checkpoint, device="cpu", dtype="float32", progress=False, **options)


def rewrite(path: Path, change) -> None:
    """Rewrites a safetensors file with `change(tensors)` applied (a dict it may edit in place)."""
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def perturbed_copy(checkpoint: Path, out: Path, seed: int = 1) -> Path:
    """A copy of `checkpoint` whose every weight moved by a little noise and whose normalization statistics are
    scaled by 1.25 (both swap: the actions differ by both)."""
    shutil.copytree(checkpoint, out)
    generator = torch.Generator().manual_seed(seed)

    def nudge(tensors):
        for key, t in tensors.items():
            tensors[key] = t + 0.02 * torch.randn(t.shape, generator=generator, dtype=t.dtype)

    def scale(tensors):
        for key, t in tensors.items():
            tensors[key] = t * 1.25

    rewrite(out / WEIGHTS, nudge)
    for stats in out.glob("policy_*_normalizer_processor.safetensors"):
        rewrite(stats, scale)
    for stats in out.glob("policy_*_unnormalizer_processor.safetensors"):
        rewrite(stats, scale)
    return out


def observation(policy: Policy, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": {cam: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for cam in policy.config.cameras},
            "state": rng.uniform(-1, 1, policy.config.state_dim).astype(np.float32), "task": "pick up the red block",
            "noise": rng.standard_normal((policy.config.action_horizon, policy.config.model.max_action_dim))
            .astype(np.float32)}


def actions(policy: Policy, seeds=(0, 1)) -> list[np.ndarray]:
    return [policy.infer(observation(policy, s)).actions for s in seeds]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def checkpoints(golden, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weight_updates")
    return {"original": golden / "checkpoint", "perturbed": perturbed_copy(golden / "checkpoint", root / "perturbed")}


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[np.ndarray]]:
    """Each checkpoint's actions from a policy loaded from it: what a swap to it must give."""
    out = {name: actions(load(path)) for name, path in checkpoints.items()}
    assert not np.array_equal(out["original"][0], out["perturbed"][0])  # the swap is visible
    return out


@pytest.fixture(scope="module")
def served(checkpoints) -> Policy:
    """One policy the tests swap back and forth (each test leaves it on the original weights)."""
    return load(checkpoints["original"], prefix_cache=4)


def test_a_swap_gives_a_fresh_policys_actions_and_a_swap_back_the_originals(served, checkpoints, expected):
    version = served.weight_version
    assert_same(actions(served), expected["original"])
    parameters = {name: p.data_ptr() for name, p in served.model.named_parameters()}
    reply = served.update_weights(str(checkpoints["perturbed"]))
    assert reply["weight_version"] == served.weight_version == version + 1
    assert reply["checkpoint"] == str(checkpoints["perturbed"]) and reply["load_ms"] >= reply["swap_ms"] >= 0
    assert_same(actions(served), expected["perturbed"])  # the prefix cache held the original's K/V: emptied
    assert served.metadata["weight_version"] == version + 1
    assert {name: p.data_ptr() for name, p in served.model.named_parameters()} == parameters  # in place
    served.update_weights(str(checkpoints["original"]))
    assert served.weight_version == version + 2
    assert_same(actions(served), expected["original"])


def broken_copy(checkpoints: dict, tmp_path: Path, how: str) -> str:
    """A checkpoint each update refuses, and the reason it gives."""
    out = tmp_path / how
    if how == "missing directory":
        return str(out)
    shutil.copytree(checkpoints["original"], out)
    weights = out / WEIGHTS
    if how == "missing weights file":
        weights.unlink()
    elif how == "truncated weights file":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size - 100)
    elif how == "missing tensor":
        rewrite(weights, lambda t: t.pop("model.action_out_proj.bias"))
    elif how == "other shape":
        rewrite(weights, lambda t: t.update({"model.action_out_proj.bias": torch.zeros(3)}))
    elif how == "other dtype":
        rewrite(weights, lambda t: t.update({"model.action_out_proj.bias": t["model.action_out_proj.bias"].double()}))
    elif how == "other architecture":
        text = (out / "config.json").read_text()
        (out / "config.json").write_text(text.replace('"chunk_size": 50', '"chunk_size": 40'))
        assert text != (out / "config.json").read_text()
    return str(out)


REFUSED = {  # how the copy is broken -> (the reason, words the message names the problem with)
    "missing directory": ("not_found", "not a directory"),
    "missing weights file": ("not_found", "no model.safetensors"),
    "truncated weights file": ("unreadable", "in a file of"),
    "missing tensor": ("mismatch", "missing tensors: model.action_out_proj.bias"),
    "other shape": ("mismatch", "wrong shape"),
    "other dtype": ("mismatch", "float64 (served: float32)"),
    "other architecture": ("mismatch", "chunk_size"),
}


@pytest.mark.parametrize("how", [*REFUSED, "other family"])
def test_a_refused_swap_changes_nothing(served, checkpoints, expected, golden, tmp_path, how):
    if how == "other family":
        path, (reason, words) = str(golden.parent / "pi0_golden" / "checkpoint"), ("mismatch", "a pi0 checkpoint")
        if not Path(path).is_dir():
            from fixtures import fixture_dir

            path = str(fixture_dir("pi0_golden") / "checkpoint")
    else:
        path, (reason, words) = broken_copy(checkpoints, tmp_path, how), REFUSED[how]
    version = served.weight_version
    with pytest.raises(WeightUpdateRefused) as refused:
        served.update_weights(path)
    assert refused.value.reason == reason and words in refused.value.message, refused.value.message
    assert served.weight_version == version
    assert_same(actions(served), expected["original"])


def test_requests_prepared_before_a_swap_run_on_the_new_statistics_and_a_launched_batch_on_the_old(
        served, checkpoints, expected):
    """The host side of "between batches": a request prepared (normalized) before the swap is prepared again
    when it launches after it; a batch launched before it un-normalizes with the statistics it ran with."""
    launched = served.launch([served.request(observation(served, 0))])  # (on a CPU: computed already)
    waiting = served.request(observation(served, 1))
    served.prepare(waiting)
    served.update_weights(str(checkpoints["perturbed"]))
    try:
        np.testing.assert_array_equal(launched.finish()[0].actions, expected["original"][0])
        np.testing.assert_array_equal(served.run([waiting])[0].actions, expected["perturbed"][1])
    finally:
        served.update_weights(str(checkpoints["original"]))


def test_a_second_update_while_one_runs_is_refused_busy(served, checkpoints, monkeypatch):
    """Waits on state: the first update is held inside its read until the second has been refused."""
    reading, release = threading.Event(), threading.Event()
    stage = served.runtime.stage_weights

    def held(tensors):
        reading.set()
        release.wait()
        return stage(tensors)

    monkeypatch.setattr(served.runtime, "stage_weights", held)
    first = threading.Thread(target=served.update_weights, args=(str(checkpoints["original"]),))
    first.start()
    try:
        assert reading.wait(60)
        with pytest.raises(WeightUpdateRefused) as refused:
            served.update_weights(str(checkpoints["perturbed"]))
        assert refused.value.reason == "busy"
    finally:
        release.set()
        first.join()


# ---- POST /update_weights_from_disk -----------------------------------------------------------------------
ROUTE = "/update_weights_from_disk"
LOOPBACK = ("127.0.0.1", 50000)
ADMIN, ROBOT = "admin-key", "robot-key"


def generate(client: TestClient, obs: dict, **headers) -> np.ndarray:
    body = {"input": {"task": obs["task"], "observation": {
        "images": {c: image.tolist() for c, image in obs["images"].items()}, "state": obs["state"].tolist(),
        "noise": obs["noise"].tolist()}}}
    reply = client.post("/v1/actions/generations", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    return np.asarray(reply.json()["data"][0]["action"]["values"], dtype=np.float32)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_the_route_swaps_and_healthz_metadata_and_metrics_report_it(served, checkpoints, expected):
    with TestClient(create_app(served, ServerSettings()), client=LOOPBACK) as client:
        version = client.get("/healthz").json()["weight_version"]
        reply = client.post(ROUTE, json={"model_path": str(checkpoints["perturbed"]), "flush_cache": True})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["success"] is True and body["weight_version"] == version + 1 and body["load_ms"] > 0
        assert str(checkpoints["perturbed"]) in body["message"]
        assert client.get("/healthz").json()["weight_version"] == version + 1
        assert client.get("/v1/actions/metadata").json()["weight_version"] == version + 1
        np.testing.assert_array_equal(generate(client, observation(served, 0)), expected["perturbed"][0])
        assert client.post(ROUTE, json={"model_path": str(checkpoints["original"])}).status_code == 200
        np.testing.assert_array_equal(generate(client, observation(served, 0)), expected["original"][0])
        assert "vlaserve_weight_updates_total 2.0" in client.get("/metrics").text


@pytest.mark.parametrize("body, status, kind, field", [
    ({}, 422, "invalid_request", "model_path"),
    ({"model_path": 3}, 422, "invalid_request", "model_path"),
    ({"model_path": "x", "is_async": True}, 422, "invalid_request", "is_async"),
    ({"model_path": "x", "flush_cache": False}, 422, "invalid_request", "flush_cache"),
    ({"model_path": "x", "abort_all_requests": 1}, 422, "invalid_request", "abort_all_requests"),
    ({"model_path": "x", "load_format": "gguf"}, 422, "invalid_request", "load_format"),
    ({"model_path": "/nonexistent/checkpoint"}, 404, "checkpoint_not_found", "model_path"),
    ({"model_path": "truncated weights file"}, 422, "invalid_checkpoint", "model_path"),
    ({"model_path": "other shape"}, 422, "checkpoint_mismatch", "model_path"),
])
def test_the_route_refuses_in_the_servers_error_shape(served, checkpoints, tmp_path, body, status, kind, field):
    if body.get("model_path") in REFUSED:
        body = {"model_path": broken_copy(checkpoints, tmp_path, body["model_path"])}
    client = TestClient(create_app(served, ServerSettings()), client=LOOPBACK)  # (no lifespan: no batcher needed)
    version = client.get("/healthz").json()["weight_version"]
    reply = client.post(ROUTE, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["field"]) == (kind, field) and error["message"]
    assert client.get("/healthz").json()["weight_version"] == version  # (unchanged actions: the Policy tests above)


def test_a_serve_ray_replica_refuses_updates(served):
    app = create_app(served, ServerSettings())
    app.state.service.weight_updates_refused = "a fleet updates no replica alone"
    reply = TestClient(app, client=LOOPBACK).post(ROUTE, json={"model_path": "/nonexistent"})
    assert reply.status_code == 409 and reply.json()["error"]["type"] == "update_unavailable"


@pytest.mark.parametrize("keys, client_host, headers, status", [
    # No key at all: this computer only.
    ({}, "192.168.1.20", {}, 403),
    ({}, "127.0.0.1", {}, 404),
    ({}, "::1", {}, 404),
    # An API key only: it is required.
    ({"api_key": ROBOT}, "127.0.0.1", {}, 401),
    ({"api_key": ROBOT}, "192.168.1.20", bearer(ROBOT), 404),
    # An admin key: only it, from anywhere; the robots' key is forbidden.
    ({"api_key": ROBOT, "admin_api_key": ADMIN}, "192.168.1.20", bearer(ROBOT), 403),
    ({"api_key": ROBOT, "admin_api_key": ADMIN}, "127.0.0.1", {}, 401),
    ({"api_key": ROBOT, "admin_api_key": ADMIN}, "192.168.1.20", {"X-API-Key": ADMIN}, 404),
    ({"admin_api_key": ADMIN}, "127.0.0.1", bearer("wrong"), 401),
])
def test_who_may_update_weights(served, keys, client_host, headers, status):
    """404: authorized, and the checkpoint named does not exist (nothing is swapped)."""
    client = TestClient(create_app(served, ServerSettings(**keys)), client=(client_host, 50000))
    reply = client.post(ROUTE, json={"model_path": "/nonexistent/checkpoint"}, headers=headers)
    assert reply.status_code == status, reply.text


def test_the_admin_key_is_not_an_api_key(served):
    client = TestClient(create_app(served, ServerSettings(api_key=ROBOT, admin_api_key=ADMIN)))
    assert client.get("/v1/actions/metadata", headers=bearer(ADMIN)).status_code == 401
    assert client.get("/v1/actions/metadata", headers=bearer(ROBOT)).status_code == 200
    client = TestClient(create_app(served, ServerSettings(admin_api_key=ADMIN)))  # robots need no key
    assert client.get("/v1/actions/metadata").status_code == 200


def test_a_batch_enqueued_before_a_swap_is_answered_by_the_old_weights_and_the_next_by_the_new(
        served, checkpoints, expected, monkeypatch):
    """Waits on state: the first request's batch is held inside its enqueue (holding the lock a swap takes)
    until the update has read and staged the new weights; it is answered with the original's actions, the
    update then succeeds, and the next request gets the new weights' actions."""
    entered, staged, release = threading.Event(), threading.Event(), threading.Event()
    enqueue, stage = served.runtime.enqueue, served.runtime.stage_weights

    def held_enqueue(*args, **kwargs):
        launched = enqueue(*args, **kwargs)
        if not entered.is_set():
            entered.set()
            release.wait()
        return launched

    def signalling_stage(tensors):
        out = stage(tensors)
        staged.set()
        return out

    monkeypatch.setattr(served.runtime, "enqueue", held_enqueue)
    monkeypatch.setattr(served.runtime, "stage_weights", signalling_stage)
    results = {}
    with TestClient(create_app(served, ServerSettings()), client=LOOPBACK) as client:
        first = threading.Thread(target=lambda: results.update(first=generate(client, observation(served, 0))))
        update = threading.Thread(target=lambda: results.update(update=client.post(
            ROUTE, json={"model_path": str(checkpoints["perturbed"])})))
        first.start()
        try:
            assert entered.wait(120)
            update.start()
            assert staged.wait(120)
            assert "update" not in results  # held behind the batch
        finally:
            release.set()
            first.join()
            if update.is_alive() or update.ident is not None:
                update.join()
        try:
            assert results["update"].status_code == 200, results["update"].text
            np.testing.assert_array_equal(results["first"], expected["original"][0])
            np.testing.assert_array_equal(generate(client, observation(served, 1)), expected["perturbed"][1])
        finally:
            assert client.post(ROUTE, json={"model_path": str(checkpoints["original"])}).status_code == 200


def test_the_client_updates_weights_and_raises_its_error_types(served, checkpoints):
    import socket

    import uvicorn

    from vlaserve_client import AuthenticationError, Client, ServerError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(served, ServerSettings(api_key=ROBOT, admin_api_key=ADMIN)),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:  # waits for the socket to listen (or the server thread to die)
            assert thread.is_alive()
            threading.Event().wait(0.05)
        client = Client(f"ws://127.0.0.1:{port}", api_key=ROBOT)
        version = served.weight_version
        reply = client.update_weights(checkpoints["perturbed"], admin_key=ADMIN)
        assert reply["success"] is True and reply["weight_version"] == served.weight_version == version + 1
        with pytest.raises(ServerError) as refused:
            client.update_weights("/nonexistent/checkpoint", admin_key=ADMIN)
        assert (refused.value.type, refused.value.field) == ("checkpoint_not_found", "model_path")
        with pytest.raises(ServerError) as forbidden:
            client.update_weights(checkpoints["original"])  # the robot's key
        assert forbidden.value.type == "forbidden"
        with pytest.raises(AuthenticationError):
            client.update_weights(checkpoints["original"], admin_key="wrong")
        assert served.weight_version == version + 1
        assert client.update_weights(checkpoints["original"], admin_key=ADMIN)["weight_version"] == version + 2
    finally:
        server.should_exit = True
        thread.join()
