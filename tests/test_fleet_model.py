"""bench/fleet_model.py: the paced fleet's floor that bench_fleet.py reports beside each paced level.
Each expected latency is worked out by hand from the schedule (stated per test). They are compared with
pytest.approx's default (relative 1e-6): the replay adds times in float seconds, so a hand-worked 25 ms
comes back as 25 ms up to float rounding (~1e-15 relative), never off by a schedule's step (>= 0.75 ms)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fleet_model import batch_times, ideal_latencies, other_fleets_p99  # noqa: E402


def test_robots_spread_apart_never_wait():
    # 10 Hz, phases 25 ms apart, a 10 ms batch of one: each request finds the device idle, so its
    # latency is host in (1) + device (10) + host out (1), every time.
    lat = ideal_latencies([0.0, 0.025, 0.05, 0.075], 10, 1.0, [10.0, 15.0, 20.0, 25.0], 1.0, 1.0)
    assert len(lat) == 4 * 10 and lat == pytest.approx([12.0] * 40)


def test_robots_in_lockstep_share_one_batch():
    # Four robots on the same tick arrive together: one batch of 4 (25 ms) answers them all.
    lat = ideal_latencies([0.0] * 4, 10, 0.5, [10.0, 15.0, 20.0, 25.0], 0.0, 0.0)
    assert lat == pytest.approx([25.0] * 20)


def test_past_the_batch_limit_a_request_waits_for_the_next_batch():
    # Three on one tick, at most 2 a batch: two run at once (16 ms); the third starts when they end
    # and runs alone (10 ms): 26 ms.
    lat = ideal_latencies([0.0] * 3, 10, 0.05, [10.0, 16.0], 0.0, 0.0)
    assert sorted(lat) == pytest.approx([16.0, 16.0, 26.0])


def test_a_robot_whose_answer_comes_after_its_tick_sends_at_once():
    # 100 Hz (a tick every 10 ms) but 25 ms an answer: it sends again the moment an answer lands,
    # at 0, 25, 50 and 75 ms within 90 ms.
    lat = ideal_latencies([0.0], 100, 0.09, [25.0], 0.0, 0.0)
    assert lat == pytest.approx([25.0] * 4)


def test_a_request_arriving_during_a_batch_waits_for_its_end():
    # Robot 0 at 0 ms runs alone until 20 ms; robot 1 arrives at 5 ms, starts at 20 and ends at 40:
    # 35 ms after it sent.
    lat = ideal_latencies([0.0, 0.005], 10, 0.05, [20.0, 30.0], 0.0, 0.0)
    assert lat == pytest.approx([20.0, 35.0])


def test_batch_times_fill_unmeasured_sizes_from_the_measured_line():
    # Through (1, 14) and (4, 38): 8 ms an item from 6 ms; measured sizes stay as measured.
    assert batch_times({1: 14.0, 4: 38.0}, 6) == pytest.approx([14.0, 22.0, 30.0, 38.0, 46.0, 54.0])
    assert batch_times({1: 14.0, 2: 23.0, 4: 38.0}, 4)[1] == 23.0
    assert batch_times({2: 20.0}, 3) == [20.0, 20.0, 20.0]
    with pytest.raises(ValueError):
        batch_times({}, 2)


def test_other_fleets_bracket_the_luck_of_phases():
    # Two robots at 10 Hz, 10 ms a batch of one, 16 ms of two, no host time. Phases at least 10 ms
    # apart never wait (p99 10 ms); closer ones make the later robot wait for the earlier one or share
    # its batch (at most 10 + 10 = 20 ms, or 16 together). Every fleet's p99 lies in [10, 20] and
    # the draws are repeatable.
    p99s = other_fleets_p99(2, 10, 1.0, [10.0, 16.0], 0.0, 0.0, fleets=40, seed=3)
    assert len(p99s) == 40 and all(10.0 - 1e-9 <= p <= 20.0 + 1e-9 for p in p99s)
    assert min(p99s) == pytest.approx(10.0) and max(p99s) > 10.0
    assert p99s == other_fleets_p99(2, 10, 1.0, [10.0, 16.0], 0.0, 0.0, fleets=40, seed=3)
