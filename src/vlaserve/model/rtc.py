"""Real-time chunking (RTC) guidance, as the reference computes it: the new chunk's start is pulled
towards the previous chunk's unexecuted actions, by per-timestep weights and a clipped guidance
weight. Used by both families' Euler loop (model/flow.py) and by the fast path."""

from __future__ import annotations

import functools

import torch

from ..types import RTCGuidance


def guide(rtc: RTCGuidance, v: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor:
    """The velocity `v` at `x`, time t, pulled towards the previous chunk's left-over."""
    error = (rtc.prev - (x - t * v)) * rtc.weights[..., None]
    # With flow matching's linear path, d(x - t·v)/dx is the identity when v is held fixed,
    # so the vector-Jacobian product of the reference's autograd call is `error` itself.
    return v - rtc_guidance_weight(t, rtc.max_weight)[:, None, None] * error


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
