"""Quantile normalization of state and actions, with statistics from the checkpoint.

Two sources, each with its own epsilon rule (they differ by ~1e-6, enough to flip a state bin):
- LeRobot processor files: eps replaces the denominator only where q99 == q01.
- OpenPI `norm_stats.json`: 1e-6 is always added to the denominator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from ..errors import CheckpointError


@dataclass(frozen=True)
class QuantileNormalizer:
    q01: np.ndarray  # float32 [D]
    q99: np.ndarray  # float32 [D]
    eps: float = 1e-8
    always_add_eps: bool = False  # OpenPI's rule

    @property
    def denom(self) -> np.ndarray:
        span = (self.q99 - self.q01).astype(np.float32)
        if self.always_add_eps:
            return (span + np.float32(self.eps)).astype(np.float32)
        return np.where(span == 0, np.float32(self.eps), span).astype(np.float32)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        d = x.shape[-1]
        return (np.float32(2.0) * (x - self.q01[:d]) / self.denom[:d] - np.float32(1.0)).astype(np.float32)

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.float32)
        d = y.shape[-1]
        return ((y + np.float32(1.0)) * self.denom[:d] / np.float32(2.0) + self.q01[:d]).astype(np.float32)

    def cut(self, dim: int) -> "QuantileNormalizer":
        if len(self.q01) < dim:
            raise CheckpointError(f"normalization stats cover {len(self.q01)} dims, the policy needs {dim}")
        return QuantileNormalizer(self.q01[:dim], self.q99[:dim], self.eps, self.always_add_eps)


@dataclass(frozen=True)
class Normalization:
    state: QuantileNormalizer
    action: QuantileNormalizer
    source: str


def _lerobot_step(checkpoint_dir: Path, pipeline_file: str, registry_name: str):
    path = checkpoint_dir / pipeline_file
    pipeline = json.loads(path.read_text())
    for step in pipeline.get("steps", []):
        if step.get("registry_name") == registry_name:
            if "state_file" not in step:
                raise CheckpointError(f"{path}: step {registry_name} names no state_file")
            config = step.get("config", {})
            stats = load_file(str(checkpoint_dir / step["state_file"]))
            return config, stats
    raise CheckpointError(f"{path} has no {registry_name} step")


def _quantiles(stats: dict, key: str, mode: str, eps: float, where: str) -> QuantileNormalizer:
    if mode != "QUANTILES":
        raise CheckpointError(f"{where}: {key} uses {mode} normalization; Pi0.5 checkpoints use QUANTILES")
    try:
        return QuantileNormalizer(stats[f"{key}.q01"].astype(np.float32), stats[f"{key}.q99"].astype(np.float32), eps)
    except KeyError as e:
        raise CheckpointError(f"{where}: missing statistic {e.args[0]}") from None


def load_lerobot_normalization(checkpoint_dir: Path) -> Normalization:
    pre_cfg, pre_stats = _lerobot_step(checkpoint_dir, "policy_preprocessor.json", "normalizer_processor")
    post_cfg, post_stats = _lerobot_step(checkpoint_dir, "policy_postprocessor.json", "unnormalizer_processor")

    def mode(cfg: dict, kind: str) -> str:
        return cfg.get("norm_map", {}).get(kind, "QUANTILES")

    state = _quantiles(pre_stats, "observation.state", mode(pre_cfg, "STATE"), float(pre_cfg.get("eps", 1e-8)),
                       "policy_preprocessor.json")
    action = _quantiles(post_stats, "action", mode(post_cfg, "ACTION"), float(post_cfg.get("eps", 1e-8)),
                        "policy_postprocessor.json")
    return Normalization(state=state, action=action, source="lerobot")


def load_openpi_normalization(norm_stats_file: Path) -> Normalization:
    data = json.loads(norm_stats_file.read_text())
    stats = data.get("norm_stats", data)

    def quantiles(key: str) -> QuantileNormalizer:
        try:
            entry = stats[key]
            return QuantileNormalizer(np.asarray(entry["q01"], np.float32), np.asarray(entry["q99"], np.float32),
                                      eps=1e-6, always_add_eps=True)
        except KeyError as e:
            raise CheckpointError(f"{norm_stats_file}: missing {e.args[0]!r} (Pi0.5 needs q01/q99)") from None

    return Normalization(state=quantiles("state"), action=quantiles("actions"), source="openpi")


def load_normalization(checkpoint_dir: Path) -> Normalization:
    if (checkpoint_dir / "policy_preprocessor.json").exists():
        return load_lerobot_normalization(checkpoint_dir)
    candidates = sorted(checkpoint_dir.glob("assets/*/norm_stats.json")) + sorted(checkpoint_dir.glob("norm_stats.json"))
    if len(candidates) == 1:
        return load_openpi_normalization(candidates[0])
    if len(candidates) > 1:
        raise CheckpointError(f"{checkpoint_dir} holds several norm_stats.json files ({[str(c) for c in candidates]}); "
                              "keep the one for your robot")
    raise CheckpointError(f"{checkpoint_dir} has no normalization statistics "
                          "(policy_preprocessor.json + policy_postprocessor.json, or assets/*/norm_stats.json)")
