"""Direct launch (on by default, `--no-direct-launch`) through the server: a lone robot's request, prepared
on the event loop, is launched there too (vlaserve/batcher.py). The golden policy runs eagerly on the CPU,
where the batcher never launches directly (Policy.launches_quickly is false: the eager model computes inside
launch); here it is told its launches are quick, so the wiring from the option to the batcher is what is
tested."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from vlaserve.server import ServerSettings
from test_cli_options import options
from test_keep_warm import observation, serve


@pytest.mark.parametrize("route", ["openpi", "realtime", "http"])
def test_a_lone_robots_requests_are_launched_on_the_event_loop_with_the_same_answers(golden_policy, route,
                                                                                      monkeypatch):
    launchers = []
    launch = golden_policy.launch
    monkeypatch.setattr(golden_policy, "launches_quickly", lambda request: True)
    monkeypatch.setattr(golden_policy, "launch", lambda requests: (launchers.append(threading.current_thread().name),
                                                                   launch(requests))[1])
    frames = [observation(seed) for seed in range(3)]
    plain, plain_stats = serve(golden_policy, ServerSettings(direct_launch=False), route, frames, "direct_launch")
    direct, direct_stats = serve(golden_policy, ServerSettings(direct_launch=True), route, frames, "direct_launch")
    for a, b in zip(plain, direct):
        np.testing.assert_array_equal(a, b)  # the same batch of one, launched by another thread
    assert plain_stats[-1] == {"enabled": False, "launches": 0}
    assert [s["launches"] for s in direct_stats] == [1, 2, 3] and direct_stats[-1]["enabled"]
    assert launchers[:3] == ["vlaserve-launch"] * 3
    assert "vlaserve-launch" not in launchers[3:] and len(launchers) == 6


def test_direct_launch_is_on_unless_turned_off_on_the_command_line_or_in_the_config(tmp_path):
    assert ServerSettings().direct_launch is True
    assert ServerSettings.from_options(options([])).direct_launch is True
    assert ServerSettings.from_options(options(["--no-direct-launch"])).direct_launch is False
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"direct_launch": False}))
    assert ServerSettings.from_options(options(["--config", str(config)])).direct_launch is False
