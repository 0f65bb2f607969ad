"""Prompt building and tokenization.

Pi0.5 sees the robot state only through its prompt: each normalized dimension is discretized
into one of 256 bins and written as a number. Pi0 keeps the state out of the prompt (it reaches
the model as a token of its own): its prompt is the raw task and a newline.
"""

from __future__ import annotations

import logging
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


def build_prompt(task: str, state_bins: np.ndarray) -> str:
    return f"Task: {clean_task(task)}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: "


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


@dataclass
class TokenizedPrompt:
    ids: np.ndarray  # int64 [max_len], right-padded with 0
    mask: np.ndarray  # bool [max_len]
    num_tokens: int  # before truncation
    truncated: bool


class PromptTokenizer:
    """PaliGemma-convention tokenization: BOS first, no EOS, right pad with id 0 to a fixed length."""

    def __init__(self, encode, bos_id: int, pad_id: int, source: str):
        self._encode = encode  # text -> ids without special tokens
        self.bos_id, self.pad_id, self.source = bos_id, pad_id, source

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
        ids = [self.bos_id, *self._encode(text)]
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
