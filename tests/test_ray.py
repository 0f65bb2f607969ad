"""`vlaserve serve-ray`'s application on a local Ray cluster: 2 replicas of the tiny golden checkpoint
(float32, CPU, half a CPU each). Answers are compared with an in-process `Policy.infer` with the same
noise, as tests/test_server.py does for `vlaserve serve` (same tolerance, same reasons). Skipped
when Ray is not installed (pip install -e ".[ray]").

The tests run in file order and share one cluster: the last two kill a replica and scale down.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import websockets.sync.client as ws_client  # noqa: E402
from openpi_client import msgpack_numpy  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from vlaserve.fleet.command import SESSION_HEADER_ENV, fleet_options  # noqa: E402
from vlaserve.fleet.labels import REPLICA_HEADER  # noqa: E402
from vlaserve.fleet.replica import build  # noqa: E402

ATOL = 1e-4  # tests/test_server.py: rounding is < 1e-5, the smallest real bug 1.2e-3
API_KEY = "fleet-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
APP, DEPLOYMENT = "vlaserve", "VlaserveReplica"
HORIZON, MODEL_DIM, STATE_DIM = 50, 32, 14
ROBOT_HEADER = "x-robot-id"
BOUND_S = 120  # a bound on waiting for Ray (replacing a replica), never an assertion on speed

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning", "ignore::DeprecationWarning")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fleet_config(golden, replicas: int) -> dict:
    return fleet_options({"checkpoint": str(golden / "checkpoint"), "device": "cpu", "dtype": "float32",
                          "api_key": API_KEY, "replicas": replicas, "cpus_per_replica": 0.5,
                          "drain_timeout_s": 20.0, "batch_delay_ms": 1.0})


@pytest.fixture(scope="module")
def fleet(golden):
    port = free_port()
    os.environ[SESSION_HEADER_ENV] = ROBOT_HEADER  # read by the proxy the local cluster starts
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(fleet_config(golden, 2)), name=APP, route_prefix="/")
        yield {"port": port, "url": f"http://127.0.0.1:{port}", "golden": golden}
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(SESSION_HEADER_ENV, None)


def make_observation(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": {"base_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)},
            "state": rng.normal(size=STATE_DIM).astype(np.float32), "task": f"pick up block {seed}"}


def make_noise(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((HORIZON, MODEL_DIM)).astype(np.float32)


def openpi_frame(obs: dict, noise: np.ndarray) -> dict:
    return {"observation/image": obs["images"]["base_0_rgb"], "observation/state": obs["state"],
            "prompt": obs["task"], "noise": noise}


def generation(http: httpx.Client, seed: int, robot: str | None = None, steps: int | None = None) -> httpx.Response:
    obs = make_observation(seed)
    body = {"input": {"task": obs["task"], "observation": {"images": obs["images"], "state": obs["state"],
                                                            "noise": make_noise(seed)}}}
    if steps is not None:
        body["parameters"] = {"num_inference_steps": steps}
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack", **AUTH}
    if robot is not None:
        headers[ROBOT_HEADER] = robot
    return http.post("/v1/actions/generations", content=msgpack_numpy.packb(body), headers=headers, timeout=60)


def replica_of(http: httpx.Client, robot: str) -> str:
    return http.get("/v1/actions/metadata", headers={**AUTH, ROBOT_HEADER: robot}).headers[REPLICA_HEADER.decode()]


def robots_by_replica(http: httpx.Client, robots: int = 16) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for i in range(robots):
        out.setdefault(replica_of(http, f"robot-{i}"), []).append(f"robot-{i}")
    return out


def openpi_socket(fleet, robot: str | None = None, path: str = "/openpi/policy"):
    """An OpenPI-protocol websocket that sends a robot id (the unmodified openpi-client can't)."""
    headers = {"Authorization": f"Api-Key {API_KEY}", **({ROBOT_HEADER: robot} if robot else {})}
    ws = ws_client.connect(f"ws://127.0.0.1:{fleet['port']}{path}", additional_headers=headers, max_size=None,
                           compression=None)
    metadata = msgpack_numpy.unpackb(ws.recv())
    assert metadata["action_horizon"] == HORIZON
    return ws


def test_openpi_client_robots_get_the_answers_of_vlaserve_serve(fleet, golden_policy):
    robots = [WebsocketClientPolicy("127.0.0.1", fleet["port"], api_key=API_KEY) for _ in range(3)]
    try:
        for seed, robot in enumerate(robots):  # each robot its own noise, both replicas in use
            assert robot.get_server_metadata()["action_horizon"] == HORIZON
            obs, noise = make_observation(seed), make_noise(seed)
            out = robot.infer(openpi_frame(obs, noise))
            expected = golden_policy.infer(obs, noise=noise).actions
            np.testing.assert_allclose(out["actions"], expected, rtol=0, atol=ATOL)
            again = robot.infer(openpi_frame(obs, noise))  # the same connection, the same replica
            np.testing.assert_array_equal(again["actions"], out["actions"])
    finally:
        for robot in robots:
            robot._ws.close()
    ws = openpi_socket(fleet, path="/openpi/policy")
    ws.send(msgpack_numpy.packb(openpi_frame(make_observation(7), make_noise(7))))
    out = msgpack_numpy.unpackb(ws.recv())
    np.testing.assert_allclose(out["actions"], golden_policy.infer(make_observation(7), noise=make_noise(7)).actions,
                               rtol=0, atol=ATOL)
    ws.close()


def test_http_robot_id_keeps_a_robot_on_one_replica(fleet, golden_policy):
    with httpx.Client(base_url=fleet["url"]) as http:
        assignment = robots_by_replica(http)
        assert len(assignment) == 2, assignment  # 16 robots hashed over 2 replicas: both get some
        for replica, robots in assignment.items():
            for robot in robots[:2]:
                for _ in range(3):
                    assert replica_of(http, robot) == replica
            seed = int(robots[0].split("-")[1])
            r = generation(http, seed, robot=robots[0])
            assert r.status_code == 200 and r.headers[REPLICA_HEADER.decode()] == replica
            actions = msgpack_numpy.unpackb(r.content)["data"][0]["action"]["values"]
            np.testing.assert_allclose(actions, golden_policy.infer(make_observation(seed), noise=make_noise(seed))
                                       .actions, rtol=0, atol=ATOL)
        # A websocket robot that sends its id lands on the replica its HTTP requests use.
        replica, robots = next(iter(assignment.items()))
        ws = openpi_socket(fleet, robot=robots[0])
        ws.send(msgpack_numpy.packb(openpi_frame(make_observation(1), make_noise(1))))
        msgpack_numpy.unpackb(ws.recv())
        ws.close()
        metrics = http.get("/metrics", headers={ROBOT_HEADER: robots[0]}).text
        assert f'vlaserve_requests_total{{replica="{replica}",route="/openpi/policy",status="200"}}' in metrics


def test_errors_and_metrics_are_those_of_vlaserve_serve(fleet):
    with httpx.Client(base_url=fleet["url"]) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        denied = http.get("/v1/actions/metadata")
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "unauthorized"
        bad = http.post("/v1/actions/generations", headers={**AUTH, ROBOT_HEADER: "robot-0"},
                        json={"input": {"task": "t", "observation": {"state": [0.0] * 3}}})
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["type"] in ("invalid_observation", "invalid_request")
        replica = bad.headers[REPLICA_HEADER.decode()]
        metrics = http.get("/metrics", headers={ROBOT_HEADER: "robot-0"})
        assert metrics.headers[REPLICA_HEADER.decode()] == replica
        samples = [line for line in metrics.text.splitlines() if line.startswith("vlaserve_")]
        assert samples and all(f'{{replica="{replica}"' in line for line in samples)
        assert f'vlaserve_errors_total{{replica="{replica}",route="/v1/actions/generations",type=' in metrics.text


def running_replicas() -> int:
    deployment = serve.status().applications[APP].deployments[DEPLOYMENT]
    return deployment.replica_states.get("RUNNING", 0)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"Ray did not {what} within {BOUND_S} s")
        time.sleep(0.5)


def test_a_killed_replica_is_replaced_and_its_robots_reconnect(fleet, golden_policy):
    with httpx.Client(base_url=fleet["url"]) as http:
        assignment = robots_by_replica(http)
        victim = next(iter(assignment))
        robot = assignment[victim][0]
        ws = openpi_socket(fleet, robot=robot)  # on the victim, by its id
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#{victim}", namespace="serve"), no_restart=True)
        with pytest.raises((ConnectionClosed, OSError)):
            for _ in range(20):  # the kill lands within a request or two
                ws.send(msgpack_numpy.packb(openpi_frame(make_observation(2), make_noise(2))))
                msgpack_numpy.unpackb(ws.recv())
                time.sleep(0.2)

        def replaced() -> bool:
            try:
                replicas = set(robots_by_replica(http))
            except (httpx.HTTPError, KeyError):
                return False
            return running_replicas() == 2 and len(replicas) == 2 and victim not in replicas

        wait_for(replaced, "replace the killed replica")
        ws = openpi_socket(fleet, robot=robot)  # the robot reconnects, to the replica its id maps to now
        ws.send(msgpack_numpy.packb(openpi_frame(make_observation(2), make_noise(2))))
        out = msgpack_numpy.unpackb(ws.recv())
        np.testing.assert_allclose(out["actions"], golden_policy.infer(make_observation(2), noise=make_noise(2))
                                   .actions, rtol=0, atol=ATOL)
        ws.close()


def test_scale_down_drains_in_flight_requests_and_closes_idle_robots(fleet):
    """serve.run with 1 replica instead of 2: from Python, Ray 2.60 deploys that as a new version, so
    both old replicas go through the graceful shutdown an autoscaler's scale-down uses: each finishes
    its in-flight request, closes its idle robot sockets with 1012, and only then stops."""
    with httpx.Client(base_url=fleet["url"]) as http:
        assignment = robots_by_replica(http)
        assert len(assignment) == 2
        idle = [openpi_socket(fleet, robot=robots[0]) for robots in assignment.values()]
        results: dict[str, int] = {}

        def slow_request(robot: str) -> None:  # 100 denoising steps: ~10x a normal call
            with httpx.Client(base_url=fleet["url"]) as own:
                results[robot] = generation(own, 3, robot=robot, steps=100).status_code

        busy = [threading.Thread(target=slow_request, args=(robots[-1],)) for robots in assignment.values()]
        for thread in busy:
            thread.start()
        time.sleep(0.5)  # the requests reach their replicas (a late one waits for the new replica: fine too)
        serve.run(build(fleet_config(fleet["golden"], 1)), name=APP, route_prefix="/")
        for thread in busy:
            thread.join(timeout=BOUND_S)
        assert results == {robots[-1]: 200 for robots in assignment.values()}
        for ws in idle:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=BOUND_S)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012  # "service restart"
        assert running_replicas() == 1 and len(robots_by_replica(http, 4)) == 1
        ws = openpi_socket(fleet, robot="robot-0")  # a robot reconnects to the new replica
        ws.send(msgpack_numpy.packb(openpi_frame(make_observation(4), make_noise(4))))
        assert msgpack_numpy.unpackb(ws.recv())["actions"].shape == (HORIZON, 14)
        ws.close()


@pytest.mark.skipif(os.environ.get("VLASERVE_RAY_AUTOSCALE_TEST") != "1",
                    reason="~1 min more: set VLASERVE_RAY_AUTOSCALE_TEST=1")
def test_autoscaling_follows_connected_robots(fleet):
    """Autoscaling on ongoing requests (an open robot socket is one): 3 robots with a target of 1 per
    replica bring a second replica (max 2); when they leave, the fleet shrinks back to 1."""
    options = fleet_options({"checkpoint": str(fleet["golden"] / "checkpoint"), "device": "cpu", "dtype": "float32",
                             "api_key": API_KEY, "cpus_per_replica": 0.5, "min_replicas": 1, "max_replicas": 2,
                             "target_ongoing_requests": 1.0, "downscale_delay_s": 5.0})
    serve.run(build(options), name=APP, route_prefix="/")
    with httpx.Client(base_url=fleet["url"]) as http:
        assert len(robots_by_replica(http, 8)) == 1
        robots = [openpi_socket(fleet) for _ in range(3)]
        wait_for(lambda: len(robots_by_replica(http, 8)) == 2, "scale up to 2 replicas")
        for ws in robots:
            ws.close()
        wait_for(lambda: running_replicas() == 1 and len(robots_by_replica(http, 8)) == 1, "scale down to 1")
