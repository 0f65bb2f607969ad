"""/healthz says `starting` (503) until the runtime serves, `ok` (200) while the rest of its CUDA graphs
are captured and after; /healthz, /v1/actions/metadata and /metrics show the capture progress and
/metrics the time to the first action. On a CPU, the runtime's state and graph progress are faked
the way the CUDA runtime reports them (runtime.state, runtime.stats()["graphs"])."""

import math
import re

from fastapi.testclient import TestClient
from test_server import _good_body  # a request body the golden checkpoint takes

from vlaserve.server import ServerSettings, create_app

# 80 graphs (batches 1-8 x prompt lengths 96, 200 x 3 camera layouts + RTC on/off); batch 1's 10 captured.
CAPTURING = {"captured": 10, "total": 80, "pending": 70, "captured_shapes": ["b1 L200 prefix 3 cameras"],
             "pending_shapes": ["b2 L200 prefix 3 cameras"], "serving_after_s": 2.5, "all_captured_after_s": None,
             "warmup_s": 2.5, "capture_s": 1.9}


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def fake_graphs(monkeypatch, runtime) -> dict:
    """The runtime reports the state and graph progress put into the dict returned."""
    real, progress = runtime.stats, {}
    monkeypatch.setattr(runtime, "stats", lambda: {**real(), **progress})
    monkeypatch.setattr(runtime, "state", "ready")
    return progress


def report(runtime, progress: dict, state: str, graphs: dict) -> None:
    runtime.state = progress["state"] = state
    progress["graphs"] = graphs


def test_healthz_is_starting_until_the_runtime_is_ready(golden_policy):
    runtime = golden_policy.runtime
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        try:
            runtime.state = "warming_up"  # what a background warm-up shows until its batch-1 graphs are captured
            starting = client.get("/healthz")
            assert starting.status_code == 503 and starting.json()["status"] == "starting"
            assert "vlaserve_ready 0.0" in client.get("/metrics").text
        finally:
            runtime.state = "ready"
        ready = client.get("/healthz")
        assert ready.status_code == 200 and ready.json()["status"] == "ok"
        metrics = client.get("/metrics").text
        # The eager runner on the CPU captures nothing and never falls back.
        assert "vlaserve_ready 1.0" in metrics and "vlaserve_graph_captures 0.0" in metrics
        assert "vlaserve_uncaptured_calls 0.0" in metrics
        assert metric(metrics, "vlaserve_graphs_captured") == metric(metrics, "vlaserve_graphs_total") == 0
        # The eager runtime serves from its first moment: no warm-up to wait for.
        assert metric(metrics, "vlaserve_serving_after_seconds") == 0.0
        assert client.get("/v1/actions/metadata").json()["graphs"]["total"] == 0


def test_the_server_serves_while_the_rest_of_its_graphs_are_captured(golden_policy, monkeypatch):
    runtime = golden_policy.runtime
    progress = fake_graphs(monkeypatch, runtime)
    report(runtime, progress, "warming_up", {**CAPTURING, "captured": 4, "pending": 76, "serving_after_s": None})
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        starting = client.get("/healthz")
        assert starting.status_code == 503
        assert starting.json()["status"] == "starting" and starting.json()["graphs"] == {"captured": 4, "total": 80}

        report(runtime, progress, "capturing", CAPTURING)
        serving = client.get("/healthz")
        assert serving.status_code == 200
        assert serving.json()["status"] == "ok" and serving.json()["graphs"] == {"captured": 10, "total": 80}
        assert client.get("/v1/actions/metadata").json()["graphs"] == CAPTURING
        metrics = client.get("/metrics").text
        assert metric(metrics, "vlaserve_ready") == 1.0
        assert (metric(metrics, "vlaserve_graphs_captured"), metric(metrics, "vlaserve_graphs_total")) == (10, 80)
        assert metric(metrics, "vlaserve_serving_after_seconds") == 2.5
        assert math.isnan(metric(metrics, "vlaserve_all_graphs_captured_after_seconds"))

        done = {**CAPTURING, "captured": 80, "pending": 0, "pending_shapes": [], "all_captured_after_s": 9.0}
        report(runtime, progress, "ready", done)
        assert client.get("/healthz").json()["graphs"] == {"captured": 80, "total": 80}
        metrics = client.get("/metrics").text
        assert metric(metrics, "vlaserve_graphs_captured") == 80
        assert metric(metrics, "vlaserve_all_graphs_captured_after_seconds") == 9.0


def test_the_first_action_is_timed_once(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        assert math.isnan(metric(client.get("/metrics").text, "vlaserve_first_action_seconds"))
        body = _good_body(parameters={"num_inference_steps": 1})
        assert client.post("/v1/actions/generations", json=body).status_code == 200
        first = metric(client.get("/metrics").text, "vlaserve_first_action_seconds")
        assert first > 0
        assert client.post("/v1/actions/generations", json=body).status_code == 200
        assert metric(client.get("/metrics").text, "vlaserve_first_action_seconds") == first
