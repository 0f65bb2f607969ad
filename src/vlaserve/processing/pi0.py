"""Pi0's prompt and its mean/std normalization (LeRobot's `MEAN_STD` rule).

Pi0 keeps the state out of the prompt: the prompt is the raw task plus a newline, and the normalized
state goes to the model's state token. Images and tokenization are Pi0.5's (processing/images.py,
PromptTokenizer), with a default of 48 tokens instead of 200.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .normalize import Normalization, _lerobot_step

DEFAULT_MAX_TOKEN_LEN = 48  # LeRobot's PI0Config.tokenizer_max_length


def build_pi0_prompt(task: str) -> str:
    """The raw task with a final newline (LeRobot's Pi0NewLineProcessor): no strip, no `_` or inner
    newline replacement, and a task that already ends in a newline is left as it is."""
    return task if task.endswith("\n") else task + "\n"


@dataclass(frozen=True)
class MeanStdNormalizer:
    """LeRobot's MEAN_STD: `(x − mean)/(std + eps)` in, `y·std + mean` out.

    The eps is always added going in (a float32 sum that differs from std wherever std < 0.25) and
    never coming out, so the two are not exact inverses: that is the reference's arithmetic.
    """

    mean: np.ndarray  # float32 [D]
    std: np.ndarray  # float32 [D]
    eps: float = 1e-8

    def normalize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        d = x.shape[-1]
        return ((x - self.mean[:d]) / (self.std[:d] + np.float32(self.eps))).astype(np.float32)

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.float32)
        d = y.shape[-1]
        return (y * self.std[:d] + self.mean[:d]).astype(np.float32)

    def cut(self, dim: int) -> "MeanStdNormalizer":
        if len(self.mean) < dim:
            raise CheckpointError(f"normalization stats cover {len(self.mean)} dims, the policy needs {dim}")
        return MeanStdNormalizer(self.mean[:dim], self.std[:dim], self.eps)


def _mean_std(stats: dict, key: str, mode: str, eps: float, where: str) -> MeanStdNormalizer:
    if mode != "MEAN_STD":
        raise CheckpointError(f"{where}: {key} uses {mode} normalization; vlaserve's Pi0 supports MEAN_STD")
    try:
        return MeanStdNormalizer(stats[f"{key}.mean"].astype(np.float32), stats[f"{key}.std"].astype(np.float32), eps)
    except KeyError as e:
        raise CheckpointError(f"{where}: missing statistic {e.args[0]}") from None


def load_lerobot_mean_std(checkpoint_dir: Path) -> Normalization:
    """State statistics from the pre-processor's normalizer step, action statistics from the
    post-processor's unnormalizer step, each with its own eps and mode (Pi0's default is MEAN_STD)."""
    normalizers = []
    for pipeline, step, key, kind in (("policy_preprocessor.json", "normalizer_processor", "observation.state", "STATE"),
                                      ("policy_postprocessor.json", "unnormalizer_processor", "action", "ACTION")):
        cfg, stats = _lerobot_step(checkpoint_dir, pipeline, step)
        mode = cfg.get("norm_map", {}).get(kind, "MEAN_STD")
        normalizers.append(_mean_std(stats, key, mode, float(cfg.get("eps", 1e-8)), pipeline))
    return Normalization(*normalizers, source="lerobot")
