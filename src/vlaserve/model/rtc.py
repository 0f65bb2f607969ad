"""Real-time chunking (RTC) guidance, as the reference computes it: the new chunk's start is pulled
towards the previous chunk's unexecuted actions, by per-timestep weights and a clipped guidance
weight. Used by both families' Euler loop (model/flow.py) and by the fast path."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass
class RTCGuidance:
    """Real-time chunking: pull the new chunk's start towards the previous chunk's left-over.

    prev [B, H, A] (model space, zero-padded), weights [B, H] per-timestep guidance weights
    (all zero for items without RTC, which leaves them unguided exactly), max_weight [B].
    """

    prev: torch.Tensor
    weights: torch.Tensor
    max_weight: torch.Tensor

    def to(self, device) -> "RTCGuidance":
        return RTCGuidance(*(t.to(device, non_blocking=True) for t in (self.prev, self.weights, self.max_weight)))

    def guide(self, v: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor:
        error = (self.prev - (x - t * v)) * self.weights[..., None]
        # With flow matching's linear path, d(x - t·v)/dx is the identity when v is held fixed,
        # so the vector-Jacobian product of the reference's autograd call is `error` itself.
        return v - rtc_guidance_weight(t, self.max_weight)[:, None, None] * error


def rtc_guidance_weight(t: float, max_weight: torch.Tensor) -> torch.Tensor:
    """Guidance weight at time t, per item ([B] float32), clipped at `max_weight`.

    The reference's formula in its own arithmetic: float32 tensors, inf -> max_weight, NaN -> 0.
    """
    tau = torch.tensor(1 - t, dtype=torch.float32, device=max_weight.device)
    one_minus_sq = (1 - tau) ** 2
    inv_r2 = (one_minus_sq + tau**2) / one_minus_sq
    c = (1 - tau) / tau
    c = torch.where(torch.isposinf(c), max_weight, torch.nan_to_num(c, posinf=0.0))
    g = c * inv_r2
    g = torch.where(torch.isposinf(g), max_weight, torch.nan_to_num(g, posinf=0.0))
    return torch.minimum(g, max_weight)


def guidance_table(times: list[float], max_weight: torch.Tensor) -> torch.Tensor:
    """[S, B] float32 on the host: `rtc_guidance_weight` at each step's time for each item, as the Euler
    loop computes it step by step (the same float32 operations, each exact or correctly rounded on any
    device: the same values). A robot keeps its max weight from call to call, so each (schedule, max
    weight) is computed once."""
    times = tuple(times)
    return torch.stack([_guidance_column(times, w) for w in max_weight.tolist()], dim=1)


@functools.lru_cache(maxsize=1024)
def _guidance_column(times: tuple[float, ...], max_weight: float) -> torch.Tensor:
    weight = torch.tensor([max_weight], dtype=torch.float32)
    return torch.cat([rtc_guidance_weight(t, weight) for t in times])


def rtc_prefix_weights(inference_delay: int, execution_horizon: int, horizon: int, schedule: str = "linear"):
    """Per-timestep guidance weights [horizon] (the reference's prefix attention schedule)."""
    start, end = min(inference_delay, execution_horizon), execution_horizon
    w = torch.zeros(horizon)
    if schedule == "zeros":
        w[:start] = 1.0
        return w
    if schedule == "ones":
        w[:end] = 1.0
        return w
    if schedule not in ("linear", "exp"):
        raise ValueError(f"unknown RTC schedule {schedule!r} (linear, exp, ones, zeros)")
    n = min(end, horizon) - start
    ramp = torch.linspace(1, 0, n + 2)[1:-1] if end > start and n > 0 else torch.zeros(0)
    if schedule == "exp":
        ramp = ramp * torch.expm1(ramp).div(math.e - 1)
    w[start : start + len(ramp)] = ramp
    w[: min(start, horizon)] = 1.0
    return w
