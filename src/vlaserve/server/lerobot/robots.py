"""One LeRobot robot's session (each gRPC peer its own), and how its setup and observations become
the server's Requests.

What LeRobot's policy server keeps per robot, kept here per session: the policy setup, one waiting
observation (a newer one replaces it), the timesteps already predicted, and the last observation
run. An observation is queued when it `must_go`, when none has run yet, or when its timestep was
not predicted and its state moved at least STATE_MOVED (L2) from the last one run.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...errors import InvalidInput
from ..openpi import request_from_openpi
from ..schema import ApiError
from .records import PolicyFeature, RemotePolicyConfig, TimedObservation

STATE_MOVED = 1.0  # LeRobot's policy server: closer than this to the last observation run is "similar"
STATE_KEY = "observation.state"
IMAGE_PREFIX = "observation.images."
# LeRobot dataset bookkeeping features, never observations.
BOOKKEEPING = frozenset({"timestamp", "frame_index", "episode_index", "index", "task_index"})
NOISE_KEYS = ("noise", "observation.noise")  # a vlaserve extension: the flow-matching noise, for reproducible runs
MAX_PREDICTED = 4096  # timesteps remembered per session


class SetupError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status  # "INVALID_ARGUMENT" or "FAILED_PRECONDITION"


def served_names(metadata: dict, checkpoint_arg: str | None) -> tuple[str, ...]:
    """The names a robot may give the served model: its served name, the checkpoint as `vlaserve
    serve` was given it (directory or hub id) and the directory's name."""
    names = [metadata["model"], Path(metadata["checkpoint"]).name]
    if checkpoint_arg:
        names += [checkpoint_arg.rstrip("/"), Path(checkpoint_arg).name]
    return tuple(dict.fromkeys(n for n in names if n))


def check_setup(config: RemotePolicyConfig, metadata: dict, names: tuple[str, ...], layout) -> dict:
    """The robot's setup against what this server serves; returns its observation features
    (key -> dataset feature), or raises SetupError."""
    if config.policy_type != metadata["policy_type"]:
        raise SetupError("FAILED_PRECONDITION", f"policy_type {config.policy_type!r}: this server serves a "
                                                f"{metadata['policy_type']} policy, {metadata['model']!r}")
    given = config.pretrained_name_or_path.rstrip("/")
    # A local path (the robot's copy of the checkpoint) names the model by its directory's name; a hub
    # id (owner/name) must be the very one served.
    local = given.startswith(("/", ".", "~"))
    if given not in names and not (local and Path(given).name in names):
        raise SetupError("FAILED_PRECONDITION", f"pretrained_name_or_path {given!r} is not what this server "
                                                f"serves: {' or '.join(map(repr, names))} (it loads nothing else)")
    features = {}
    for key, feature in config.lerobot_features.items():
        if not isinstance(key, str) or key in BOOKKEEPING or not key.startswith("observation"):
            continue
        if isinstance(feature, PolicyFeature) or not isinstance(feature, dict):
            raise SetupError("INVALID_ARGUMENT", f"lerobot_features[{key!r}]: expected a dataset feature "
                                                 "(dtype, shape, names), as robot_client sends")
        dtype, shape, names_ = feature.get("dtype"), feature.get("shape"), feature.get("names")
        if not isinstance(shape, (tuple, list)) or not all(type(n) is int for n in shape):
            raise SetupError("INVALID_ARGUMENT", f"lerobot_features[{key!r}].shape must be integers")
        if dtype == "float32" and len(shape) == 1:
            if not isinstance(names_, (list, tuple)) or len(names_) != shape[0] or not all(isinstance(n, str) for n in names_):
                raise SetupError("INVALID_ARGUMENT", f"lerobot_features[{key!r}].names must name its {shape[0]} values")
            features[key] = feature
        elif dtype in ("image", "video"):
            features[key] = feature
    renamed = {config.rename_map.get(key, key): None for key in features}
    try:  # every feature must reach a camera or the state, before any observation comes
        layout.canonical({**renamed, "task": ""})
    except InvalidInput as e:
        raise SetupError("INVALID_ARGUMENT", f"lerobot_features (after rename_map): {e.field}: {e.message}") from None
    return features


@dataclass(eq=False)  # hashed by identity: the batcher tracks its clients in a set
class RobotSession:
    peer: str
    config: RemotePolicyConfig | None = None
    features: dict = field(default_factory=dict)
    waiting: tuple | None = None  # (observation, its Request, its state)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    predicted: set = field(default_factory=set)
    last_state: np.ndarray | None = None

    def state_of(self, raw: dict) -> np.ndarray | None:
        """The state vector LeRobot's filter compares (None without a state feature)."""
        return _vector(raw, STATE_KEY, self.features[STATE_KEY]["names"]) if STATE_KEY in self.features else None

    def request(self, observation: TimedObservation, service):
        """The observation as a Request (ApiError if invalid): the features picked out of the raw
        robot dict as LeRobot's dataset frame does, renamed, then the server's own key layout."""
        raw = observation.observation
        frame = {}
        for key, feature in self.features.items():
            if feature["dtype"] == "float32":
                frame[key] = _vector(raw, key, feature["names"])
            else:
                name = key.removeprefix(IMAGE_PREFIX)
                if name not in raw:
                    raise ApiError(400, "invalid_observation", f"the robot observation lacks camera {name!r}", key)
                frame[key] = raw[name]
        frame = {self.config.rename_map.get(key, key): value for key, value in frame.items()}
        if "task" in raw:
            frame["task"] = raw["task"]
        for key in NOISE_KEYS:
            if key in raw:
                frame[key] = raw[key]
        request = request_from_openpi(frame, service)
        request.client = self
        return request

    def wants(self, observation: TimedObservation, state: np.ndarray | None) -> bool:
        """LeRobot's filter: must_go, the first, or a new timestep whose state moved."""
        if observation.must_go or self.last_state is None:
            return True
        if observation.timestep in self.predicted:
            return False
        return state is None or float(np.linalg.norm(state - self.last_state)) >= STATE_MOVED

    def offer(self, observation: TimedObservation, request, state) -> bool:
        if not self.wants(observation, state):
            return False
        self.waiting = (observation, request, state)
        self.arrived.set()
        return True

    async def take(self, timeout_s: float):
        """The waiting observation, once one is there (None after `timeout_s`); marks it run."""
        if self.waiting is None:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout_s)
            except TimeoutError:
                return None
        if self.waiting is None:
            return None
        observation, request, state = self.waiting
        self.waiting = None
        self.arrived.clear()
        if len(self.predicted) >= MAX_PREDICTED:
            self.predicted = set(sorted(self.predicted)[MAX_PREDICTED // 2:])
        self.predicted.add(observation.timestep)
        self.last_state = state if state is not None else np.zeros(0, np.float32)
        return observation, request


def _vector(raw: dict, key: str, names: list[str]) -> np.ndarray:
    """A float32 vector feature, its values picked out of the raw robot dict by name."""
    try:
        return np.array([raw[name] for name in names], dtype=np.float32)
    except KeyError as e:
        raise ApiError(400, "invalid_observation", f"the robot observation lacks {e.args[0]!r}, a name of "
                                                   f"lerobot_features[{key!r}]", key) from None
    except (TypeError, ValueError):
        raise ApiError(400, "invalid_observation", f"the values of {key} must be numbers", key) from None


class RobotSessions:
    """Sessions by gRPC peer, at most `limit`: a new robot evicts the one idle longest."""

    def __init__(self, limit: int):
        self.limit = limit
        self._sessions: OrderedDict[str, RobotSession] = OrderedDict()

    def reset(self, peer: str) -> RobotSession:
        self._sessions.pop(peer, None)
        while len(self._sessions) >= self.limit:
            self._sessions.popitem(last=False)
        session = self._sessions[peer] = RobotSession(peer)
        return session

    def get(self, peer: str) -> RobotSession | None:
        session = self._sessions.get(peer)
        if session is not None:
            self._sessions.move_to_end(peer)
        return session

    def __len__(self) -> int:
        return len(self._sessions)
