"""Our own versions of the LeRobot classes its robot_client pickles (lerobot.async_inference.helpers,
lerobot.configs.types), and the checks that turn what a pickle built into them.

A LeRobot dataclass arrives as NEWOBJ of its class (our `Record` stand-in here) and a BUILD of its
fields; an enum as a call of its class with its value. Nothing here is LeRobot's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

MAX_TEXT = 1024  # a policy type, checkpoint name, device or feature name
MAX_ENTRIES = 256  # features, names of a feature, rename_map entries
MAX_TIMESTEP = 2**62


class FeatureType(str, Enum):
    STATE = "STATE"
    VISUAL = "VISUAL"
    ENV = "ENV"
    ACTION = "ACTION"
    REWARD = "REWARD"
    LANGUAGE = "LANGUAGE"


@dataclass(frozen=True)
class PolicyFeature:
    type: FeatureType
    shape: tuple


@dataclass(frozen=True)
class RemotePolicyConfig:
    policy_type: str
    pretrained_name_or_path: str
    lerobot_features: dict  # key -> LeRobot dataset feature {"dtype", "shape", "names", ...} or PolicyFeature
    actions_per_chunk: int
    device: str
    rename_map: dict


@dataclass(frozen=True)
class TimedObservation:
    timestamp: float
    timestep: int
    observation: dict  # raw robot keys -> ndarray, number or str; "task"
    must_go: bool


class Record:
    """A pickled LeRobot dataclass: BUILD hands it the fields, `materialize` checks them."""

    fields_: tuple[str, ...] = ()
    optional: dict = {}

    def __setstate__(self, state):
        if not isinstance(state, dict) or not all(type(k) is str for k in state):
            raise ValueError(f"{type(self).__name__}'s fields must be a dict")
        unknown = sorted(set(state) - set(self.fields_))
        missing = sorted(set(self.fields_) - set(state) - set(self.optional))
        if unknown or missing:
            raise ValueError(f"{type(self).__name__}: unknown fields {unknown}, missing {missing}")
        self.state = {**self.optional, **state}

    def materialize(self, convert):
        if not hasattr(self, "state"):
            raise ValueError(f"{type(self).__name__} without its fields")
        return self.build({k: convert(v) for k, v in self.state.items()})


class PickledPolicyFeature(Record):
    fields_ = ("type", "shape")

    def build(self, f):
        if not isinstance(f["type"], FeatureType) or not _int_tuple(f["shape"]):
            raise ValueError("PolicyFeature needs a FeatureType and a shape of integers")
        return PolicyFeature(f["type"], tuple(f["shape"]))


class PickledRemotePolicyConfig(Record):
    fields_ = ("policy_type", "pretrained_name_or_path", "lerobot_features", "actions_per_chunk", "device",
               "rename_map")
    optional = {"device": "cpu", "rename_map": {}}

    def build(self, f):
        for name in ("policy_type", "pretrained_name_or_path", "device"):
            _text(f[name], name)
        features, rename = f["lerobot_features"], f["rename_map"]
        if not isinstance(features, dict) or len(features) > MAX_ENTRIES:
            raise ValueError(f"lerobot_features must be a dict of at most {MAX_ENTRIES} features")
        if (not isinstance(rename, dict) or len(rename) > MAX_ENTRIES
                or not all(isinstance(v, str) and len(v) <= MAX_TEXT for v in rename.values())):
            raise ValueError(f"rename_map must map at most {MAX_ENTRIES} keys to keys")
        count = f["actions_per_chunk"]
        if type(count) is not int or not 1 <= count <= 10_000:
            raise ValueError("actions_per_chunk must be an integer in [1, 10000]")
        return RemotePolicyConfig(f["policy_type"], f["pretrained_name_or_path"], features, count, f["device"],
                                  rename)


class PickledTimedObservation(Record):
    fields_ = ("timestamp", "timestep", "observation", "must_go")
    optional = {"must_go": False}

    def build(self, f):
        timestamp, timestep = f["timestamp"], f["timestep"]
        if type(timestamp) not in (int, float) or not math.isfinite(timestamp):
            raise ValueError("timestamp must be a finite number")
        if type(timestep) is not int or not 0 <= timestep <= MAX_TIMESTEP:
            raise ValueError(f"timestep must be an integer in [0, {MAX_TIMESTEP}]")
        if type(f["must_go"]) is not bool:
            raise ValueError("must_go must be true or false")
        if not isinstance(f["observation"], dict):
            raise ValueError("observation must be a dict")
        return TimedObservation(float(timestamp), timestep, f["observation"], f["must_go"])


def _text(value, name: str) -> None:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"{name} must be a string of at most {MAX_TEXT} characters")


def _int_tuple(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) <= 8 and all(type(n) is int and n >= 0 for n in value)


HELPERS = "lerobot.async_inference.helpers"
TYPES = "lerobot.configs.types"
# The LeRobot names a pickle may use -> our stand-ins (pickles.ALLOWED takes them in).
PICKLED_NAMES = {
    (HELPERS, "TimedObservation"): PickledTimedObservation,
    (HELPERS, "RemotePolicyConfig"): PickledRemotePolicyConfig,
    (TYPES, "PolicyFeature"): PickledPolicyFeature,
    (TYPES, "FeatureType"): FeatureType,
}
