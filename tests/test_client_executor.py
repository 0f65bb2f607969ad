"""ActionChunkExecutor against the scripted fake server, on a fake clock.

Ticks are get_action calls; the test advances the fake clock by one control period per tick and
holds replies back with gates, so every index below is exact: no test depends on how fast this
machine runs. Chunk n has action[i] = [100 n + i, -(100 n + i)] (client_fakes.chunk), so `decode`
tells which request and index each action came from.

Setup shared by the tests: chunk length H = 20, execution_horizon h = 8, 50 Hz (20 ms a tick).
The first request "takes" 50 ms of fake time (2.5 ticks), so the first delay estimate is
ceil(2.5) + 1 margin tick = 4. Chunk 1 covers ticks 0..19; 8 actions are left at tick 12, so the
request for chunk 2 goes out on tick 12 with prev_chunk = chunk1[12:20].
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from client_fakes import HORIZON, FakeClock, FakeServer, Scripted, chunk, decode, wait_until

from vlaserve_client import ActionChunkExecutor, Client, ExecutorError

HZ, H, EXEC_H, TRIGGER = 50.0, HORIZON, 8, HORIZON - 8
FAST = {"backoff_initial": 0.01, "backoff_max": 0.05}


def observation(tick: int) -> dict:
    return {"images": {"base_0_rgb": np.full((4, 4, 3), tick % 256, np.uint8)},
            "state": np.full(3, tick, np.float32), "task": "wipe the table"}


class Robot:
    """Calls get_action once per tick and moves the fake clock on by one control period."""

    def __init__(self, server: FakeServer, **options):
        self.clock = FakeClock()
        self.server = server
        server.script.insert(0, Scripted(before_reply=lambda: self.clock.advance(0.05)))
        self.client = Client(server.url, **FAST, **options.pop("client", {}))
        self.executor = ActionChunkExecutor(self.client, control_hz=HZ, execution_horizon=EXEC_H,
                                            clock=self.clock, **options)
        self.executor.start(observation(0))
        self.tick = 0
        self.actions: list[np.ndarray] = []

    def run(self, ticks: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(ticks):
            ex = self.executor
            idle, handled = not ex._in_flight, ex.stats.requests + ex.stats.stale_dropped
            action = ex.get_action(observation(self.tick))
            self.actions.append(action)
            out.append(decode(action))
            if idle and ex._in_flight:
                # A request must go out within one tick of its observation; the fake clock only moves
                # here, so let the worker send it first (else it is dropped as stale, see below).
                wait_until(lambda: ex.stats.requests + ex.stats.stale_dropped > handled, what="the request sent")
            self.tick += 1
            self.clock.advance(1 / HZ)
        return out

    def wait_for_chunk(self, n: int) -> None:
        wait_until(lambda: self.executor.stats.chunks >= n, what=f"chunk {n} installed")


@pytest.fixture()
def server():
    with FakeServer() as s:
        yield s


def test_indices_remainder_and_delay_estimate(server):
    gate = threading.Event()
    server.script.append(Scripted(gate=gate))
    robot = Robot(server)
    assert robot.run(TRIGGER) == [(1, i) for i in range(TRIGGER)]
    assert len(server.requests) == 1  # nothing asked before 8 actions are left
    assert robot.run(5) == [(1, i) for i in range(TRIGGER, TRIGGER + 5)]  # ticks 12..16: reply held back
    request = server.wait_for_requests(2)
    np.testing.assert_array_equal(request["rtc"]["prev_chunk"], chunk(1)[TRIGGER:])  # incl. tick 12's action
    assert request["rtc"]["inference_delay"] == 4 and request["rtc"]["execution_horizon"] == EXEC_H
    assert request["rtc"]["space"] == "action"
    np.testing.assert_array_equal(request["input"]["observation"]["state"], observation(TRIGGER)["state"])
    gate.set()
    robot.wait_for_chunk(2)
    # 5 ticks (12..16) passed: chunk 2's index 0 is tick 12, so tick 17 runs index 5.
    assert robot.run(8) == [(2, i) for i in range(5, 13)]
    switch = [e for e in robot.executor.events if e.kind == "switch"]
    assert [(e.tick, e.detail["index"], e.detail["inference_delay"]) for e in switch][:1] == [(17, 5, 4)]
    stats = robot.executor.stats
    assert stats.delay_underestimates == 1  # used at index 5 after promising 4
    assert stats.inference_delay == 6       # 100 ms = 5 ticks, + 1
    # Chunk 2 began at tick 12, so 8 actions are left at tick 24: the next request carries the new estimate.
    request = server.wait_for_requests(3)
    np.testing.assert_array_equal(request["rtc"]["prev_chunk"], chunk(2)[TRIGGER:])
    assert request["rtc"]["inference_delay"] == 6
    stats = robot.executor.stats
    assert stats.underrun_ticks == 0 and stats.rtc_active and stats.rtc_requests == 2
    robot.executor.close()


@pytest.mark.parametrize("policy", ["repeat", "hold"])
def test_late_reply_runs_the_old_chunk_out_then_repeats_or_holds(server, policy):
    gate = threading.Event()
    server.script.append(Scripted(gate=gate))
    options = {"on_underrun": policy, "hold_action": [0.5, 0.5]} if policy == "hold" else {}
    robot = Robot(server, **options)
    assert robot.run(H) == [(1, i) for i in range(H)]  # ticks 0..19: the whole first chunk
    robot.run(3)                                        # ticks 20..22: nothing planned
    expected = chunk(1)[H - 1] if policy == "repeat" else np.array([0.5, 0.5], np.float32)
    for action in robot.actions[-3:]:
        np.testing.assert_array_equal(action, expected)
    assert robot.executor.stats.underrun_ticks == 3
    gate.set()
    robot.wait_for_chunk(2)
    assert robot.run(2) == [(2, 11), (2, 12)]  # requested on tick 12; tick 23 is index 11
    stats = robot.executor.stats
    assert (stats.late_replies, stats.underrun_ticks) == (1, 3)
    # (tick 24 sent request 3, whose switch may already be in too)
    assert [(e.kind, e.tick) for e in robot.executor.events][:2] == [("underrun", 20), ("switch", 23)]
    assert robot.executor.events[1].detail["late"] is True
    robot.executor.close()


def test_a_delay_longer_than_the_remainder_pads_prev_chunk_with_the_held_action(server):
    gate = threading.Event()
    server.script.append(Scripted(gate=gate))
    robot = Robot(server, on_underrun="hold", hold_action=[0.5, -0.5])
    robot.run(TRIGGER + 10)  # chunk 2 arrives on tick 22: 10 ticks = 200 ms, delay 11 > 8 left
    gate.set()
    robot.wait_for_chunk(2)
    robot.run(H)  # tick 24 (8 left of chunk 2, which started at tick 12) sends request 3
    request = server.wait_for_requests(3)
    prev = request["rtc"]["prev_chunk"]
    np.testing.assert_array_equal(prev[:8], chunk(2)[TRIGGER:])
    np.testing.assert_array_equal(prev[8:], np.tile([0.5, -0.5], (3, 1)))
    assert (request["rtc"]["inference_delay"], request["rtc"]["execution_horizon"]) == (11, 11)
    robot.executor.close()


def test_a_reply_older_than_its_chunk_is_dropped_and_asked_again(server):
    gate = threading.Event()
    server.script.append(Scripted(gate=gate))
    robot = Robot(server)
    robot.run(TRIGGER + H)  # ticks 0..31: the reply for tick 12 would start at index 20 = H
    gate.set()
    wait_until(lambda: robot.executor.stats.stale_dropped == 1, what="stale reply")
    assert robot.executor.events[-1].kind == "stale_dropped" and robot.executor.events[-1].detail["stage"] == "reply"
    robot.run(1)  # tick 32 asks again. The old chunk has run out: the robot will hold its last action
    request = server.wait_for_requests(3)
    # The stale reply measured 400 ms = 20 ticks (+1), capped at H: guide all of it toward the hold.
    assert (request["rtc"]["inference_delay"], request["rtc"]["execution_horizon"]) == (H, H)
    np.testing.assert_array_equal(request["rtc"]["prev_chunk"], np.repeat(chunk(1)[-1:], H, axis=0))
    np.testing.assert_array_equal(request["input"]["observation"]["state"], observation(32)["state"])
    robot.wait_for_chunk(2)
    assert robot.run(1) == [(3, 1)]
    robot.executor.close()


def test_falls_back_to_plain_switching_when_the_server_refuses_rtc():
    with FakeServer(rtc=False) as server:
        robot = Robot(server)
        robot.run(TRIGGER + 1)
        wait_until(lambda: not robot.executor.stats.rtc_active, what="the refusal")
        robot.run(1)
        robot.wait_for_chunk(2)
        # Request 2 (with rtc) was refused; request 3 goes out on the next tick, without it, with that tick's observation.
        assert "rtc" in server.requests[1] and "rtc" not in server.requests[2]
        np.testing.assert_array_equal(server.requests[2]["input"]["observation"]["state"],
                                      observation(TRIGGER + 1)["state"])
        stats = robot.executor.stats
        assert not stats.rtc_active and "invalid_request at rtc" in stats.rtc_disabled_reason
        robot.run(H)
        server.wait_for_requests(4)
        assert all("rtc" not in r for r in server.requests[2:]) and len(server.requests) >= 4
        assert robot.executor.error is None
        robot.executor.close()


def test_metadata_flag_turns_rtc_off_up_front():
    with FakeServer(metadata={"features": {"rtc": False}}) as server:
        robot = Robot(server)
        robot.run(TRIGGER + 1)
        robot.wait_for_chunk(2)
        assert len(server.requests) == 2 and "rtc" not in server.requests[1]
        assert "features.rtc" in robot.executor.stats.rtc_disabled_reason
        robot.executor.close()


def test_dropped_connection_asks_again_with_a_fresh_observation(server):
    server.script.append(Scripted(drop=True))
    robot = Robot(server)
    robot.run(TRIGGER + 1)  # tick 12 sends request 2, which is dropped
    wait_until(lambda: robot.executor.stats.reconnects == 1, what="the drop, then the reconnect")
    robot.run(1)            # tick 13 asks again
    request = server.wait_for_requests(3)
    np.testing.assert_array_equal(request["input"]["observation"]["state"], observation(TRIGGER + 1)["state"])
    np.testing.assert_array_equal(request["rtc"]["prev_chunk"], chunk(1)[TRIGGER + 1:])
    robot.wait_for_chunk(2)
    assert robot.run(1)[0][0] == 3
    stats = robot.executor.stats
    assert (stats.connection_failures, stats.reconnects, stats.underrun_ticks) == (1, 1, 0)
    assert [e.kind for e in robot.executor.events] == ["connection_failed", "reconnected", "switch"]
    robot.executor.close()


def test_no_observation_is_read_or_sent_during_an_outage_only_a_fresh_one_after_it(server):
    robot = Robot(server)
    server.stop()
    robot.run(TRIGGER + 1)  # tick 12's request goes out on a socket the server has closed
    wait_until(lambda: robot.executor.stats.connection_failures == 1, what="the lost connection")
    reads = []
    for _ in range(10):     # ticks 13..22: the worker probes the dead port; no request is due, nothing is read
        robot.executor.get_action(lambda: reads.append(robot.tick))
        robot.tick += 1
        robot.clock.advance(1 / HZ)
    stats = robot.executor.stats
    assert reads == [] and (stats.outage_ticks, stats.underrun_ticks) == (10, 3)  # chunk 1 ended on tick 19
    assert len(server.requests) == 1  # tick 12's request died with the connection, unanswered
    server.start()          # same port
    wait_until(lambda: robot.executor.stats.reconnects == 1, what="the probe finds the server")
    robot.run(1)            # tick 23: the first request after the outage carries tick 23's observation
    request = server.wait_for_requests(2)
    np.testing.assert_array_equal(request["input"]["observation"]["state"], observation(23)["state"])
    robot.wait_for_chunk(2)
    assert robot.run(1) == [(2, 1)]  # tick 24 = index 1 of the chunk asked for on tick 23
    stats = robot.executor.stats
    assert (stats.reconnects, stats.late_replies, stats.outage_ticks, robot.executor.error) == (1, 1, 10, None)
    assert [e.detail["outage_ticks"] for e in robot.executor.events if e.kind == "reconnected"] == [10]
    robot.executor.close()


def test_a_request_the_worker_could_not_send_within_a_tick_is_dropped_unsent(server):
    robot = Robot(server)
    robot.run(TRIGGER)
    with robot.executor._lock:  # the worker cannot take the request until the clock is two ticks on
        robot.executor.get_action(observation(TRIGGER))
        robot.clock.advance(2 / HZ)
    wait_until(lambda: robot.executor.stats.stale_dropped == 1, what="the drop")
    event = robot.executor.events[-1]
    assert (event.kind, event.detail["stage"], event.detail["age_ms"]) == ("stale_dropped", "unsent", 40.0)
    assert len(server.requests) == 1  # never sent
    robot.tick = TRIGGER + 2
    robot.run(1)  # tick 13 (the clock says 14) asks again with its own observation
    request = server.wait_for_requests(2)
    np.testing.assert_array_equal(request["input"]["observation"]["state"], observation(TRIGGER + 2)["state"])
    robot.executor.close()


def test_a_reply_past_the_staleness_bound_is_dropped_even_with_actions_left(server):
    gate = threading.Event()
    server.script.append(Scripted(gate=gate))
    robot = Robot(server, max_staleness_s=0.1)  # 5 ticks
    robot.run(TRIGGER + 6)  # the reply comes 6 ticks (120 ms) after its observation: index 6 < H, but stale
    gate.set()
    wait_until(lambda: robot.executor.stats.stale_dropped == 1, what="the stale reply")
    assert robot.executor.events[-1].detail["stage"] == "reply" and robot.executor.stats.chunks == 1
    assert robot.run(1) == [(1, TRIGGER + 6)]  # chunk 1 still runs; this tick asks again
    server.wait_for_requests(3)
    robot.executor.close()


def test_close_with_the_server_gone_returns_at_once_and_leaves_no_thread():
    server = FakeServer().start()
    robot = Robot(server)
    server.stop()
    robot.run(TRIGGER + 1)
    wait_until(lambda: robot.executor.stats.connection_failures == 1, what="the lost connection")
    started = time.monotonic()
    robot.executor.close()
    # The bound (1 s); the worker only waits on a condition between probes, so this takes ms.
    assert time.monotonic() - started <= 1.0
    assert not robot.executor._worker.is_alive()  # so nothing can be sent after close
    assert not robot.client.connected


def test_a_refused_request_stops_the_executor_with_the_field(server):
    server.script.append(Scripted(error={"type": "invalid_observation", "field": "input.observation.state",
                                         "message": "expected shape [3], got [2]"}))
    robot = Robot(server)
    robot.run(TRIGGER + 1)
    wait_until(lambda: robot.executor.error is not None, what="the refusal")
    with pytest.raises(ExecutorError, match="input.observation.state"):
        robot.run(1)
    robot.executor.close()


def test_observation_arrays_are_copied_and_a_callable_is_read_only_when_due(server):
    robot = Robot(server)
    reads = []

    def read():
        reads.append(robot.tick)
        return buffer

    buffer = observation(7)
    for _ in range(TRIGGER + 1):
        robot.executor.get_action(read)
        robot.tick += 1
    buffer["state"][:] = -1  # the robot reuses its buffer
    request = server.wait_for_requests(2)
    assert reads == [TRIGGER]
    np.testing.assert_array_equal(request["input"]["observation"]["state"], np.full(3, 7, np.float32))
    robot.executor.close()


def test_a_request_tick_needs_an_observation_and_close_does_not_hang(server):
    gate = threading.Event()
    server.script.append(Scripted(gate=gate))
    robot = Robot(server)
    for _ in range(TRIGGER):
        robot.executor.get_action()  # no request due: no observation needed
    with pytest.raises(ValueError, match="tick 12 starts a request"):
        robot.executor.get_action()
    assert decode(robot.executor.get_action(observation(TRIGGER))) == (1, TRIGGER)  # the tick was not lost
    server.wait_for_requests(2)
    robot.executor.close()  # the reply is still held back: close must not wait for it
    assert not robot.executor._worker.is_alive()
    gate.set()


def test_options_are_checked():
    client = Client("127.0.0.1:1")
    with pytest.raises(ValueError, match="control_hz"):
        ActionChunkExecutor(client, control_hz=0)
    with pytest.raises(ValueError, match="hold_action"):
        ActionChunkExecutor(client, control_hz=50, on_underrun="hold")
    with pytest.raises(ValueError, match="on_underrun"):
        ActionChunkExecutor(client, control_hz=50, on_underrun="freeze")
