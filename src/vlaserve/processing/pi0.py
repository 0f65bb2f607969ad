"""Pi0's prompt and its mean/std normalization (LeRobot's `MEAN_STD` rule).

Pi0 keeps the state out of the prompt: the prompt is the raw task plus a newline, and the normalized
state goes to the model's state token. Images and tokenization are Pi0.5's (processing/images.py,
PromptTokenizer), with a default of 48 tokens instead of 200.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .normalize import Normalization
from .pipeline import feature_normalizer, read_steps

DEFAULT_MAX_TOKEN_LEN = 48  # LeRobot's PI0Config.tokenizer_max_length


def build_pi0_prompt(task: str) -> str:
    """The raw task with a final newline (LeRobot's Pi0NewLineProcessor): no strip, no `_` or inner
    newline replacement, and a task that already ends in a newline is left as it is."""
    return task if task.endswith("\n") else task + "\n"


def load_lerobot_mean_std(checkpoint_dir: Path) -> Normalization:
    """State statistics from the pre-processor's normalizer step, action statistics from the
    post-processor's unnormalizer step, each with its own eps (Pi0's default mode is MEAN_STD,
    `(x − mean)/(std + eps)` in and `y·std + mean` out: the reference's arithmetic, not exact inverses)."""
    normalizers = []
    for file, name, key, kind in (("policy_preprocessor.json", "normalizer_processor", "observation.state", "STATE"),
                                  ("policy_postprocessor.json", "unnormalizer_processor", "action", "ACTION")):
        step = next((s for s in read_steps(checkpoint_dir, file) if s.name == name), None)
        if step is None:
            raise CheckpointError(f"{checkpoint_dir / file} has no {name} step")
        normalizer = feature_normalizer(step, checkpoint_dir, key, kind)
        if normalizer.mode != "MEAN_STD":
            raise CheckpointError(f"{file}: {key} uses {normalizer.mode} normalization; vlaserve's Pi0 supports "
                                  "MEAN_STD")
        normalizers.append(normalizer)
    return Normalization(*normalizers, source="lerobot")
