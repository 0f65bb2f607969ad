"""The built-in demo checkpoint: built offline, deterministic, in the golden checkpoint's formats."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_server import GENERATIONS, ServerProcess, make_observation, request_body
from tokenizers import Tokenizer

from vlaserve import Policy
from vlaserve.demo import DEMO_NAME, DEMO_NAMES, demo_checkpoint


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_checkpoint(tmp_path_factory.mktemp("cache"))


def _json(path):
    return json.loads(path.read_text())


def test_built_once_atomically_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLASERVE_CACHE", str(tmp_path))
    path = demo_checkpoint()
    assert path == tmp_path / DEMO_NAME
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_NAME]  # no staging directory left behind
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_deterministic(demo, tmp_path):
    again = demo_checkpoint(tmp_path)
    files = sorted(p.relative_to(demo) for p in demo.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for name in files:
        assert (demo / name).read_bytes() == (again / name).read_bytes(), name


def test_mirrors_the_golden_checkpoint_formats(demo, golden):
    reference = golden / "checkpoint"
    ours = {p.relative_to(demo) for p in demo.rglob("*") if p.is_file()}
    theirs = {p.relative_to(reference) for p in reference.rglob("*") if p.is_file()}
    assert ours - theirs == {Path("README.md")} and theirs <= ours

    config, golden_config = _json(demo / "config.json"), _json(reference / "config.json")
    assert list(config) == list(golden_config) and config["type"] == "pi05"
    assert config["tokenizer_max_length"] == 48 and config["chunk_size"] == 50 and config["num_inference_steps"] == 10
    assert config["input_features"] == golden_config["input_features"]

    arch, golden_arch = _json(demo / "architecture.json"), _json(reference / "architecture.json")
    assert arch["demo"] is True and arch["format"] == golden_arch["format"]
    for part in ("vlm", "expert", "vision"):
        assert arch[part] == golden_arch[part]
    assert set(golden_arch["policy"]) == set(arch["policy"])

    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        steps = [s["registry_name"] for s in _json(demo / name)["steps"]]
        assert steps == [s["registry_name"] for s in _json(reference / name)["steps"]]
    for name in ("policy_preprocessor_step_3_normalizer_processor.safetensors",
                 "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        stats, golden_stats = load_file(demo / name), load_file(reference / name)
        assert {k: (v.dtype, v.shape) for k, v in stats.items()} == {
            k: (v.dtype, v.shape) for k, v in golden_stats.items()}
        for key in ("observation.state", "action"):
            assert (stats[f"{key}.q99"] > stats[f"{key}.q01"]).all()
            assert (stats[f"{key}.min"] < stats[f"{key}.q01"]).all()
            assert (stats[f"{key}.max"] > stats[f"{key}.q99"]).all()


def test_tokenizer_follows_paligemma_conventions(demo):
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer" / "tokenizer.json"))
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<0x00>", "<0xFF>")] == [
        0, 1, 2, 3, 4, 259]
    assert tokenizer.get_vocab_size() < _json(demo / "architecture.json")["vlm"]["vocab_size"]
    encoding = tokenizer.encode("Task: pick up the red block, State: 12 255 -1;\nAction: ")
    assert encoding.ids[0] == 2 and 1 not in encoding.ids and 3 not in encoding.ids  # BOS, no EOS, no <unk>
    assert "<0x0A>" in encoding.tokens and "▁pick" in encoding.tokens and "▁255" in encoding.tokens
    # Byte tokens are special tokens (as in the golden tokenizer), so keep them when decoding.
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == (
        "<bos>Task: pick up the red block, State: 12 255 -1;\nAction: ")


def test_loads_and_is_labelled_a_demo(demo):
    policy = Policy.from_pretrained(demo, device="cpu", dtype="float32", progress=False)
    assert policy.metadata["is_demo"] is True and policy.metadata["max_token_len"] == 48
    result = policy.infer(make_observation(0), seed=0)
    assert result.actions.shape == (50, 14) and np.isfinite(result.actions).all()


@pytest.mark.parametrize("name, policy_type", [("demo", "pi05"), ("demo-pi05", "pi05"), ("demo-pi0", "pi0")])
def test_from_pretrained_takes_the_demo_ids(tmp_path, monkeypatch, name, policy_type):
    monkeypatch.setenv("VLASERVE_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # (a directory of that name would win)
    policy = Policy.from_pretrained(name, device="cpu", dtype="float32", progress=False)
    meta = policy.metadata
    assert (meta["is_demo"], meta["policy_type"], meta["model"]) == (True, policy_type, DEMO_NAMES[policy_type])
    assert meta["checkpoint"] == str(tmp_path / DEMO_NAMES[policy_type])
    assert policy.infer(make_observation(0), seed=0).actions.shape == (50, 14)


def test_a_local_directory_named_like_a_demo_id_is_loaded_as_a_directory(demo, tmp_path, monkeypatch):
    monkeypatch.setenv("VLASERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-pi0").symlink_to(demo)  # a Pi0.5 checkpoint under Pi0's demo id
    policy = Policy.from_pretrained("demo-pi0", device="cpu", dtype="float32", progress=False)
    assert policy.config.policy_type == "pi05"
    assert not (tmp_path / "cache").exists()  # no demo was built


@pytest.mark.parametrize("args, policy_type", [([], "pi05"), (["--demo", "pi0"], "pi0")], ids=["default", "pi0"])
def test_serve_without_a_checkpoint_runs_the_demo_offline(tmp_path, args, policy_type):
    env = {"VLASERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = ServerProcess([*args, "--device", "cpu", "--dtype", "float32"], tmp_path / "log", env=env)
    try:
        proc.wait_ready()
        assert httpx.get(proc.url + "/healthz").json()["is_demo"] is True
        meta = httpx.get(proc.url + "/v1/actions/metadata").json()
        assert (meta["is_demo"], meta["policy_type"], meta["model"]) == (True, policy_type, DEMO_NAMES[policy_type])
        obs = make_observation(1, size=(32, 32))
        response = httpx.post(proc.url + GENERATIONS, json=request_body(obs, lists=True, parameters={"seed": 1}))
        assert response.status_code == 200, response.text
        assert np.asarray(response.json()["data"][0]["action"]["values"]).shape == (50, 14)
    finally:
        assert proc.stop() == 0
    assert "DEMO MODEL" in proc.log() and f"({policy_type}, DEMO)" in proc.log()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [DEMO_NAMES[policy_type]]
    assert (tmp_path / "cache" / DEMO_NAMES[policy_type] / "model.safetensors").exists()
