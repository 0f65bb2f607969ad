"""Prompt building and tokenization.

Pi0.5 sees the robot state only through its prompt: each normalized dimension is discretized
into one of 256 bins and written as a number.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

log = logging.getLogger(__name__)

_BIN_EDGES = np.linspace(-1, 1, 256 + 1)[:-1]


def discretize_state(normalized_state: np.ndarray) -> np.ndarray:
    """float32 [D] in about [-1, 1] -> int64 bins; below -1 gives -1, 1 - 2/256 and above give 255."""
    return (np.digitize(np.asarray(normalized_state, dtype=np.float32), _BIN_EDGES) - 1).astype(np.int64)


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def build_prompt(task: str, state_bins: np.ndarray) -> str:
    return f"Task: {clean_task(task)}, State: {' '.join(str(int(b)) for b in state_bins)};\nAction: "


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


def find_tokenizer(checkpoint_dir: Path, explicit: Path | None = None) -> Path:
    """An explicit path, else a tokenizer next to the weights, else a clear error."""
    if explicit is not None:
        if not Path(explicit).exists():
            raise CheckpointError(f"tokenizer {explicit} does not exist")
        return Path(explicit)
    for candidate in (checkpoint_dir / "tokenizer", checkpoint_dir / "tokenizer.json",
                      checkpoint_dir / "tokenizer.model"):
        if candidate.exists():
            return candidate
    raise CheckpointError(
        f"no tokenizer found in {checkpoint_dir} (looked for tokenizer/, tokenizer.json, tokenizer.model); "
        "pass one with --tokenizer PATH (the PaliGemma tokenizer, e.g. from google/paligemma-3b-pt-224)")
