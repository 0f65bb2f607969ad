"""Runs LeRobot 0.6.1's own RobotClient, unmodified, against a server, with a simulated robot; run by
tests/test_lerobot_client.py with the Python of a LeRobot venv (LeRobot needs Python 3.12):

    python lerobot_client_runner.py HOST:PORT SEED STEPS OUT_FILE

The robot returns seeded camera frames and joint positions (and the flow-matching noise, under
"noise", so the test can ask /v1 for the same answer); it stops the client after STEPS actions.
What crossed the wire is recorded by a pass-through stub (the client's code is untouched) into
OUT_FILE: each observation sent and each chunk received, as LeRobot's own objects read them.
"""

import pickle
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lerobot.async_inference.configs import RobotClientConfig
from lerobot.async_inference.robot_client import RobotClient
from lerobot.robots import Robot, RobotConfig

JOINTS = [f"joint_{i}.pos" for i in range(14)]
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb")
FRAME = (96, 128, 3)
HORIZON, MODEL_DIM = 50, 32


@RobotConfig.register_subclass("vlaserve_sim")
@dataclass(kw_only=True)
class SimRobotConfig(RobotConfig):
    seed: int = 0
    steps: int = 100


class SimRobot(Robot):
    config_class = SimRobotConfig
    name = "vlaserve_sim"

    def __init__(self, config: SimRobotConfig):
        super().__init__(config)
        self.seed, self.steps, self.captured, self.performed = config.seed, config.steps, 0, []
        self.done = threading.Event()

    @property
    def observation_features(self) -> dict:
        return {**{joint: float for joint in JOINTS}, **{camera: FRAME for camera in CAMERAS}}

    @property
    def action_features(self) -> dict:
        return {joint: float for joint in JOINTS}

    @property
    def is_connected(self) -> bool:
        return True

    @property
    def is_calibrated(self) -> bool:
        return True

    def connect(self, calibrate: bool = True) -> None:
        pass

    def calibrate(self) -> None:
        pass

    def configure(self) -> None:
        pass

    def get_observation(self) -> dict:
        rng = np.random.default_rng([self.seed, self.captured])
        self.captured += 1
        observation = {joint: float(v) for joint, v in zip(JOINTS, rng.normal(size=len(JOINTS)) * 3)}
        observation.update({camera: rng.integers(0, 256, FRAME, dtype=np.uint8) for camera in CAMERAS})
        observation["noise"] = rng.standard_normal((HORIZON, MODEL_DIM)).astype(np.float32)
        return observation

    def send_action(self, action: dict) -> dict:
        self.performed.append(action)
        if len(self.performed) >= self.steps:
            self.done.set()
        return action

    def disconnect(self) -> None:
        pass


class RecordingStub:
    """Passes every call to LeRobot's stub, keeping what was sent and received."""

    def __init__(self, stub, record: dict):
        self.stub, self.record = stub, record

    def SendObservations(self, chunks):  # noqa: N802
        chunks = list(chunks)
        self.record["observations"].append(pickle.loads(b"".join(c.data for c in chunks)))
        return self.stub.SendObservations(iter(chunks))

    def GetActions(self, request):  # noqa: N802
        reply = self.stub.GetActions(request)
        if reply.data:
            self.record["chunks"].append(pickle.loads(reply.data))
        return reply

    def __getattr__(self, name):
        return getattr(self.stub, name)


def main(address: str, seed: int, steps: int, out: str) -> None:
    config = RobotClientConfig(
        policy_type="pi05", pretrained_name_or_path="checkpoint", actions_per_chunk=50, task=f"stack block {seed}",
        server_address=address, aggregate_fn_name="latest_only",
        robot=SimRobotConfig(seed=seed, steps=steps, id=f"sim{seed}", calibration_dir=Path(tempfile.mkdtemp())))
    client = RobotClient(config)
    record = {"observations": [], "chunks": []}
    client.stub = RecordingStub(client.stub, record)
    assert client.start(), "the client could not start"
    receiver = threading.Thread(target=client.receive_actions, daemon=True)
    receiver.start()
    control = threading.Thread(target=client.control_loop, kwargs={"task": config.task}, daemon=True)
    control.start()
    finished = client.robot.done.wait(600)
    client.stop()
    control.join(30)
    receiver.join(30)
    record["performed"] = client.robot.performed
    record["finished"] = finished
    with open(out, "wb") as f:
        pickle.dump({"observations": [(o.timestamp, o.timestep, o.must_go, o.observation) for o in record["observations"]],
                     "chunks": [[(a.timestamp, a.timestep, a.action.numpy()) for a in chunk] for chunk in record["chunks"]],
                     "performed": record["performed"], "finished": finished}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
