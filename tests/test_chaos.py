"""Issue 78's table, as a robot fleet lives it: `bench_fleet.py --chaos --smoke` runs 4 robots
(ActionChunkExecutor, 20 Hz) against `vlaserve serve` on the CPU demo checkpoint, SIGKILLs the server
under them, restarts it on the same port, then stops it with SIGTERM; its JSON holds what the robots and
the process table saw, and each row is asserted here."""

import pytest
from test_bench_smoke import result, run

HZ = 20.0
# The bound is 1.0 s from /healthz 200 to a fresh chunk: the robot's share (finding the server,
# then reading and sending a fresh observation) plus the server's round trip. The robot's share is at
# most one probe interval (backoff_max 0.25 s) and one tick (50 ms), plus 0.2 s for thread wake-ups on a
# loaded 2-core machine: that is asserted. The round trip is the server's, seconds on a CPU shared with
# other work: bench_fleet --chaos reports the whole gap (docs/client.md has the figures).
ROBOT_SHARE_BOUND_S = 0.25 + 1 / HZ + 0.2
LEFTOVER_BOUND_S = 3.0   # the issue's: every process of the killed server gone within 3 s
CLOSE_BOUND_S = 1.0      # the issue's: executor.close() with the server gone


@pytest.mark.slow
def test_robots_through_a_sigkill_a_restart_and_a_sigterm(tmp_path):
    run("bench_fleet", tmp_path, "--chaos")
    chaos = result(tmp_path, "bench_fleet_chaos", png=True)["chaos"]
    robots = chaos["per_robot"]
    assert len(robots) == 4 and chaos["hz"] == HZ
    for robot in robots:
        # Every request went out within one tick of reading its observation; none read during the
        # outage was sent after it (the first request after the restart carries a fresh one).
        assert robot["sent_after_kill"] >= 1 and robot["sends_older_than_a_tick"] == 0
        assert robot["read_before_ready_sent_after"] == 0
        stats = robot["stats"]
        assert stats["reconnects"] >= 1 and stats["outage_ticks"] > 0 and stats["connection_failures"] >= 1
    assert chaos["fresh_send_after_ready_s"]["max"] <= ROBOT_SHARE_BOUND_S
    # Every robot's request after the outage was answered by the restarted server. Whether that chunk is
    # used depends on the server's round trip (under max_staleness_s): reported, not asserted.
    assert all(robot["first_reply_after_ready_s"] is not None for robot in robots)
    for stage in ("after_sigkill", "after_sigterm"):
        gone = chaos[stage]
        assert gone["processes"] >= 1 and gone["left"] == 0 and gone["gone_after_s"] <= LEFTOVER_BOUND_S, stage
    assert chaos["after_sigterm"]["exit_code"] == 0
    assert chaos["close_s_max"] <= CLOSE_BOUND_S and chaos["workers_alive_after_close"] == 0
