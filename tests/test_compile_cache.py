"""The persistent compile cache (vlaserve.runtime.compile_cache): its directory is keyed by GPU,
CUDA, torch, Triton and vlaserve version; TRITON_CACHE_DIR points there; a user's TRITON_CACHE_DIR
is kept unless --compile-cache is given. On a CPU, with the GPU's name and versions faked."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import vlaserve
from vlaserve.cli import main
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError
from vlaserve.options import serve_options
from vlaserve.runtime import compile_cache
from vlaserve.runtime.compile_cache import TRITON_ENV, activate, cache_key, default_directory

CUDA = torch.device("cuda:0")


@pytest.fixture
def h200(monkeypatch):
    """A CUDA device as an H200 with torch 2.11 (cu128) and Triton 3.6 would report it; the env var
    and the module's memory of it restored afterwards."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    monkeypatch.setattr(compile_cache, "_triton_version", lambda: "3.6.0")
    monkeypatch.setattr(compile_cache, "__version__", "0.1.0")
    monkeypatch.setattr(compile_cache, "_activated", None)
    monkeypatch.delenv(TRITON_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)


def test_the_key_names_every_component(h200):
    assert cache_key(CUDA) == "NVIDIA-H200-sm90-cuda12.8-torch2.11.0-cu128-triton3.6.0-vlaserve0.1.0"


@pytest.mark.parametrize("change", [
    lambda m: m.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3"),
    lambda m: m.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0)),
    lambda m: m.setattr(torch.version, "cuda", "13.0"),
    lambda m: m.setattr(torch, "__version__", "2.13.0+cu130"),
    lambda m: m.setattr(compile_cache, "_triton_version", lambda: "3.7.0"),
    lambda m: m.setattr(compile_cache, "__version__", "0.2.0"),
], ids=["gpu", "capability", "cuda", "torch", "triton", "vlaserve"])
def test_another_gpu_or_version_gets_another_directory(h200, monkeypatch, tmp_path, change):
    before = activate(tmp_path, CUDA)
    change(monkeypatch)
    after = activate(tmp_path, CUDA)
    assert after != before and after.parent == before.parent == tmp_path
    assert os.environ[TRITON_ENV] == str(after)


def test_the_default_directory_is_under_the_users_cache(h200, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_directory() == tmp_path / "home" / ".cache" / "vlaserve" / "compile"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = activate(None, CUDA)
    assert path == tmp_path / "xdg" / "vlaserve" / "compile" / cache_key(CUDA)
    assert path.is_dir() and os.environ[TRITON_ENV] == str(path)
    assert activate(None, CUDA) == path  # again (another Policy in the process): its own setting is no user's


def test_a_users_triton_cache_dir_is_kept_unless_the_option_is_given(h200, monkeypatch, tmp_path, caplog):
    users = tmp_path / "users-triton"
    monkeypatch.setenv(TRITON_ENV, str(users))
    with caplog.at_level(logging.INFO, logger="vlaserve.runtime.compile_cache"):
        assert activate(None, CUDA) == users and users.is_dir()
        assert os.environ[TRITON_ENV] == str(users)
        assert f"{TRITON_ENV} set in the environment" in caplog.text
        given = activate(tmp_path / "given", CUDA)
    assert given == tmp_path / "given" / cache_key(CUDA) and os.environ[TRITON_ENV] == str(given)
    assert f"{TRITON_ENV}={users} ignored" in caplog.text


def test_an_unusable_directory_is_a_clear_error(h200, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create the compile cache .*--compile-cache"):
        activate(blocker, CUDA)


def test_the_option_is_a_serve_flag_and_a_config_key(tmp_path):
    assert RuntimeConfig().compile_cache is None
    assert serve_options({"compile_cache": str(tmp_path)})["runtime"].compile_cache == str(tmp_path)
    config = tmp_path / "serve.json"
    config.write_text('{"compile-cache": "/var/cache/vlaserve"}')
    assert serve_options({"config": str(config)})["runtime"].compile_cache == "/var/cache/vlaserve"
    with pytest.raises(ConfigError, match="compile_cache"):
        RuntimeConfig(compile_cache=" ")
    assert vlaserve.__version__ == compile_cache.__version__


# ---- vlaserve warmup -------------------------------------------------------------------------------
def test_warmup_without_cuda_says_there_is_nothing_to_compile(golden, capsys):
    assert main(["warmup", str(golden / "checkpoint"), "--device", "cpu"]) == 1
    assert "nothing to compile: no CUDA device here (device cpu)" in capsys.readouterr().err
    assert main(["warmup", "--max-batch-size", "0"]) == 2  # a bad option: as serve


def test_warmup_loads_as_serve_blocking_and_says_where_and_how_long(h200, monkeypatch, tmp_path, golden_policy,
                                                                     capsys):
    """The CUDA path with the GPU faked: the compile cache is activated before the policy loads,
    the policy loads with serve's options and a blocking warm-up, and the output names the directory."""
    import vlaserve.cli
    import vlaserve.runtime.device

    loaded = {}

    def build_service(options, demo=None, **overrides):
        loaded.update(options=options, overrides=overrides, cache=os.environ[TRITON_ENV])
        return golden_policy, None

    real_stats = golden_policy.runtime.stats
    monkeypatch.setattr(golden_policy.runtime, "stats", lambda: {**real_stats(), "graphs": {"captured": 80, "total": 80}})
    monkeypatch.setattr(vlaserve.runtime.device, "resolve_device", lambda name: CUDA)
    monkeypatch.setattr(vlaserve.cli, "build_service", build_service)
    monkeypatch.setattr(vlaserve.cli, "imported_without_bytecode", lambda: ([], 1500))  # writes nothing here
    assert main(["warmup", "--compile-cache", str(tmp_path), "--max-batch-size", "4"]) == 0
    directory = tmp_path / cache_key(CUDA)
    assert loaded["overrides"] == {"warmup": "blocking"} and loaded["cache"] == str(directory)
    assert loaded["options"]["runtime"].max_batch_size == 4
    out = capsys.readouterr().out
    assert f"compile cache {directory}: filled in " in out and "80 CUDA graphs" in out
    assert "python bytecode" not in out  # nothing lacked it


def test_warmup_writes_the_bytecode_a_start_would_compile_from_source(h200, monkeypatch, tmp_path, golden_policy,
                                                                       capsys):
    """After the cache: the modules a start imports that have no bytecode get it (vlaserve.bytecode)."""
    import importlib.util

    import vlaserve.cli
    import vlaserve.runtime.device

    sources = [tmp_path / "first.py", tmp_path / "second.py"]
    for source in sources:
        source.write_text("X = 1\n")
    monkeypatch.setattr(vlaserve.runtime.device, "resolve_device", lambda name: CUDA)
    monkeypatch.setattr(vlaserve.cli, "build_service", lambda options, demo=None, **overrides: (golden_policy, None))
    monkeypatch.setattr(vlaserve.cli, "imported_without_bytecode", lambda: (sources, 1500))
    assert main(["warmup", "--compile-cache", str(tmp_path / "cache")]) == 0
    assert "python bytecode: written for 2 of the 1500 modules a start imports (they had none)" in capsys.readouterr().out
    assert all(Path(importlib.util.cache_from_source(str(s))).exists() for s in sources)
