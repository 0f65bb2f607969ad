"""Normalization of state and actions, with statistics from the checkpoint.

LeRobot checkpoints carry a mode per feature type (the normalizer step's `norm_map`); each mode is
computed here in float32 with the reference's operation order and eps rule (LeRobot 0.6.1
`normalize_processor.py`), since a different order or eps moves values by ~1e-6, enough to flip
a state bin:
- QUANTILES / QUANTILE10 / MIN_MAX: `2(x - lo)/d - 1`, eps replaces d only where hi == lo.
  Inverse: QUANTILES and QUANTILE10 `(y + 1)·d/2 + lo`, MIN_MAX `(y + 1)/2·d + lo`.
- MEAN_STD: `(x - mean)/(std + eps)`, inverse `y·std + mean` (no eps).
- IDENTITY: unchanged.
OpenPI `norm_stats.json` quantiles always add 1e-6 to the denominator instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

# mode -> (low statistic, high statistic) for the modes that map [low, high] onto [-1, 1].
RANGE_STATS = {"QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "MIN_MAX": ("min", "max")}
MODES = ("IDENTITY", "MEAN_STD", *RANGE_STATS)

_ONE, _TWO = np.float32(1.0), np.float32(2.0)


def required_stats(mode: str) -> tuple[str, ...]:
    return ("mean", "std") if mode == "MEAN_STD" else RANGE_STATS.get(mode, ())


@dataclass(frozen=True)
class Normalizer:
    """One feature's (un)normalization. `stats` holds float32 [D] arrays named as LeRobot names them."""

    mode: str = "IDENTITY"
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    eps: float = 1e-8
    always_add_eps: bool = False  # OpenPI's quantile rule

    def __post_init__(self):
        if self.mode not in MODES:
            raise CheckpointError(f"normalization mode {self.mode!r} is not supported (known: {', '.join(MODES)})")
        missing = [s for s in required_stats(self.mode) if s not in self.stats]
        if missing:
            raise CheckpointError(f"{self.mode} normalization needs the statistics {missing}")

    @functools.cached_property
    def denom(self) -> np.ndarray:
        """The span a range mode divides by, with its eps rule (computed once: the stats are fixed)."""
        low, high = (self.stats[s] for s in RANGE_STATS[self.mode])
        span = (high - low).astype(np.float32)
        if self.always_add_eps:
            return (span + np.float32(self.eps)).astype(np.float32)
        return np.where(span == 0, np.float32(self.eps), span).astype(np.float32)

    def _range(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        return self.stats[RANGE_STATS[self.mode][0]][:d], self.denom[:d]

    def normalize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        d = x.shape[-1]
        if self.mode == "IDENTITY":
            return x
        if self.mode == "MEAN_STD":
            mean, std = self.stats["mean"][:d], self.stats["std"][:d]
            return ((x - mean) / (std + np.float32(self.eps))).astype(np.float32)
        low, span = self._range(d)
        return (_TWO * (x - low) / span - _ONE).astype(np.float32)

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.float32)
        d = y.shape[-1]
        if self.mode == "IDENTITY":
            return y
        if self.mode == "MEAN_STD":
            return (y * self.stats["std"][:d] + self.stats["mean"][:d]).astype(np.float32)
        low, span = self._range(d)
        if self.mode == "MIN_MAX":
            return ((y + _ONE) / _TWO * span + low).astype(np.float32)
        return ((y + _ONE) * span / _TWO + low).astype(np.float32)

    def cut(self, dim: int) -> "Normalizer":
        used = {s: self.stats[s] for s in required_stats(self.mode)}
        short = [f"{s} ({len(v)})" for s, v in used.items() if len(v) < dim]
        if short:
            raise CheckpointError(f"normalization statistics {', '.join(short)} cover fewer dims than the "
                                  f"policy's {dim}")
        return Normalizer(self.mode, {s: v[:dim] for s, v in used.items()}, self.eps, self.always_add_eps)


def QuantileNormalizer(q01, q99, eps: float = 1e-8, always_add_eps: bool = False) -> Normalizer:
    """Quantile normalization from q01/q99 (Pi0.5's default mode)."""
    return Normalizer("QUANTILES", {"q01": np.asarray(q01, np.float32), "q99": np.asarray(q99, np.float32)},
                      eps, always_add_eps)


@dataclass(frozen=True)
class Normalization:
    state: Normalizer
    action: Normalizer
    source: str


def load_openpi_normalization(norm_stats_file: Path) -> Normalization:
    data = json.loads(norm_stats_file.read_text())
    stats = data.get("norm_stats", data)

    def quantiles(key: str) -> Normalizer:
        try:
            entry = stats[key]
            return QuantileNormalizer(entry["q01"], entry["q99"], eps=1e-6, always_add_eps=True)
        except KeyError as e:
            raise CheckpointError(f"{norm_stats_file}: missing {e.args[0]!r} (Pi0.5 needs q01/q99)") from None

    return Normalization(state=quantiles("state"), action=quantiles("actions"), source="openpi")


def find_openpi_norm_stats(checkpoint_dir: Path) -> Path | None:
    candidates = sorted(checkpoint_dir.glob("assets/*/norm_stats.json")) + sorted(checkpoint_dir.glob("norm_stats.json"))
    if len(candidates) > 1:
        raise CheckpointError(f"{checkpoint_dir} holds several norm_stats.json files ({[str(c) for c in candidates]}); "
                              "keep the one for your robot")
    return candidates[0] if candidates else None
