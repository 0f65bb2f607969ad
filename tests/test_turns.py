"""Whose turn the device is while CUDA graphs are captured beside serving (runtime/turns.py), and a
batch's wait meanwhile (runtime/runner.Launched): plain threads, no device."""

import threading
import time

import torch

from vlaserve.runtime.runner import HostTimed, Launched
from vlaserve.runtime.turns import DeviceTurns


def _until(condition, bound_s: float = 10.0) -> None:
    deadline = time.perf_counter() + bound_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.001)


def _capturing_turns() -> DeviceTurns:
    turns = DeviceTurns()
    turns.capturing = True
    return turns


def _idle_turns(**bounds) -> DeviceTurns:
    turns = _capturing_turns()
    for name, value in bounds.items():
        setattr(turns, name, value)
    turns._idle_since -= 1.0  # serving has been idle for a second
    return turns


def test_a_capture_waits_behind_a_serving_thread_that_waits_for_the_device():
    turns, order = _idle_turns(FIRST_S=30.0), []  # the bound far above the 0.2 s this test watches

    def serve():
        with turns.serving():
            order.append("batch")

    def capture():
        turns.before_capture()
        order.append("capture")

    with turns.lock:  # a batch on the device
        batch = threading.Thread(target=serve)
        batch.start()
        _until(lambda: turns._waiting == 1)
        capturer = threading.Thread(target=capture)
        capturer.start()
        capturer.join(0.2)
        assert capturer.is_alive() and order == []
    batch.join(10)
    capturer.join(10)
    assert order == ["batch", "capture"] and turns._waiting == 0


def test_one_capture_beside_each_launched_batch_then_after_serving_went_idle():
    # FIRST_S far above every wait here, so only the rule under test can end one; "at once" below
    # means well under IDLE_S = 0.5 s, the shortest wait the rule could have imposed instead.
    turns = _idle_turns(IDLE_S=0.5, FIRST_S=30.0)
    started = time.perf_counter()
    turns.before_capture()  # idle for long: at once
    turns.launched()
    turns.before_capture()  # beside the fresh batch: at once
    assert time.perf_counter() - started < 0.25

    second = threading.Thread(target=turns.before_capture)  # that batch already has its capture
    second.start()
    second.join(0.1)
    assert second.is_alive()
    turns.launched()  # the next batch: the capture goes beside it
    second.join(10)
    assert not second.is_alive()

    turns.collected()
    turns.collected()  # nothing in flight: wait until serving has been idle IDLE_S
    started = time.perf_counter()
    turns.before_capture()
    assert 0.45 < time.perf_counter() - started < 10  # IDLE_S, less timer granularity; the upper bound only catches a hang


def test_a_capture_waits_at_most_first_s():
    turns = _idle_turns(FIRST_S=0.05)
    def serve():
        with turns.serving():
            pass

    with turns.lock:  # a batch that keeps the device while a serving thread waits for it
        waiter = threading.Thread(target=serve)
        waiter.start()
        _until(lambda: turns._waiting == 1)
        started = time.perf_counter()
        turns.before_capture()  # a serving thread still waits: bounded all the same
        assert 0.04 < time.perf_counter() - started < 5
    waiter.join(10)


class _Event:
    """A CUDA event stand-in: done at its `after`-th query; notes whether the lock was held."""

    def __init__(self, turns: DeviceTurns, after: int = 3):
        self.turns, self.left, self.calls = turns, after, []

    def query(self):
        self.calls.append(("query", self.turns.lock._is_owned()))
        self.left -= 1
        return self.left <= 0

    def synchronize(self):
        self.calls.append(("synchronize", self.turns.lock._is_owned()))


class _Stages:
    def __init__(self, turns: DeviceTurns, calls: list):
        self.turns, self.calls = turns, calls

    def read(self):
        self.calls.append(("read", self.turns.lock._is_owned()))
        return {}


def test_a_wait_polls_while_graphs_are_captured_and_reads_in_the_same_hold():
    turns = _capturing_turns()
    event = _Event(turns)
    launched = Launched(torch.zeros(1), event, _Stages(turns, event.calls), turns)
    assert turns._in_flight == 1
    launched.wait()
    assert event.calls == [("query", True)] * 3 + [("synchronize", True), ("read", True)]
    assert turns._in_flight == 0

    turns = DeviceTurns()  # nothing captured: block on the event, no lock
    event = _Event(turns)
    Launched(torch.zeros(1), event, _Stages(turns, event.calls), turns).wait()
    assert event.calls == [("synchronize", False), ("read", False)]


def test_a_host_batch_counts_as_launched_and_collected():
    turns = _capturing_turns()  # (counted only while graphs may be captured)
    launched = Launched(torch.zeros(2), None, HostTimed({"prefix_ms": 1.0}), turns)
    assert turns._in_flight == 1
    actions, stages = launched.wait()
    assert actions.shape == (2,) and stages == {"prefix_ms": 1.0} and turns._in_flight == 0
