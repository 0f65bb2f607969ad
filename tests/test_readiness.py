"""/healthz says `starting` (503) until the runtime serves with its final runner, `ok` after; /metrics
shows the graph counters the fleet bench watches."""

from fastapi.testclient import TestClient

from vlaserve.server import ServerSettings, create_app


def test_healthz_is_starting_until_the_runtime_is_ready(golden_policy):
    runtime = golden_policy.runtime
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        try:
            runtime.state = "warming_up"  # what a background warm-up shows until its graphs are captured
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

