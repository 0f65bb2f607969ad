"""serve-ray with `direct_websockets`: a robot's websocket handshake, made through Ray's proxy, is
answered with a redirect to its replica's own port, and the robot then talks to the replica with no
proxy in between. The unmodified openpi-client follows it (with the API key: the redirect carries a
ticket, since a client following a redirect to another port drops its Authorization header).
One replica of the golden checkpoint on a local Ray cluster; skipped without Ray."""

from __future__ import annotations

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import websockets.sync.client as ws_client  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402

from test_ray import API_KEY, ATOL, free_port, make_noise, make_observation, openpi_frame  # noqa: E402
from vlaserve.fleet.command import fleet_options  # noqa: E402
from vlaserve.fleet.replica import build  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def direct_fleet(golden):
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = fleet_options({"checkpoint": str(golden / "checkpoint"), "device": "cpu", "dtype": "float32",
                                 "api_key": API_KEY, "replicas": 1, "cpus_per_replica": 0.5,
                                 "direct_websockets": True})
        serve.run(build(options), name="vlaserve", route_prefix="/")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openpi_client_is_redirected_to_its_replica_and_gets_the_same_answers(direct_fleet, golden_policy):
    robot = WebsocketClientPolicy("127.0.0.1", direct_fleet, api_key=API_KEY)
    try:
        # Connected past the proxy: to the replica's own port (the replica listens once it is built,
        # so the first robots may still be accepted through the proxy: then it is the proxy's port).
        direct_port = robot._ws.remote_address[1]
        obs, noise = make_observation(0), make_noise(0)
        out = robot.infer(openpi_frame(obs, noise))
        np.testing.assert_allclose(out["actions"], golden_policy.infer(obs, noise=noise).actions, rtol=0, atol=ATOL)
    finally:
        robot._ws.close()
    if direct_port == direct_fleet:  # accepted through the proxy before the direct server listened
        robot = WebsocketClientPolicy("127.0.0.1", direct_fleet, api_key=API_KEY)
        direct_port = robot._ws.remote_address[1]
        robot._ws.close()
    assert direct_port != direct_fleet
    # The replica's port takes a valid ticket or the key, nothing else; the proxy still refuses a wrong key.
    with pytest.raises(InvalidStatus) as refused:
        ws_client.connect(f"ws://127.0.0.1:{direct_port}/", open_timeout=10)
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as refused:
        ws_client.connect(f"ws://127.0.0.1:{direct_port}/?ticket=9999999999.forged", open_timeout=10)
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as refused:
        ws_client.connect(f"ws://127.0.0.1:{direct_fleet}/", additional_headers={"Authorization": "Api-Key wrong"},
                          open_timeout=10)
    assert refused.value.response.status_code == 401
    keyed = ws_client.connect(f"ws://127.0.0.1:{direct_port}/openpi/policy",
                              additional_headers={"Authorization": f"Api-Key {API_KEY}"}, open_timeout=10)
    keyed.close()


@pytest.mark.skipif(os.environ.get("VLASERVE_RAY_AUTOSCALE_TEST") != "1",
                    reason="~1 min more: set VLASERVE_RAY_AUTOSCALE_TEST=1")
def test_autoscaling_counts_robots_connected_straight_to_their_replica(direct_fleet, golden):
    """Ray's proxy does not see a redirected robot; the replicas report them (record_autoscaling_stats)
    and the policy counts each as an ongoing request: 3 robots with a target of 1 per replica bring
    a second replica (max 2); when they leave, the fleet shrinks back to 1."""
    from test_ray import running_replicas, wait_for

    options = fleet_options({"checkpoint": str(golden / "checkpoint"), "device": "cpu", "dtype": "float32",
                             "api_key": API_KEY, "cpus_per_replica": 0.5, "min_replicas": 1, "max_replicas": 2,
                             "target_ongoing_requests": 1.0, "downscale_delay_s": 5.0, "direct_websockets": True})
    serve.run(build(options), name="vlaserve", route_prefix="/")
    wait_for(lambda: running_replicas() == 1, "one replica")
    robots = []
    while len(robots) < 3:
        robot = WebsocketClientPolicy("127.0.0.1", direct_fleet, api_key=API_KEY)
        if robot._ws.remote_address[1] == direct_fleet:  # this replica's own server was not listening yet
            robot._ws.close()
            continue
        robots.append(robot)
    wait_for(lambda: running_replicas() == 2, "scale up to 2 replicas")
    for robot in robots:
        robot._ws.close()
    wait_for(lambda: running_replicas() == 1, "scale down to 1")
