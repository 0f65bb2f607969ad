"""Policy families: what differs between Pi0.5 and Pi0, in one place.

config.json's `type` picks the family once (`family_named`); everything downstream asks the family
instead of testing the type: the model class, the checkpoint key layout and fp32 set, the prompt
(with or without state bins), the default prompt length, and whether the normalized state goes to
the model (Pi0's state token). The processor steps each family saves are data in
processing/pipeline.py, keyed by the same name.

`load_policy_config` reads a checkpoint's config.json once and picks its family. Dims come from
`architecture.json` when present (tiny test checkpoints use it, since their config.json still names
the full-size variants), else from the variant names in config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from .checkpoint.weights import PI0_LAYOUT, PI05_LAYOUT, WeightLayout
from .config import GEMMA_VARIANTS, SIGLIP_SO400M_14, GemmaDims, ModelConfig, PolicyConfig, VisionDims
from .errors import CheckpointError
from .model.pi0 import Pi0Model
from .model.pi05 import Pi05Model
from .processing.prompt import pi0_prompt, pi05_prompt


@dataclass(frozen=True)
class Family:
    name: str  # config.json's type
    display: str
    weights: WeightLayout
    make_model: Callable[[PolicyConfig], nn.Module]
    # (task, normalized state) -> (prompt, state bins or None)
    prompt: Callable[[str, np.ndarray], tuple[str, np.ndarray | None]]
    prompt_end: str  # what a truncated prompt loses, for the warning
    default_max_token_len: int  # LeRobot's tokenizer_max_length default
    state_to_model: bool  # the normalized state, zero-padded to max_state_dim, is a model input

    def build_model(self, config: PolicyConfig) -> nn.Module:
        """The module tree without storage; weights arrive through checkpoint.weights.load_weights."""
        with torch.device("meta"):
            return self.make_model(config)


PI05 = Family("pi05", "Pi0.5", PI05_LAYOUT, lambda c: Pi05Model(c.model), pi05_prompt,
              prompt_end="the state and 'Action:'", default_max_token_len=200, state_to_model=False)
PI0 = Family("pi0", "Pi0", PI0_LAYOUT, lambda c: Pi0Model(c.model, max_state_dim=c.max_state_dim), pi0_prompt,
             prompt_end="the final newline", default_max_token_len=48, state_to_model=True)
FAMILIES = {f.name: f for f in (PI05, PI0)}


def family_named(policy_type, where: str = "config.json") -> Family:
    try:
        return FAMILIES[policy_type]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where} has type {policy_type!r}; vlaserve serves "
                              f"{' and '.join(FAMILIES)}") from None


def family_of(config: PolicyConfig) -> Family:
    return FAMILIES[config.policy_type]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _model_from_architecture(arch: dict, chunk_size: int, max_action_dim: int) -> ModelConfig:
    def gemma(d: dict) -> GemmaDims:
        return GemmaDims(
            width=d["width"], depth=d["depth"], mlp_dim=d["mlp_dim"], num_heads=d["num_heads"],
            num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"], vocab_size=d.get("vocab_size", 257152),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
        )

    v = arch["vision"]
    vision = VisionDims(
        width=v["hidden_size"], depth=v["num_layers"], mlp_dim=v["mlp_dim"], num_heads=v["num_heads"],
        head_dim=v["head_dim"], patch_size=v.get("patch_size", 14), image_size=v.get("image_size", 224),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
    )
    time = arch.get("policy", {}).get("time_embedding", {})
    return ModelConfig(
        vision=vision, vlm=gemma(arch["vlm"]), expert=gemma(arch["expert"]),
        max_action_dim=max_action_dim, chunk_size=chunk_size,
        time_min_period=time.get("min_period", 4e-3), time_max_period=time.get("max_period", 4.0),
    )


def load_policy_config(checkpoint_dir: Path) -> PolicyConfig:
    """Reads a LeRobot pi05 or pi0 `config.json` (+ optional `architecture.json`)."""
    cfg = _read_json(checkpoint_dir / "config.json")
    family = family_named(cfg.get("type", "pi05"), f"{checkpoint_dir}/config.json")
    _refuse_unreleased_features(cfg, f"{checkpoint_dir}/config.json")

    features = cfg.get("input_features") or {}
    cameras = [k.split("observation.images.", 1)[1] for k, f in features.items()
               if f.get("type") == "VISUAL" and k.startswith("observation.images.")]
    # LeRobot also writes the empty cameras into input_features when it saves: count each once.
    cameras += [name for name in (f"empty_camera_{i}" for i in range(int(cfg.get("empty_cameras", 0))))
                if name not in cameras]
    if not cameras:
        raise CheckpointError(f"{checkpoint_dir}/config.json declares no VISUAL input features")
    state = features.get("observation.state")
    action = (cfg.get("output_features") or {}).get("action")
    if state is None or action is None:
        raise CheckpointError(f"{checkpoint_dir}/config.json lacks observation.state or action features")

    chunk_size = int(cfg.get("chunk_size", 50))
    max_action_dim = int(cfg.get("max_action_dim", 32))
    arch_path = checkpoint_dir / "architecture.json"
    arch = _read_json(arch_path) if arch_path.exists() else None
    if arch is not None:
        model = _model_from_architecture(arch, chunk_size, max_action_dim)
    else:
        try:
            vlm = GEMMA_VARIANTS[cfg.get("paligemma_variant", "gemma_2b")]
            expert = GEMMA_VARIANTS[cfg.get("action_expert_variant", "gemma_300m")]
        except KeyError as e:
            raise CheckpointError(f"unknown Gemma variant {e.args[0]!r} (known: {sorted(GEMMA_VARIANTS)})") from None
        model = ModelConfig(SIGLIP_SO400M_14, vlm, expert, max_action_dim=max_action_dim, chunk_size=chunk_size,
                            time_min_period=float(cfg.get("min_period", 4e-3)),
                            time_max_period=float(cfg.get("max_period", 4.0)))

    state_dim, max_state_dim = int(state["shape"][0]), int(cfg.get("max_state_dim", 32))
    if family.state_to_model and state_dim > max_state_dim:
        raise CheckpointError(f"{checkpoint_dir}/config.json: observation.state has {state_dim} dims, more than "
                              f"max_state_dim {max_state_dim} (the state projection's input width)")
    resolution = tuple(cfg.get("image_resolution", (224, 224)))
    if resolution[0] != resolution[1] or resolution[0] != model.vision.image_size:
        raise CheckpointError(f"image_resolution {resolution} does not match the vision tower "
                              f"({model.vision.image_size}x{model.vision.image_size})")
    return PolicyConfig(
        model=model,
        cameras=tuple(cameras),
        state_dim=state_dim,
        action_dim=int(action["shape"][0]),
        num_inference_steps=int(cfg.get("num_inference_steps", 10)),
        max_token_len=int(cfg.get("tokenizer_max_length", family.default_max_token_len)),
        image_resolution=(int(resolution[0]), int(resolution[1])),
        is_demo=bool(arch and arch.get("demo")),
        policy_type=family.name,
        max_state_dim=max_state_dim,
        hub_id=_recorded_hub_id(cfg, checkpoint_dir),
    )


# Pi0.5 features of LeRobot's main branch that no release (0.6.1, what vlaserve matches) has: a checkpoint
# trained with them switched on computes another function, so it is refused rather than served as plain pi05.
UNRELEASED_FEATURES = {
    "use_visual_memory": "observation memory (MEM) over past camera frames",
    "use_proprioceptive_memory": "observation memory (MEM) over past states",
    "rtc_training_max_delay": "training-time real-time chunking",
}


def _refuse_unreleased_features(cfg: dict, where: str) -> None:
    used = [name for name in UNRELEASED_FEATURES if cfg.get(name)]  # false, 0 or null: off, the plain model
    if used:
        what = "; ".join(f"{name} ({UNRELEASED_FEATURES[name]})" for name in used)
        raise CheckpointError(
            f"{where} switches on {what}: a feature of LeRobot's main branch, in no LeRobot release, that vlaserve "
            f"does not support (it serves what LeRobot 0.6.1 computes). Serve a checkpoint trained without it; "
            f"inference-time real-time chunking needs no training flag (docs/client.md)")


def _recorded_hub_id(cfg: dict, checkpoint_dir: Path) -> str | None:
    """The hub id the checkpoint records: LeRobot's `repo_id` (written when it pushes to the hub), or the
    Hugging Face cache's folder name (models--OWNER--NAME/snapshots/COMMIT)."""
    repo_id = cfg.get("repo_id")
    if isinstance(repo_id, str) and repo_id.strip():
        return repo_id.strip()
    cached = next((part for part in checkpoint_dir.resolve().parts if part.startswith("models--")), None)
    return cached.removeprefix("models--").replace("--", "/", 1) if cached and "--" in cached[8:] else None
