"""Prompt building and tokenization.

Pi0.5 sees the robot state only through its prompt: each normalized dimension is discretized
into one of 256 bins and written as a number. Pi0 keeps the state out of the prompt (it reaches
the model as a token of its own): its prompt is the raw task and a newline.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .steps import tokenizer_name_of

log = logging.getLogger(__name__)

_BIN_EDGES = np.linspace(-1, 1, 256 + 1)[:-1]


def discretize_state(normalized_state: np.ndarray) -> np.ndarray:
    """float32 [D] in about [-1, 1] -> int64 bins; below -1 gives -1, 1 - 2/256 and above give 255."""
    return (np.digitize(np.asarray(normalized_state, dtype=np.float32), _BIN_EDGES) - 1).astype(np.int64)


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


# The Pi0.5 prompt "Task: {task}, State: {b1} {b2} ... {bn};\nAction: " in pieces that each start a
# word: the head (everything up to the space before the first bin), then one word per bin, the last
# one carrying the end of the template. PromptTokenizer.state_prompt tokenizes the pieces apart.
STATE_END = ";\nAction: "
BIN_VALUES = range(-1, 256)  # what discretize_state gives


def prompt_head(task: str) -> str:
    return f"Task: {clean_task(task)}, State:"


def state_word(bin_value: int | None, last: bool) -> str:
    """" 43" inside the state, " 180;\nAction: " last; None: the end of a state without dims."""
    if bin_value is None:
        return f" {STATE_END}"
    return f" {bin_value}{STATE_END if last else ''}"


def build_prompt(task: str, state_bins: np.ndarray) -> str:
    bins = [int(b) for b in state_bins]
    words = [state_word(b, last=False) for b in bins[:-1]] + [state_word(bins[-1] if bins else None, last=True)]
    return prompt_head(task) + "".join(words)


def build_pi0_prompt(task: str) -> str:
    """The raw task with a final newline (LeRobot's Pi0NewLineProcessor): no strip, no `_` or inner
    newline replacement, and a task that already ends in a newline is left as it is."""
    return task if task.endswith("\n") else task + "\n"


# A family's prompt: (task, normalized state) -> (prompt, state bins, or None when the prompt carries no state).
def pi05_prompt(task: str, normalized_state: np.ndarray) -> tuple[str, np.ndarray]:
    bins = discretize_state(normalized_state)
    return build_prompt(task, bins), bins


def pi0_prompt(task: str, normalized_state: np.ndarray) -> tuple[str, None]:
    return build_pi0_prompt(task), None


def every_pair(values: list) -> list:
    """A sequence in which every ordered pair of `values` (a value with itself too) stands side by
    side once: a de Bruijn sequence of order 2 (Lyndon words in order: a; then a b for each b after
    a), closed by its first value."""
    sequence = [x for i, a in enumerate(values) for x in (a, *(y for b in values[i + 1:] for y in (a, b)))]
    return sequence + sequence[:1]


@dataclass
class TokenizedPrompt:
    ids: np.ndarray  # int64 [max_len], right-padded with 0
    mask: np.ndarray  # bool [max_len]
    num_tokens: int  # before truncation
    truncated: bool


class PromptTokenizer:
    """PaliGemma-convention tokenization: BOS first, no EOS, right pad with id 0 to a fixed length."""

    MAX_CACHED_TASKS = 1024  # distinct task texts whose head tokens are kept (least recently used go)

    def __init__(self, encode, bos_id: int, pad_id: int, source: str):
        self._encode = encode  # text -> ids without special tokens
        self.bos_id, self.pad_id, self.source = bos_id, pad_id, source
        # state_prompt's caches, per tokenizer (so per checkpoint): task -> head ids, and each
        # state word's ids; None until first used, False when the words do not compose exactly.
        self._heads: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._words: tuple[list, list] | bool | None = None
        self._lock = threading.Lock()

    @staticmethod
    def from_path(path: Path) -> "PromptTokenizer":
        path = Path(path)
        if path.is_dir():
            for name in ("tokenizer.json", "tokenizer.model"):
                if (path / name).exists():
                    return PromptTokenizer.from_path(path / name)
            raise CheckpointError(f"{path} holds neither tokenizer.json nor tokenizer.model")
        if path.suffix == ".json":
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            bos, pad = tok.token_to_id("<bos>"), tok.token_to_id("<pad>")
            if bos is None or pad is None:
                raise CheckpointError(f"{path}: the tokenizer has no <bos>/<pad> token")
            return PromptTokenizer(lambda text: tok.encode(text, add_special_tokens=False).ids, bos, pad, str(path))
        if path.suffix == ".model":
            import sentencepiece

            sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
            pad = sp.pad_id() if sp.pad_id() >= 0 else 0
            return PromptTokenizer(lambda text: sp.encode(text), sp.bos_id(), pad, str(path))
        raise CheckpointError(f"{path}: expected a tokenizer.json or a SentencePiece .model file")

    def __call__(self, text: str, max_len: int) -> TokenizedPrompt:
        return self._pack([self.bos_id, *self._encode(text)], max_len)

    def state_prompt(self, task: str, bins: np.ndarray, max_len: int) -> TokenizedPrompt:
        """`self(build_prompt(task, bins), max_len)`, token for token, from cached pieces: the head's
        ids per task text and each state word's ids, so a frame tokenizes nothing once its task was
        seen. The pieces each start a word; a tokenizer that splits words before merging (PaliGemma's
        SentencePiece, and BPEs with a whitespace pre-tokenizer) gives the same ids for the pieces
        apart as together. That is checked, not assumed: every ordered pair of state words and every
        last word once per tokenizer (state_words), and each task's head against the whole prompt when
        it enters the cache; a tokenizer that fails the check tokenizes whole prompts, and so does a
        state without dims or with a bin discretize_state never gives."""
        words = self.state_words()
        values = bins.tolist()
        if not words or not values or min(values) < BIN_VALUES[0] or max(values) > BIN_VALUES[-1]:
            return self(build_prompt(task, bins), max_len)
        inner, last = words
        state = [i for v in values[:-1] for i in inner[v + 1]] + last[values[-1] + 1]
        with self._lock:
            head = self._heads.get(task)
            if head is not None:
                self._heads.move_to_end(task)
        if head is None:
            head, whole = self._encode(prompt_head(task)), self._encode(build_prompt(task, bins))
            if whole != head + state:  # this task's end merges with the state: never cached
                log.info("task %r: its prompt does not split into cached pieces; tokenized whole", task)
                return self._pack([self.bos_id, *whole], max_len)
            with self._lock:
                self._heads[task] = head
                while len(self._heads) > self.MAX_CACHED_TASKS:
                    self._heads.popitem(last=False)
        return self._pack([self.bos_id, *head, *state], max_len)

    def state_words(self) -> tuple[list, list] | bool:
        """Each bin's ids as an inner and as the last state word (index: bin + 1), once checked to
        compose exactly; False when they do not. The check tokenizes 66,049 state words once (~0.15 s
        on an idle 2-core host), which the Preprocessor of a Pi0.5 checkpoint pays at load."""
        if self._words is None:
            inner = [self._encode(state_word(b, last=False)) for b in BIN_VALUES]
            last = [self._encode(state_word(b, last=True)) for b in BIN_VALUES]
            # Every ordered pair of bins side by side, in one text after the head's last word.
            pairs = every_pair(list(BIN_VALUES))
            text = "State:" + "".join(state_word(v, last=False) for v in pairs)
            ok = self._encode(text) == self._encode("State:") + [i for v in pairs for i in inner[v + 1]]
            for b in BIN_VALUES if ok else ():
                text = "State: 0" + state_word(b, last=True)
                if self._encode(text) != self._encode("State:") + inner[1] + last[b + 1]:
                    ok = False
                    break
            if not ok:
                log.info("tokenizer %s: state words do not tokenize apart as together; prompts are tokenized "
                         "whole", self.source)
            self._words = (inner, last) if ok else False
        return self._words

    def _pack(self, ids: list[int], max_len: int) -> TokenizedPrompt:
        n = len(ids)
        if n > max_len:
            log.warning("prompt of %d tokens truncated to %d: the end of the state and 'Action:' are cut", n, max_len)
            ids = ids[:max_len]
        out = np.full(max_len, self.pad_id, dtype=np.int64)
        out[: len(ids)] = ids
        mask = np.zeros(max_len, dtype=bool)
        mask[: len(ids)] = True
        return TokenizedPrompt(ids=out, mask=mask, num_tokens=n, truncated=n > max_len)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
_WAYS = ("put the tokenizer next to the weights (tokenizer/, tokenizer.json or tokenizer.model), "
         "pass --tokenizer with a hub id, a directory or a file, or let vlaserve fetch the hub id the "
         "checkpoint's policy_preprocessor.json names (online, HF_HUB_OFFLINE unset)")


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def fetch_tokenizer(repo_id: str) -> Path:
    """The tokenizer files of hub repo `repo_id`, from the local cache when offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    offline = constants.HF_HUB_OFFLINE
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=list(TOKENIZER_FILES), local_files_only=offline))
    except GatedRepoError:
        raise CheckpointError(
            f"the tokenizer repo {repo_id} is gated: accept its license at https://huggingface.co/{repo_id}, "
            "then log in with `huggingface-cli login` (or `hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"the tokenizer repo {repo_id} does not exist on the Hugging Face hub (or is "
                              "private: log in with `huggingface-cli login` or set HF_TOKEN)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        why = "offline (HF_HUB_OFFLINE) and not in the local cache" if offline else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"could not fetch the tokenizer {repo_id} ({why}); {_WAYS}") from None
    if not any((path / name).exists() for name in TOKENIZER_FILES[:2]):
        raise CheckpointError(f"the hub repo {repo_id} holds neither tokenizer.json nor tokenizer.model")
    return path


def find_tokenizer(checkpoint_dir: Path, explicit: str | Path | None = None, hub_name: str | None = None) -> Path:
    """The tokenizer to use: `explicit` (a directory, a file or a hub id), else one next to the
    weights, else the hub id `hub_name` (by default the one the checkpoint's tokenizer step names;
    LeRobot checkpoints ship no tokenizer), else one error naming all three ways."""
    if explicit is not None:
        if Path(explicit).expanduser().exists():
            return Path(explicit).expanduser()
        if _looks_like_hub_id(str(explicit)):
            return fetch_tokenizer(str(explicit))
        raise CheckpointError(f"tokenizer {explicit} is neither a file, a directory nor a hub id (owner/name)")
    for candidate in (checkpoint_dir / "tokenizer", checkpoint_dir / "tokenizer.json",
                      checkpoint_dir / "tokenizer.model"):
        if candidate.exists():
            return candidate
    if hub_name is None:
        hub_name = tokenizer_name_of(checkpoint_dir)
    if hub_name:
        return fetch_tokenizer(hub_name)
    raise CheckpointError(f"no tokenizer for {checkpoint_dir}: {_WAYS} (the PaliGemma tokenizer, "
                          "google/paligemma-3b-pt-224)")
