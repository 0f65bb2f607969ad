"""The one thing the engine's enqueue path reads of start-up: a gate.

`Runtime.enqueue` enters its gate around each enqueue (`entering`: the device lock, and whatever waiting
start-up still asks of the call) and tells it when a batch is `enqueued` and `collected`. Start-up
(vlaserve/startup/) closes the gate with one of its own while it captures graphs beside serving, and
opens it again when it is done: from then on an enqueue takes the device lock and nothing else.
"""

from __future__ import annotations

import threading
from typing import ContextManager, Protocol

from ..errors import NotServing


class Gate(Protocol):
    def entering(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool) -> ContextManager:
        """Held around one enqueue: the device lock, once the call may run."""

    def enqueued(self) -> None:
        """A batch was enqueued."""

    def collected(self) -> None:
        """A batch's results were waited for."""


class OpenGate:
    """The gate of an engine no start-up holds: the device lock, nothing else."""

    def __init__(self, lock: threading.RLock):
        self.lock = lock

    def entering(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool) -> ContextManager:
        return self.lock

    def enqueued(self) -> None:
        pass

    def collected(self) -> None:
        pass


class ClosedGate:
    """The gate of an engine whose start-up failed before it could serve: every enqueue is refused, saying why."""

    def __init__(self, reason: str):
        self.reason = reason

    def entering(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool) -> ContextManager:
        raise NotServing(self.reason)

    def enqueued(self) -> None:
        pass

    def collected(self) -> None:
        pass
