"""`vlaserve serve --lerobot-port`: LeRobot's AsyncInference wire against a real server on the pi05
golden checkpoint, spoken the way LeRobot 0.6.1's robot_client speaks it (lerobot_fakes: the same
pickles, the same chunking), and the hostile battery. The unmodified client itself runs in
test_lerobot_client.py.

Tolerance: actions are compared with a /v1 request for the same observation and noise at ATOL = 1e-4,
as in test_server.py (the two runs differ only in batching and reduction order).
"""

from __future__ import annotations

import pickle
import threading

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lerobot_fakes import PolicyFeature, FeatureType, RemotePolicyConfig, TimedObservation, WireClient
from test_server import ATOL, HORIZON, MODEL_DIM, STATE_DIM, ServerProcess, envelope_actions, free_port, post_msgpack

from vlaserve.server.lerobot import pickles, wire

JOINTS = [f"joint_{i}.pos" for i in range(STATE_DIM)]
CAMERAS = {"front": "base_0_rgb", "wrist": "left_wrist_0_rgb"}  # the robot's camera -> the checkpoint's


def features(size=(96, 128)) -> dict:
    """What robot_client sends: hw_to_dataset_features of the robot's joints and cameras."""
    out = {"observation.state": {"dtype": "float32", "shape": (STATE_DIM,), "names": list(JOINTS)}}
    for camera in CAMERAS:
        out[f"observation.images.{camera}"] = {"dtype": "image", "shape": (*size, 3),
                                               "names": ["height", "width", "channels"],
                                               "info": {"is_depth_map": False}}
    return out


RENAME = {f"observation.images.{robot}": f"observation.images.{ours}" for robot, ours in CAMERAS.items()}


def setup(name: str, policy_type: str = "pi05", chunk: int = 20, rename=RENAME) -> bytes:
    return pickle.dumps(RemotePolicyConfig(policy_type, name, features(), chunk, "cuda", dict(rename)))


def robot_observation(seed: int, size=(96, 128)) -> dict:
    rng = np.random.default_rng(seed)
    raw = {joint: float(v) for joint, v in zip(JOINTS, rng.normal(size=STATE_DIM) * 3)}
    raw.update({camera: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for camera in CAMERAS})
    raw["task"] = f"stack block {seed}"
    raw["noise"] = rng.standard_normal((HORIZON, MODEL_DIM)).astype(np.float32)
    return raw


def v1_actions(http: httpx.Client, raw: dict) -> np.ndarray:
    body = {"input": {"task": raw["task"], "observation": {
        "images": {ours: raw[robot] for robot, ours in CAMERAS.items()},
        "state": np.array([raw[j] for j in JOINTS], np.float32), "noise": raw["noise"]}}}
    response = post_msgpack(http, body)
    assert response.status_code == 200, response.text
    from openpi_client import msgpack_numpy
    return envelope_actions(msgpack_numpy.unpackb(response.content))


@pytest.fixture(scope="module")
def server(golden, tmp_path_factory):
    port = free_port()
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32", "--batch-delay-ms", "20",
                          "--lerobot-port", str(port), "--body-timeout-s", "2"],
                         tmp_path_factory.mktemp("lerobot") / "server.log")
    proc.lerobot = f"127.0.0.1:{port}"
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def ready_robot(server, chunk: int = 20) -> WireClient:
    robot = WireClient(server.lerobot)
    robot.Ready(wire.Empty(), timeout=30)
    robot.SendPolicyInstructions(wire.PolicySetup(data=setup("checkpoint", chunk=chunk)), timeout=30)
    return robot


def step(robot: WireClient, raw: dict, timestep: int, must_go: bool = True) -> list:
    timestamp = 1000.0 + timestep
    robot.send(pickle.dumps(TimedObservation(timestamp, timestep, raw, must_go)))
    reply = robot.GetActions(wire.Empty(), timeout=120)
    return pickle.loads(reply.data) if reply.data else []  # the test trusts its own server's reply


def test_actions_equal_v1_with_timesteps_and_trimmed_chunk(server, http):
    robot = ready_robot(server, chunk=20)
    raw = robot_observation(1)
    actions = step(robot, raw, timestep=7)
    assert [a.timestep for a in actions] == list(range(7, 27))  # actions_per_chunk = 20 of 50
    np.testing.assert_allclose([a.timestamp for a in actions], [1007.0 + i / 30 for i in range(20)], rtol=0, atol=1e-9)
    assert all(a.action.dtype.is_floating_point and a.action.shape == (14,) for a in actions)
    np.testing.assert_allclose(np.stack([a.action.numpy() for a in actions]), v1_actions(http, raw)[:20], rtol=0, atol=ATOL)
    robot.close()


def test_a_repeated_timestep_is_skipped_unless_it_must_go(server):
    robot = ready_robot(server)
    assert len(step(robot, robot_observation(2), timestep=3)) == 20
    robot.send(pickle.dumps(TimedObservation(2.0, 3, robot_observation(3), False)))  # timestep 3 already predicted
    assert robot.GetActions(wire.Empty(), timeout=30).data == b""  # nothing queued: Empty after the wait
    assert len(step(robot, robot_observation(4), timestep=3, must_go=True)) == 20
    robot.close()


def test_two_robots_are_each_served_their_own_answers_in_shared_batches(server, http):
    """Two LeRobot robots and an openpi-client robot at once: nothing crossed, and batches of several."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    robots = [ready_robot(server, chunk=50) for _ in range(2)]
    openpi = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    seeds = {0: [10, 11, 12], 1: [20, 21, 22]}
    got, sizes = {}, []

    def run(index):
        for n, seed in enumerate(seeds[index]):
            got[seed] = step(robots[index], robot_observation(seed), timestep=n)

    def run_openpi():
        for seed in (30, 31, 32):
            raw = robot_observation(seed)
            reply = openpi.infer({"observation/image": raw["front"], "observation/wrist_image": raw["wrist"],
                                  "observation/state": np.array([raw[j] for j in JOINTS], np.float32),
                                  "prompt": raw["task"], "noise": raw["noise"]})
            got[seed] = reply["actions"]
            sizes.append(reply["policy_timing"]["batch_size"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)] + [threading.Thread(target=run_openpi)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, answer in got.items():
        actions = answer if isinstance(answer, np.ndarray) else np.stack([a.action.numpy() for a in answer])
        np.testing.assert_allclose(actions, v1_actions(http, robot_observation(seed)), rtol=0, atol=ATOL,
                                   err_msg=f"seed {seed}")
    metrics = httpx.get(server.url + "/metrics").text
    batched = [line for line in metrics.splitlines() if line.startswith("vlaserve_batch_size_count")]
    assert max(sizes) >= 2 or _batches_of_several(metrics), (sizes, batched)
    for robot in robots:
        robot.close()


def _batches_of_several(metrics: str) -> bool:
    """Some batch held 2 or more requests (the histogram's le="1.0" bucket is below its count)."""
    ones = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith('vlaserve_batch_size_bucket{le="1.0"}')]
    count = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vlaserve_batch_size_count")]
    return bool(ones and count and count[0] > ones[0])


# ---- the hostile battery ------------------------------------------------------------------------
class Calls:
    """A pickle that REDUCEs `target(*args)`."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def _hostile(marker) -> dict:
    import builtins
    import os
    import subprocess

    import torch

    touch = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": Calls(os.system, f"touch {marker}"),
        "eval": Calls(builtins.eval, touch),
        "exec": Calls(builtins.exec, touch),
        "subprocess.Popen": Calls(subprocess.Popen, ["touch", str(marker)]),
        "__import__": Calls(builtins.__import__, "os"),
        "torch storage": torch.zeros(3),  # torch.storage._load_from_bytes: torch.load of embedded bytes
        "getattr": Calls(getattr, 1, "__class__"),
        "2 GiB array": HugeArray(protocol5=False),
        "2 GiB buffer": HugeArray(protocol5=True),
        "object array": np.array([1, "a"], dtype=object),
    }


def _nested(depth: int) -> bytes:
    return b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."


class HugeArray:
    """numpy's own pickle of a uint8 array, its shape declaring 2 GiB, its data 4 bytes."""

    def __init__(self, protocol5: bool):
        self.protocol5 = protocol5

    def __reduce__(self):
        if self.protocol5:  # what protocol 5 pickles an array with
            return np._core.numeric._frombuffer, (b"\0" * 4, np.dtype("u1"), (2**31,), "C")
        rebuild, args, (version, _, dtype, fortran, data) = np.zeros(4, np.uint8).__reduce__()
        return rebuild, args, (version, (2**31,), dtype, fortran, data)


def test_hostile_pickles_are_refused_and_nothing_runs(server, tmp_path):
    marker = tmp_path / "executed"
    robot, bystander = ready_robot(server), ready_robot(server)
    cases = {name: pickle.dumps(TimedObservation(1.0, 0, {"x": payload}, True)) for name, payload in _hostile(marker).items()}
    cases["10^6 deep"] = _nested(10**6)  # refused by its opcode count
    cases["10^4 deep"] = _nested(10**4)  # refused by its depth
    cases["persistent id"] = b"\x80\x04\x8c\x01x\x94Q."
    cases["memo bomb"] = b"\x80\x04N\x8c\x00r\xff\xff\xff\x7f."  # LONG_BINPUT 2**31-1
    for name, data in cases.items():
        with pytest.raises(grpc.RpcError) as caught:
            robot.send(data)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "refused" in caught.value.details(), (name, caught.value.details())
    assert not marker.exists()
    assert len(step(robot, robot_observation(5), timestep=1)) == 20  # the same robot still served
    assert len(step(bystander, robot_observation(8), timestep=0)) == 20  # and another one, untouched
    robot.close()
    bystander.close()


@pytest.mark.parametrize("name, policy_type", [("other/checkpoint", "pi05"), ("checkpoint", "pi0"),
                                               ("checkpoint", "act")])
def test_a_setup_naming_another_model_is_refused_naming_what_is_served(server, name, policy_type):
    robot = WireClient(server.lerobot)
    robot.Ready(wire.Empty(), timeout=30)
    with pytest.raises(grpc.RpcError) as caught:
        robot.SendPolicyInstructions(wire.PolicySetup(data=setup(name, policy_type)), timeout=30)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'checkpoint'" in caught.value.details() and "pi05" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:  # no setup, so no observations
        robot.send(pickle.dumps(TimedObservation(1.0, 0, robot_observation(1), True)))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    robot.close()


def test_features_that_reach_no_camera_and_policy_features_are_refused(server):
    robot = WireClient(server.lerobot)
    robot.Ready(wire.Empty(), timeout=30)
    for config in (RemotePolicyConfig("pi05", "checkpoint", features(), 10),  # no rename_map: front/wrist unknown
                   RemotePolicyConfig("pi05", "checkpoint", {"observation.state": PolicyFeature(FeatureType.STATE, (14,))}, 10)):
        with pytest.raises(grpc.RpcError) as caught:
            robot.SendPolicyInstructions(wire.PolicySetup(data=pickle.dumps(config)), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    robot.close()


def test_streams_that_do_not_end_are_cut_off(server):
    robot = ready_robot(server)
    data = pickle.dumps(TimedObservation(1.0, 0, robot_observation(1), True))
    with pytest.raises(grpc.RpcError) as caught:  # BEGIN, then the stream closes without END
        robot.SendObservations(iter([wire.Observation(transfer_state=wire.TRANSFER_BEGIN, data=data[:100])]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "TRANSFER_END" in caught.value.details()

    stop = threading.Event()

    def endless():
        while not stop.is_set():
            yield wire.Observation(transfer_state=wire.TRANSFER_MIDDLE, data=b"x")
            stop.wait(0.05)

    with pytest.raises(grpc.RpcError) as caught:  # MIDDLE forever: cut at --body-timeout-s (2 s here)
        robot.SendObservations(endless(), timeout=60)
    stop.set()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--body-timeout-s" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:  # a flood of empty messages: cut at the message count
        robot.SendObservations(iter([wire.Observation(transfer_state=wire.TRANSFER_MIDDLE)] * 5000), timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(step(robot, robot_observation(6), timestep=2)) == 20
    robot.close()


# ---- the unpickler alone ------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_are_refused_or_plain(data):
    try:
        value = pickles.loads(b"\x80\x04" + data)
    except pickles.Refused:
        return
    assert value is None or isinstance(value, (bool, int, float, str, bytes, list, tuple, dict, np.ndarray))


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                    max_leaves=30))
def test_plain_values_round_trip(value):
    assert pickles.loads(pickle.dumps(value, protocol=5)) == value


def test_numpy_arrays_of_every_layout_round_trip():
    for array in (np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.arange(12, dtype=">i4").reshape(3, 4).T,
                  np.zeros((480, 640, 3), np.uint8), np.float64(2.5), np.arange(6, dtype=np.int64)[::2]):
        for protocol in (4, 5):
            np.testing.assert_array_equal(pickles.loads(pickle.dumps(array, protocol=protocol)), array)


def test_src_has_no_unrestricted_unpickling():
    """In src/, nothing calls pickle.load(s), torch.load or an Unpickler, and the one Unpickler
    subclass is pickles.RestrictedUnpickler (its own find_class), used only through pickles.loads."""
    import ast
    from pathlib import Path

    import vlaserve

    def dotted(node) -> str:
        return f"{dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")

    unsafe = {"pickle.load", "pickle.loads", "pickle.Unpickler", "Unpickler", "torch.load", "_pickle.loads",
              "pickle._loads", "pickle._Unpickler", "_load_from_bytes"}
    offenders, subclasses = [], []
    for path in Path(vlaserve.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and dotted(node.func) in unsafe:
                offenders.append(f"{path}:{node.lineno}: {dotted(node.func)}(...)")
            if isinstance(node, ast.ClassDef) and any("Unpickler" in dotted(base) for base in node.bases):
                subclasses.append((path.name, node.name))
    assert not offenders
    assert subclasses == [("pickles.py", "RestrictedUnpickler")]
    assert pickles.RestrictedUnpickler.find_class is not pickle.Unpickler.find_class


def test_the_wire_is_services_proto():
    """wire.py's descriptors say what services.proto says: package, enum values, fields and their
    numbers, and the service's methods (LeRobot 0.6.1's, from its services.proto)."""
    import re
    from pathlib import Path

    proto = (Path(wire.__file__).with_name("services.proto")).read_text()
    proto = re.sub(r"//.*", "", proto)
    built = wire.file_descriptor()
    assert re.search(r"package (\w+);", proto).group(1) == built.package == "transport"
    enum = re.search(r"enum TransferState \{(.*?)\}", proto, re.S).group(1)
    assert re.findall(r"(\w+) = (\d+);", enum) == [(v.name, str(v.number)) for v in built.enum_type[0].value]
    for message in built.message_type:
        body = re.search(rf"message {message.name} \{{(.*?)\}}", proto, re.S).group(1)
        assert re.findall(r"(\w+) (\w+) = (\d+);", body) == [
            ("TransferState" if f.type_name else "bytes", f.name, str(f.number)) for f in message.field], message.name
    rpcs = re.findall(r"rpc (\w+)\((stream )?(\w+)\) returns \((\w+)\);", proto)
    assert rpcs == [(m.name, "stream " if m.client_streaming else "", m.input_type.rsplit(".", 1)[1],
                     m.output_type.rsplit(".", 1)[1]) for m in built.service[0].method]


def test_serve_refuses_the_lerobot_port_with_an_api_key_or_on_the_http_port():
    from vlaserve.server.lerobot import problem_with

    base = {"lerobot_port": 8080, "port": 8000, "api_key": None}
    assert problem_with(base) is None and problem_with({**base, "lerobot_port": None, "api_key": "k"}) is None
    assert "API key" in problem_with({**base, "api_key": "k"})
    assert "differ" in problem_with({**base, "port": 8080})
