"""The Pi0.5 prompt tokenized from cached pieces (PromptTokenizer.state_prompt) gives the ids of the
whole prompt, token for token; the cache is per tokenizer (so per checkpoint) and bounded."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import golden_dir
from vlaserve.golden import case_dirs
from vlaserve.processing.prompt import BIN_VALUES, PromptTokenizer, build_prompt, every_pair


@pytest.fixture(scope="module")
def tokenizer():
    return PromptTokenizer.from_path(golden_dir() / "checkpoint" / "tokenizer")


def whole(tok: PromptTokenizer, task: str, bins: np.ndarray, max_len: int):
    return tok(build_prompt(task, bins), max_len)


def same(a, b) -> bool:
    return (np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask) and a.num_tokens == b.num_tokens
            and a.truncated == b.truncated)


def test_every_pair_puts_each_ordered_pair_side_by_side():
    values = list(BIN_VALUES)
    sequence = every_pair(values)
    assert set(zip(sequence, sequence[1:])) == {(a, b) for a in values for b in values}
    assert len(sequence) == len(values) ** 2 + 1


def test_the_golden_tokenizer_composes(tokenizer):
    assert tokenizer.state_words() is not False  # a word-splitting BPE: the cached path is the one tested


@pytest.mark.parametrize("case_dir", case_dirs(golden_dir()), ids=lambda p: p.name)
def test_golden_token_ids(tokenizer, case_dir):
    """Against the ids LeRobot 0.6.1 produced for each case (tests/data, tokenizer stand-in)."""
    case = json.loads((case_dir / "case.json").read_text())
    tensors = load_file(case_dir / "tensors.safetensors")
    for i, (task, bins) in enumerate(zip(case["tasks"], case["state_bins"])):
        for _ in range(2):  # a miss, then a hit
            out = tokenizer.state_prompt(task, np.array(bins, dtype=np.int64), tensors["expected.tokens"].shape[1])
            np.testing.assert_array_equal(out.ids, tensors["expected.tokens"][i])
            np.testing.assert_array_equal(out.mask, tensors["expected.token_mask"][i])


TASKS = ["pick up the red block", "fold_the towel\nneatly", "  padded task  ", "", "task 7", "ends with digits 255",
         "ünïcode – tâche 取る", "a:b, State: 1 2;\nAction: ", "x" * 300, "-1", "___", "tabs\there"]


def test_random_states_and_tasks_match_the_whole_prompt(tokenizer):
    rng = np.random.default_rng(0)
    for trial in range(400):
        task = TASKS[trial % len(TASKS)] + ("" if trial < 200 else f" {rng.integers(0, 1000)}")
        dims = int(rng.integers(1, 33))
        bins = rng.integers(-1, 256, dims)
        bins[rng.random(dims) < 0.2] = rng.choice([-1, 0, 255])  # the edge bins, often
        max_len = int(rng.choice([8, 48, 200]))  # 8: most prompts are cut
        assert same(tokenizer.state_prompt(task, bins, max_len), whole(tokenizer, task, bins, max_len)), (task, bins)


def test_bins_outside_the_discretized_range_are_tokenized_whole(tokenizer):
    for bins in ([256, 3], [-2], [1, 1000]):  # (never from discretize_state; no table lookup goes wrong)
        bins = np.array(bins)
        assert same(tokenizer.state_prompt("task", bins, 64), whole(tokenizer, "task", bins, 64))


def char_tokenizer(merge: str | None = None) -> PromptTokenizer:
    """One id per character; `merge`, where it occurs in a text, becomes the single id 9999."""
    def encode(text: str) -> list[int]:
        parts = text.split(merge) if merge else [text]
        ids = []
        for i, part in enumerate(parts):
            ids += [9999] if i else []
            ids += [ord(c) for c in part]
        return ids
    return PromptTokenizer(encode, bos_id=2, pad_id=0, source=f"chars, merging {merge!r}")


def test_a_tokenizer_merging_across_state_words_tokenizes_whole():
    tok = char_tokenizer(merge="7 1")  # "...7 1..." (one word ending in 7, the next starting with 1) merges
    bins = np.array([17, 12, 5])
    out = tok.state_prompt("task", bins, 64)
    assert tok.state_words() is False
    assert same(out, whole(tok, "task", bins, 64)) and 9999 in out.ids


def test_a_task_whose_end_merges_with_the_state_is_tokenized_whole_and_not_cached():
    tok = char_tokenizer(merge="zz, State: ")  # only in the whole prompt, never in a piece
    bins = np.array([3, 4])
    for task in ("zz", "zz", "plain"):
        assert same(tok.state_prompt(task, bins, 64), whole(tok, task, bins, 64))
    assert tok.state_words() is not False
    assert list(tok._heads) == ["plain"]


def test_the_cache_is_per_tokenizer():
    """Each checkpoint loads its own PromptTokenizer, and a task's ids never cross from one to another."""
    a, b = char_tokenizer(), PromptTokenizer(lambda text: [ord(c) + 1000 for c in text], 2, 0, "shifted chars")
    bins = np.array([1, 2, 3])
    first = a.state_prompt("task", bins, 64)
    second = b.state_prompt("task", bins, 64)
    assert same(second, whole(b, "task", bins, 64)) and not np.array_equal(first.ids, second.ids)
    assert a._heads["task"] != b._heads["task"]


def test_the_task_cache_is_bounded_least_recently_used_first():
    tok = char_tokenizer()
    tok.MAX_CACHED_TASKS = 3
    bins = np.array([0])
    for task in ("a", "b", "c", "a", "d"):  # "a" used again: "b" is the oldest when "d" comes
        tok.state_prompt(task, bins, 32)
    assert list(tok._heads) == ["c", "a", "d"]


def test_a_pi05_policy_checks_its_state_words_at_load(golden_policy):
    """Ready before the first frame, so no frame pays the check."""
    words = golden_policy.preprocessor.tokenizer._words
    assert words is not None and words is not False
