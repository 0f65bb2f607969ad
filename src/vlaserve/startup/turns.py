"""Whose turn the device is while start-up captures CUDA graphs beside serving.

A graph's recording runs nothing on the device, and it is recorded in thread-local capture mode
(runtime/graphs.py `_Graph`): other threads may launch, query events and synchronize meanwhile, so a
recording needs no turn. A warm-up does: it runs a graph's kernels eagerly once, compiling or
loading them, holding the device lock (the runtime's), and a batch's launch waits for it. Left to the
lock alone, the capture thread, which has just released it, took it again graph after graph, and a
batch waited out several of them. The rule here:

- serving goes first: no warm-up starts while a serving thread waits for the lock;
- a warm-up starts beside a batch just launched (its host work overlaps that batch's device time),
  at most one per launch, or once no batch has run for IDLE_S (no robot is about to send);
- bounded: after FIRST_S a warm-up starts anyway, so a fleet that never leaves a gap still gets
  every graph captured.

Plain Python and threading: start-up's gate (startup/engine.py) calls `enqueued` / `collected` around
each batch and takes the device for a serving thread through `serving()`; the runner takes it for each
warm-up through `warm_up()`. Once start-up is done the runtime's gate is the plain device lock.
"""

from __future__ import annotations

import contextlib
import threading
import time


class DeviceTurns:
    IDLE_S = 0.02  # above a robot's round trip from its answer to its next request (~5 ms)
    FIRST_S = 0.5  # above a batch of 8 and its warm-up, so the rule holds under load

    def __init__(self, lock: threading.RLock | None = None):
        self.lock = lock if lock is not None else threading.RLock()  # the device lock (the runtime's)
        self._cond = threading.Condition()
        self._waiting = 0  # serving threads waiting for the lock
        self._in_flight = 0  # batches launched and not yet collected
        self._launches = 0
        self._launches_at_warm_up = 0
        self._idle_since = time.perf_counter()

    @contextlib.contextmanager
    def serving(self):
        """The device lock for a serving thread, ahead of the next warm-up."""
        with self._cond:
            self._waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def enqueued(self) -> None:
        with self._cond:
            self._in_flight += 1
            self._launches += 1
            self._cond.notify_all()

    def collected(self) -> None:
        with self._cond:
            self._in_flight = max(0, self._in_flight - 1)
            if not self._in_flight:
                self._idle_since = time.perf_counter()
            self._cond.notify_all()

    @contextlib.contextmanager
    def warm_up(self):
        """The device for a warm-up: once the rule below allows, holding the device lock."""
        self.before_warm_up()
        with self.lock:
            yield

    def before_warm_up(self) -> None:
        """Returns when the next warm-up may take the device (see the module docstring)."""
        with self._cond:
            deadline = time.perf_counter() + self.FIRST_S
            while True:
                now = time.perf_counter()
                idle_left = self.IDLE_S - (now - self._idle_since)  # meaningful with nothing in flight
                if not self._waiting:
                    if self._in_flight and self._launches != self._launches_at_warm_up:
                        break  # beside a fresh batch
                    if not self._in_flight and idle_left <= 0:
                        break
                if now >= deadline:
                    break
                wake = deadline - now
                if not self._waiting and not self._in_flight:
                    wake = min(wake, idle_left)
                self._cond.wait(wake)
            self._launches_at_warm_up = self._launches
