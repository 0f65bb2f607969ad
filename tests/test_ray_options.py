"""serve-ray's options and its CLI behaviour without a cluster (these run with or without Ray)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vlaserve.cli import main
from vlaserve.options import UsageError
from vlaserve.fleet.command import fleet_options
from vlaserve.fleet.options import deployment_options


def test_config_file_takes_serve_options_and_ray_keys(tmp_path):
    config = tmp_path / "fleet.json"
    config.write_text(json.dumps({"device": "cpu", "batch_delay_ms": 3, "min_replicas": 0, "max-replicas": 4,
                                  "target_ongoing_requests": 1.5, "gpus_per_replica": 0.5}))
    options = fleet_options({"config": str(config), "max_replicas": 3})  # the command line wins
    assert options["runtime"].device == "cpu" and options["batch_delay_ms"] == 3
    ray = deployment_options(options)
    assert ray["autoscaling_config"]["min_replicas"] == 0 and ray["autoscaling_config"]["max_replicas"] == 3
    assert ray["autoscaling_config"]["target_ongoing_requests"] == 1.5 and "num_replicas" not in ray
    assert ray["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert ray["graceful_shutdown_timeout_s"] == options["drain_timeout_s"]


def test_fixed_replicas_and_gpu_default():
    ray = deployment_options(fleet_options({"replicas": 3, "device": "cuda"}))
    assert ray["num_replicas"] == 3 and "autoscaling_config" not in ray
    assert ray["ray_actor_options"]["num_gpus"] == 1  # one GPU per replica unless on the CPU
    assert deployment_options(fleet_options({"device": "cpu"}))["ray_actor_options"]["num_gpus"] == 0


def test_direct_websockets_autoscale_with_the_policy_that_counts_direct_robots():
    plain = deployment_options(fleet_options({"max_replicas": 2}))["autoscaling_config"]
    direct = deployment_options(fleet_options({"max_replicas": 2, "direct_websockets": True}))["autoscaling_config"]
    assert "policy" not in plain  # Ray's own: robots through the proxy are its ongoing requests
    assert direct["policy"] == {"policy_function": "vlaserve.fleet.autoscale:count_direct_robots"}


@pytest.mark.parametrize("cli, message", [
    ({"replicas": 0}, "replicas must be at least 1"),
    ({"min_replicas": 2}, "min_replicas needs max_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
    ({"max_ongoing_requests": 0}, "max_ongoing_requests must be at least 1"),
    ({"gpus_per_replica": -1.0}, "gpus_per_replica must not be negative"),
])
def test_bad_ray_keys_are_named(cli, message):
    with pytest.raises(UsageError, match=message):
        fleet_options(cli)


def test_unknown_config_key_lists_the_ray_keys(tmp_path):
    config = tmp_path / "fleet.json"
    config.write_text(json.dumps({"replica": 2}))
    with pytest.raises(UsageError, match="unknown option 'replica'.*max_replicas"):
        fleet_options({"config": str(config)})


def test_serve_ray_without_ray_says_how_to_install(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert main(["serve-ray", "--device", "cpu"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        'serve-ray needs Ray: pip install -e ".[ray]" in vlaserve\'s clone (or pip install "ray[serve]>=2.60")']


def test_vlaserve_serve_never_imports_ray():
    code = ("import sys, vlaserve.cli as cli, vlaserve.options as options; "
            "cli.build_parser(); options.serve_options({}); "
            "import vlaserve.server.app; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
