"""A checkpoint's pre/post-processor pipelines, parsed strictly.

LeRobot saves the pipelines that turn a robot's observation into model inputs and the model's
output into actions (`policy_preprocessor.json`, `policy_postprocessor.json`); the loaded pipeline,
not config.json, is what the reference runs. Every step is either implemented here exactly as
LeRobot 0.6.1 runs it, or the load is refused with a CheckpointError naming the step and its
settings: a skipped step (a rename, a relative-action offset) gives a policy that runs and acts wrong.

Pipeline order (LeRobot's `make_pi05_pre_post_processors`, `make_pi0_pre_post_processors`):
  pi05 pre: rename -> to_batch -> relative_actions -> normalizer -> pi05_prepare_state_tokenizer -> tokenizer -> device
  pi0 pre:  rename -> to_batch -> pi0_new_line -> tokenizer -> device -> relative_actions -> normalizer
  post:     unnormalizer -> absolute_actions -> device
In both, relative_actions comes before the normalizer, so both action conversions work in raw
(un-normalized) units.

OpenPI-converted checkpoints (`assets/*/norm_stats.json`, no processor files) get their quantile
statistics and nothing else: OpenPI's data transforms (delta actions, ALOHA's joint flips, DROID's
action space) live in OpenPI's training config, not in the checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from ..config import PolicyConfig
from ..errors import CheckpointError
from .normalize import MODES, Normalization, Normalizer, find_openpi_norm_stats, load_openpi_normalization
from .steps import POSTPROCESSOR, PREPROCESSOR, Step, read_steps

log = logging.getLogger(__name__)

STATE, ACTION = "observation.state", "action"

# Each pipeline's steps in the reference's order, per policy family (config.json's type), with the
# settings each may carry. A step may be left out (older LeRobot saves have no relative/absolute
# steps) but never reordered: e.g. a relative step after the normalizer would cache the normalized state.
_SETTINGS = {
    "rename_observations_processor": {"rename_map"},
    "to_batch_processor": set(),
    "relative_actions_processor": {"enabled", "exclude_joints", "action_names"},
    "normalizer_processor": {"eps", "features", "norm_map", "normalize_observation_keys"},
    "pi05_prepare_state_tokenizer_processor_step": {"max_state_dim", "task_key", "include_state_in_prompt"},
    "pi0_new_line_processor": set(),  # the prompt's final newline (processing/prompt.py build_pi0_prompt)
    "tokenizer_processor": {"tokenizer_name", "max_length", "task_key", "padding_side", "padding", "truncation"},
    "device_processor": {"device", "float_dtype"},
    "unnormalizer_processor": {"eps", "features", "norm_map", "normalize_observation_keys"},
    "absolute_actions_processor": {"enabled"},
}


def _steps(*names: str) -> dict[str, set]:
    return {name: _SETTINGS[name] for name in names}


PRE_STEPS = {  # LeRobot 0.6.1's make_pi05_pre_post_processors / make_pi0_pre_post_processors
    "pi05": _steps("rename_observations_processor", "to_batch_processor", "relative_actions_processor",
                   "normalizer_processor", "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor",
                   "device_processor"),
    "pi0": _steps("rename_observations_processor", "to_batch_processor", "pi0_new_line_processor",
                  "tokenizer_processor", "device_processor", "relative_actions_processor", "normalizer_processor"),
}
POST_STEPS = _steps("unnormalizer_processor", "absolute_actions_processor", "device_processor")
REQUIRED_PRE = {"pi05": ("normalizer_processor", "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor"),
                "pi0": ("pi0_new_line_processor", "tokenizer_processor", "normalizer_processor")}
REQUIRED_POST = ("unnormalizer_processor",)
# Settings whose value decides the numbers and that we implement only as Pi0.5 writes them.
FIXED_SETTINGS = {
    "pi05_prepare_state_tokenizer_processor_step": {"task_key": "task", "include_state_in_prompt": True},
    "tokenizer_processor": {"task_key": "task", "padding_side": "right", "padding": "max_length",
                            "truncation": True},
}
FLOAT32_NAMES = (None, "float32")  # device_processor's float_dtype: anything else casts images and state


@dataclass(frozen=True)
class RelativeActions:
    """LeRobot's relative actions: the model predicts `action - state` on the masked dims; the
    post-processor adds the raw state of the observation back, after un-normalizing."""

    mask: np.ndarray  # bool [action_dim]: True where the state is added

    @staticmethod
    def build_mask(action_dim: int, exclude_joints, action_names) -> np.ndarray:
        """Dim i stays absolute when lower-cased action_names[i] contains (or equals) a lower-cased
        non-empty exclude token; no names or no tokens: every dim is relative; dims past the names
        are relative."""
        tokens = [str(t).lower() for t in (exclude_joints or []) if t]
        if action_names is None or not tokens:
            return np.ones(action_dim, dtype=bool)
        names = [str(n).lower() for n in action_names[:action_dim]]
        mask = [not any(t in name for t in tokens) for name in names]
        return np.array(mask + [True] * (action_dim - len(mask)), dtype=bool)

    def to_absolute(self, actions: np.ndarray, raw_states: np.ndarray) -> np.ndarray:
        """actions [B, T, A] (raw units, relative on the mask), raw_states [B, D] -> absolute actions.
        As the reference: `actions + state[:, :A]·mask` in float32 (excluded dims get state·0)."""
        dims = len(self.mask)
        states = np.asarray(raw_states, dtype=np.float32)[:, :dims]  # a 1-dim state broadcasts
        offset = states * self.mask.astype(np.float32)
        out = np.array(actions, dtype=np.float32, copy=True)
        out[..., :dims] += offset[:, None, :]
        return out


@dataclass(frozen=True)
class ProcessorPipeline:
    """What a checkpoint's processors do to the numbers, in the form the Policy applies it."""

    normalization: Normalization  # state_normalizer / action_unnormalizer, full width
    rename_map: dict[str, str] = field(default_factory=dict)  # LeRobot observation keys, one simultaneous pass
    relative_actions: RelativeActions | None = None
    tokenizer_name: str | None = None  # the hub id the tokenizer step names
    max_token_len: int | None = None

    @property
    def state_normalizer(self) -> Normalizer:
        return self.normalization.state

    @property
    def action_unnormalizer(self) -> Normalizer:
        return self.normalization.action

    def to_absolute(self, actions: np.ndarray, raw_states: np.ndarray) -> np.ndarray:
        """Un-normalized actions [B, T, A] -> what the robot receives (identity without relative actions)."""
        if self.relative_actions is None:
            return actions
        return self.relative_actions.to_absolute(actions, raw_states)

    @staticmethod
    def load(checkpoint_dir: Path, config: PolicyConfig) -> "ProcessorPipeline":
        """The checkpoint's pipeline, checked against `config` (the policy's, from vlaserve.family)."""
        checkpoint_dir = Path(checkpoint_dir)
        if (checkpoint_dir / PREPROCESSOR).exists() or (checkpoint_dir / POSTPROCESSOR).exists():
            return _load_lerobot(checkpoint_dir, config)
        norm_stats = find_openpi_norm_stats(checkpoint_dir)
        if norm_stats is None:
            raise CheckpointError(f"{checkpoint_dir} has no normalization statistics "
                                  f"({PREPROCESSOR} + {POSTPROCESSOR}, or assets/*/norm_stats.json)")
        return ProcessorPipeline(load_openpi_normalization(norm_stats))


def _check_steps(steps: list[Step], file: str, known: dict[str, set], required: tuple[str, ...],
                 policy_type: str) -> dict[str, Step]:
    order = list(known)
    by_name: dict[str, Step] = {}
    last = -1
    for step in steps:
        if step.name not in known:
            raise step.refuse(f"unknown step for a {policy_type} checkpoint; vlaserve implements "
                              f"{', '.join(order)}")
        if step.name in by_name:
            raise step.refuse("appears twice")
        if order.index(step.name) < last:
            raise step.refuse(f"out of the reference's order ({' -> '.join(order)})")
        last = order.index(step.name)
        extra = sorted(set(step.config) - known[step.name])
        if extra:
            raise step.refuse(f"unsupported settings {extra}")
        for setting, wanted in FIXED_SETTINGS.get(step.name, {}).items():
            if setting in step.config and step.config[setting] != wanted:
                raise step.refuse(f"{setting} must be {wanted!r}; other values are not implemented")
        by_name[step.name] = step
    missing = [name for name in required if name not in by_name]
    if missing:
        raise CheckpointError(f"{file} lacks the step(s) {missing} every {policy_type} checkpoint has")
    if "device_processor" in by_name and by_name["device_processor"].config.get("float_dtype") not in FLOAT32_NAMES:
        raise by_name["device_processor"].refuse("casting inputs/outputs to another float dtype is not implemented")
    return by_name


def _statistics(step: Step, checkpoint_dir: Path, key: str) -> dict[str, np.ndarray]:
    """The step's statistics of feature `key` (`<key>.<stat>` in its state file), as float32."""
    if step.state_file is None:
        return {}
    stats = load_file(str(checkpoint_dir / step.state_file))
    return {name[len(key) + 1:]: value.astype(np.float32) for name, value in stats.items()
            if name.startswith(key + ".")}


def feature_normalizer(step: Step, checkpoint_dir: Path, key: str, kind: str) -> Normalizer:
    """The reference's rule: the mode of the feature's type; IDENTITY, or no statistics for the key
    at all, leaves it unchanged; statistics present but incomplete stop the load."""
    mode = (step.config.get("norm_map") or {}).get(kind, "IDENTITY")
    if mode not in MODES:
        raise step.refuse(f"normalization mode {mode!r} for {kind} is not implemented")
    if mode == "IDENTITY":
        return Normalizer()
    stats = _statistics(step, checkpoint_dir, key)
    if not stats:
        log.warning("%s step %d: no statistics for %s; like the reference, it passes un-normalized",
                    step.file, step.index, key)
        return Normalizer()
    try:
        return Normalizer(mode, stats, float(step.config.get("eps", 1e-8)))
    except CheckpointError as e:
        raise step.refuse(f"{key}: {e}") from None


def _state_normalizer(step: Step, checkpoint_dir: Path) -> Normalizer:
    features = step.config.get("features") or {}
    if (step.config.get("norm_map") or {}).get("VISUAL", "IDENTITY") != "IDENTITY":
        normalized = [k for k, f in features.items()
                      if f.get("type") == "VISUAL" and _statistics(step, checkpoint_dir, k)]
        if normalized:
            raise step.refuse(f"image normalization ({', '.join(normalized)}) is not implemented")
    keys = step.config.get("normalize_observation_keys")
    if STATE not in features or (keys is not None and STATE not in keys):
        return Normalizer()  # the reference normalizes only listed features
    return feature_normalizer(step, checkpoint_dir, STATE, features[STATE].get("type"))


def _load_lerobot(checkpoint_dir: Path, config: PolicyConfig) -> ProcessorPipeline:
    kind = config.policy_type
    pre = _check_steps(read_steps(checkpoint_dir, PREPROCESSOR), PREPROCESSOR, PRE_STEPS[kind], REQUIRED_PRE[kind], kind)
    post = _check_steps(read_steps(checkpoint_dir, POSTPROCESSOR), POSTPROCESSOR, POST_STEPS, REQUIRED_POST, kind)

    rename_map = dict(pre["rename_observations_processor"].config.get("rename_map") or {}) \
        if "rename_observations_processor" in pre else {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in rename_map.items()):
        raise pre["rename_observations_processor"].refuse("rename_map must map keys to keys")

    tokenizer = pre["tokenizer_processor"]
    max_length = int(tokenizer.config.get("max_length", 512))  # the step's default
    if max_length != config.max_token_len:
        raise tokenizer.refuse(f"max_length {max_length} differs from config.json's tokenizer_max_length "
                               f"{config.max_token_len}; the reference uses the step's value")

    normalization = Normalization(
        state=_state_normalizer(pre["normalizer_processor"], checkpoint_dir),
        action=feature_normalizer(post["unnormalizer_processor"], checkpoint_dir, ACTION, "ACTION"),
        source="lerobot")
    return ProcessorPipeline(normalization, rename_map, _relative_actions(pre, post, config),
                             tokenizer.config.get("tokenizer_name"), max_length)


def _relative_actions(pre: dict[str, Step], post: dict[str, Step], config: PolicyConfig) -> RelativeActions | None:
    relative, absolute = pre.get("relative_actions_processor"), post.get("absolute_actions_processor")
    relative_on = relative is not None and bool(relative.config.get("enabled", False))
    absolute_on = absolute is not None and bool(absolute.config.get("enabled", False))
    if absolute_on and not relative_on:
        raise absolute.refuse("enabled, but the pre-processor has no enabled relative_actions_processor "
                              "to take the state from (the reference refuses to run)")
    if relative_on and not absolute_on:
        raise relative.refuse("enabled, but the post-processor does not turn the actions back into absolute "
                              "ones; the robot would receive offsets")
    if not relative_on:
        return None
    if config.state_dim != 1 and config.state_dim < config.action_dim:
        raise relative.refuse(f"state dim {config.state_dim} < action dim {config.action_dim}: the reference "
                              "adds state dim i to action dim i")
    return RelativeActions(RelativeActions.build_mask(config.action_dim, relative.config.get("exclude_joints"),
                                                      relative.config.get("action_names")))


def load_normalization(checkpoint_dir: Path, config: PolicyConfig) -> Normalization:
    """The state and action normalization a checkpoint's processor files (or norm_stats.json) define."""
    return ProcessorPipeline.load(checkpoint_dir, config).normalization
