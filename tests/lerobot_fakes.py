"""Test-side stand-ins for the LeRobot classes robot_client pickles, under LeRobot's module names, so
tests can make the pickles an unmodified client sends (and read the replies) without LeRobot, which
needs Python 3.12. The real client runs in tests/test_lerobot_client.py."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from enum import Enum

import grpc
import torch

from vlaserve.server.lerobot import wire


@dataclass
class TimedData:
    timestamp: float
    timestep: int


@dataclass
class TimedAction(TimedData):
    action: torch.Tensor


@dataclass
class TimedObservation(TimedData):
    observation: dict
    must_go: bool = False


@dataclass
class RemotePolicyConfig:
    policy_type: str
    pretrained_name_or_path: str
    lerobot_features: dict
    actions_per_chunk: int
    device: str = "cpu"
    rename_map: dict = field(default_factory=dict)


class FeatureType(str, Enum):
    STATE = "STATE"
    VISUAL = "VISUAL"


@dataclass
class PolicyFeature:
    type: FeatureType
    shape: tuple


def _install() -> None:
    if "lerobot.async_inference.helpers" in sys.modules:
        return
    for name in ("lerobot", "lerobot.async_inference", "lerobot.configs"):
        sys.modules[name] = types.ModuleType(name)
    helpers = sys.modules["lerobot.async_inference.helpers"] = types.ModuleType("lerobot.async_inference.helpers")
    types_ = sys.modules["lerobot.configs.types"] = types.ModuleType("lerobot.configs.types")
    for cls in (TimedData, TimedAction, TimedObservation, RemotePolicyConfig):
        cls.__module__ = helpers.__name__
        setattr(helpers, cls.__name__, cls)
    for cls in (FeatureType, PolicyFeature):
        cls.__module__ = types_.__name__
        setattr(types_, cls.__name__, cls)


_install()


class WireClient:
    """LeRobot's stub calls, made by hand over one channel (one gRPC peer: one robot session)."""

    def __init__(self, address: str):
        # Its own connection, as a robot in its own process has: the server tells robots apart by it.
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 4 * 2**20),
                                                               ("grpc.use_local_subchannel_pool", 1)])
        call = self.channel.unary_unary
        path = f"/{wire.SERVICE}/"
        self.Ready = call(path + "Ready", wire.Empty.SerializeToString, wire.Empty.FromString)
        self.GetActions = call(path + "GetActions", wire.Empty.SerializeToString, wire.Actions.FromString)
        self.SendPolicyInstructions = call(path + "SendPolicyInstructions", wire.PolicySetup.SerializeToString,
                                           wire.Empty.FromString)
        self.SendObservations = self.channel.stream_unary(path + "SendObservations", wire.Observation.SerializeToString,
                                                          wire.Empty.FromString)

    def send(self, data: bytes, chunk: int = 2 * 2**20, timeout: float = 30):
        """As LeRobot's send_bytes_in_chunks: END on the last piece, BEGIN on a first that is not last."""
        pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)]
        states = [wire.TRANSFER_END if i == len(pieces) - 1 else wire.TRANSFER_BEGIN if i == 0 else wire.TRANSFER_MIDDLE
                  for i in range(len(pieces))]
        return self.SendObservations(iter(wire.Observation(transfer_state=s, data=p) for s, p in zip(states, pieces)),
                                     timeout=timeout)

    def close(self):
        self.channel.close()
