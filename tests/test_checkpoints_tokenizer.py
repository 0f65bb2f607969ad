"""Tokenizer resolution as users have it. huggingface_hub is mocked: no test touches the network."""

import shutil

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError

from conftest import fixture_dir
from vlaserve.errors import CheckpointError
from vlaserve.processing.prompt import PromptTokenizer, find_tokenizer

GOLDEN = fixture_dir("pi05_golden") / "checkpoint"
HUB_ID = "google/paligemma-3b-pt-224"  # what LeRobot's policy_preprocessor.json names


@pytest.fixture()
def lerobot_checkpoint(tmp_path):
    """A checkpoint as LeRobot saves it: processor files, no tokenizer."""
    target = tmp_path / "ckpt"
    target.mkdir()
    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        shutil.copy(GOLDEN / name, target / name)
    return target


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    """snapshot_download replaced: records its calls; `behaviour` makes it return a cache dir or raise."""
    cache = tmp_path / "cache"
    shutil.copytree(GOLDEN / "tokenizer", cache)
    calls, state = [], {"raise": None}

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        calls.append({"repo_id": repo_id, "local_files_only": local_files_only})
        if state["raise"] is not None:
            raise state["raise"]
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return calls, state, cache


def _bare(error_type, message):
    error = error_type.__new__(error_type)  # hub errors want an HTTP response; the message is what counts
    Exception.__init__(error, message)
    return error


def test_lerobot_checkpoint_fetches_the_tokenizer_its_preprocessor_names(lerobot_checkpoint, hub):
    calls, _, cache = hub
    path = find_tokenizer(lerobot_checkpoint)
    assert path == cache and calls == [{"repo_id": HUB_ID, "local_files_only": False}]
    assert PromptTokenizer.from_path(path)("Task: x", 8).ids[0] == 2  # <bos> of the stand-in


def test_explicit_tokenizer_takes_a_hub_id_a_directory_or_a_file(lerobot_checkpoint, hub):
    calls, _, cache = hub
    assert find_tokenizer(lerobot_checkpoint, HUB_ID) == cache and calls[-1]["repo_id"] == HUB_ID
    assert find_tokenizer(lerobot_checkpoint, str(GOLDEN / "tokenizer")) == GOLDEN / "tokenizer"
    assert find_tokenizer(lerobot_checkpoint, GOLDEN / "tokenizer" / "tokenizer.json").name == "tokenizer.json"
    with pytest.raises(CheckpointError, match="neither a file, a directory nor a hub id"):
        find_tokenizer(lerobot_checkpoint, "./no/such/tokenizer")


def test_a_tokenizer_next_to_the_weights_needs_no_hub(hub):
    calls, _, _ = hub
    assert find_tokenizer(GOLDEN) == GOLDEN / "tokenizer" and calls == []


def test_gated_repo_says_how_to_log_in(lerobot_checkpoint, hub):
    _, state, _ = hub
    state["raise"] = _bare(GatedRepoError, "403 gated")
    with pytest.raises(CheckpointError, match="gated") as error:
        find_tokenizer(lerobot_checkpoint)
    assert "huggingface-cli login" in str(error.value) and "HF_TOKEN" in str(error.value)


def test_offline_and_not_cached_names_all_three_ways(lerobot_checkpoint, hub, monkeypatch):
    calls, state, _ = hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    state["raise"] = _bare(LocalEntryNotFoundError, "not in cache")
    with pytest.raises(CheckpointError) as error:
        find_tokenizer(lerobot_checkpoint)
    message = str(error.value)
    assert calls[-1]["local_files_only"] is True  # offline: the cache only
    assert "HF_HUB_OFFLINE" in message and "next to the weights" in message and "--tokenizer" in message
    assert "policy_preprocessor.json" in message
