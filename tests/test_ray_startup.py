"""A `serve-ray` replica is ready (its constructor returns, Ray routes to it) as soon as its runtime
serves, before its last CUDA graph is captured. A CPU has no graphs to capture, so the runtime here
is a fake whose background warm-up captures each graph only when the test lets it; the replica's
loading (fleet/replica.py: load_until_serving, wait_until_serving) runs as written against it.
Skipped when Ray is not installed."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("ray")

from vlaserve.fleet import replica  # noqa: E402
from vlaserve.options import serve_options  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's, on importing it
GRAPHS = 3


class CapturingRuntime:
    """A background warm-up of GRAPHS captures, each waiting for its gate; the runtime serves from
    the first on ("capturing", `serving` set), and is "ready" after the last."""

    def __init__(self, with_event: bool = True, fails: bool = False):
        self.state, self.captured = "warming_up", 0
        if with_event:
            self.serving = threading.Event()
        self.gates = [threading.Event() for _ in range(GRAPHS)]
        self.fails = fails
        threading.Thread(target=self._warm_up, daemon=True).start()

    def _warm_up(self) -> None:
        for gate in self.gates:
            gate.wait()
            if self.fails:  # a failed warm-up leaves "warming_up" without serving on graphs
                self.state = "ready"
                return
            self.captured += 1
            if self.captured == 1:
                self.state = "capturing"
                if hasattr(self, "serving"):
                    self.serving.set()
        self.state = "ready"

    def finish(self) -> None:
        for gate in self.gates:
            gate.set()


def waiter(runtime) -> threading.Thread:
    thread = threading.Thread(target=replica.wait_until_serving, args=(runtime, 0.01), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("with_event", [True, False], ids=["serving-event", "state-only"])
def test_the_wait_ends_when_batch_one_is_captured_not_the_last_graph(with_event):
    runtime = CapturingRuntime(with_event)
    try:
        waiting = waiter(runtime)
        waiting.join(0.3)
        assert waiting.is_alive() and runtime.captured == 0  # nothing captured: not ready
        runtime.gates[0].set()
        waiting.join()
        assert runtime.state == "capturing" and runtime.captured < GRAPHS
    finally:
        runtime.finish()


def test_a_failed_warm_up_ends_the_wait_too():
    runtime = CapturingRuntime(fails=True)
    waiting = waiter(runtime)
    runtime.finish()
    waiting.join()
    assert runtime.state == "ready" and runtime.captured == 0


def test_a_replica_loads_in_the_background_and_is_ready_before_its_last_capture(monkeypatch, golden):
    """The replica's constructor runs load_until_serving: the policy is built with a background
    warm-up (whatever the config says), and it returns once batch 1 serves."""
    runtime = CapturingRuntime()
    built = {}

    class FakePolicy:
        def __init__(self):
            self.runtime = runtime

    def build_service(options, progress=True, **overrides):
        built.update(overrides, progress=progress)
        runtime.gates[0].set()  # the batch-1 graph is captured while the constructor waits
        return FakePolicy(), "settings"

    monkeypatch.setattr(replica, "build_service", build_service)
    options = serve_options({"checkpoint": str(golden / "checkpoint"), "device": "cpu", "warmup": "background"})
    try:
        policy, settings = replica.load_until_serving(options)
        assert built == {"progress": False} and settings == "settings"
        assert policy.runtime.state == "capturing" and policy.runtime.captured < GRAPHS
    finally:
        runtime.finish()
