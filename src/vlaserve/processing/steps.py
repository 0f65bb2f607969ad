"""The steps of a LeRobot checkpoint's processor files (policy_preprocessor.json and
policy_postprocessor.json) as saved: read, and the tokenizer step's hub id. processing/pipeline.py
checks and implements them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"


@dataclass(frozen=True)
class Step:
    file: str
    index: int
    name: str
    config: dict
    state_file: str | None

    def refuse(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.file} step {self.index} ({self.name}, settings {json.dumps(self.config)}): "
                               f"{why}")


def read_steps(checkpoint_dir: Path, file: str) -> list[Step]:
    path = checkpoint_dir / file
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (LeRobot checkpoints carry both processor files)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    steps = []
    for i, entry in enumerate(data.get("steps", [])):
        name = entry.get("registry_name")
        if name is None:  # saved by class path: only registered steps are implemented here
            raise CheckpointError(f"{file} step {i} names the class {entry.get('class')!r} instead of a "
                                  "registry_name; vlaserve implements only LeRobot's registered pi05 and pi0 steps")
        steps.append(Step(file, i, name, entry.get("config") or {}, entry.get("state_file")))
    return steps


def tokenizer_name_of(checkpoint_dir: Path) -> str | None:
    """The hub id the checkpoint's tokenizer step names (LeRobot checkpoints ship no tokenizer)."""
    if not (Path(checkpoint_dir) / PREPROCESSOR).exists():
        return None
    for step in read_steps(Path(checkpoint_dir), PREPROCESSOR):
        if step.name == "tokenizer_processor":
            return step.config.get("tokenizer_name")
    return None
