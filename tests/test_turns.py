"""Whose turn the device is while start-up captures CUDA graphs beside serving (startup/turns.py: a warm-up's),
and a batch's wait meanwhile (runtime/runner.Enqueued): plain threads, no device."""

import threading
import time

import pytest
import torch

from vlaserve.runtime.gate import OpenGate
from vlaserve.runtime.runner import HostTimed, Enqueued
from vlaserve.startup.turns import DeviceTurns


def _until(condition, bound_s: float = 10.0) -> None:
    deadline = time.perf_counter() + bound_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.001)


def _idle_turns(**bounds) -> DeviceTurns:
    turns = DeviceTurns()
    for name, value in bounds.items():
        setattr(turns, name, value)
    turns._idle_since -= 1.0  # serving has been idle for a second
    return turns


def test_a_warm_up_waits_behind_a_serving_thread_that_waits_for_the_device():
    turns, order = _idle_turns(FIRST_S=30.0), []  # the bound far above the 0.2 s this test watches

    def serve():
        with turns.serving():
            order.append("batch")

    def warm_up():
        turns.before_warm_up()
        order.append("warm-up")

    with turns.lock:  # a batch on the device
        batch = threading.Thread(target=serve)
        batch.start()
        _until(lambda: turns._waiting == 1)
        warmer = threading.Thread(target=warm_up)
        warmer.start()
        warmer.join(0.2)
        assert warmer.is_alive() and order == []
    batch.join(10)
    warmer.join(10)
    assert order == ["batch", "warm-up"] and turns._waiting == 0


def test_one_warm_up_beside_each_launched_batch_then_after_serving_went_idle():
    # FIRST_S far above every wait here, so only the rule under test can end one; "at once" below
    # means well under IDLE_S = 0.5 s, the shortest wait the rule could have imposed instead.
    turns = _idle_turns(IDLE_S=0.5, FIRST_S=30.0)
    started = time.perf_counter()
    turns.before_warm_up()  # idle for long: at once
    turns.enqueued()
    turns.before_warm_up()  # beside the fresh batch: at once
    assert time.perf_counter() - started < 0.25

    second = threading.Thread(target=turns.before_warm_up)  # that batch already has its warm-up
    second.start()
    second.join(0.1)
    assert second.is_alive()
    turns.enqueued()  # the next batch: the warm-up goes beside it
    second.join(10)
    assert not second.is_alive()

    turns.collected()
    turns.collected()  # nothing in flight: wait until serving has been idle IDLE_S
    started = time.perf_counter()
    turns.before_warm_up()
    assert 0.45 < time.perf_counter() - started < 10  # IDLE_S, less timer granularity; the upper bound only catches a hang


def test_a_warm_up_waits_at_most_first_s():
    turns = _idle_turns(FIRST_S=0.05)
    def serve():
        with turns.serving():
            pass

    with turns.lock:  # a batch that keeps the device while a serving thread waits for it
        waiter = threading.Thread(target=serve)
        waiter.start()
        _until(lambda: turns._waiting == 1)
        started = time.perf_counter()
        turns.before_warm_up()  # a serving thread still waits: bounded all the same
        assert 0.04 < time.perf_counter() - started < 5
    waiter.join(10)


class _Event:
    """A CUDA event stand-in that notes whether the device lock was held when asked."""

    def __init__(self, turns: DeviceTurns):
        self.turns, self.calls = turns, []

    def query(self):
        self.calls.append(("query", self.turns.lock._is_owned()))
        return True

    def synchronize(self):
        self.calls.append(("synchronize", self.turns.lock._is_owned()))


class _Stages:
    def __init__(self, turns: DeviceTurns, calls: list):
        self.turns, self.calls = turns, calls

    def read(self):
        self.calls.append(("read", self.turns.lock._is_owned()))
        return {}


@pytest.mark.parametrize("during_startup", [True, False])
def test_a_wait_blocks_on_its_event_without_the_device_lock(during_startup):
    """Graphs are recorded in thread-local mode, so a batch's wait needs no lock while they are, nor polls;
    behind start-up's gate (its turns count the batch in flight) or the open one (the plain device lock)."""
    turns = DeviceTurns()
    gate = turns if during_startup else OpenGate(turns.lock)
    event = _Event(turns)
    launched = Enqueued(torch.zeros(1), event, _Stages(turns, event.calls), gate)
    assert turns._in_flight == int(during_startup)
    launched.wait()
    assert event.calls == [("synchronize", False), ("read", False)] and turns._in_flight == 0
    assert launched.done() and event.calls[-1] == ("query", False)


def test_a_host_batch_counts_as_launched_and_collected():
    turns = DeviceTurns()
    launched = Enqueued(torch.zeros(2), None, HostTimed({"prefix_ms": 1.0}), turns)
    assert turns._in_flight == 1
    actions, stages = launched.wait()
    assert actions.shape == (2,) and stages == {"prefix_ms": 1.0} and turns._in_flight == 0
