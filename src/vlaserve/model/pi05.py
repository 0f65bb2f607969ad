"""Pi0.5: SigLIP + Gemma-2B prefix, Gemma-300M action expert, flow-matching sampler.

The prefix (images + prompt tokens) runs once per call and leaves per-layer K/V; each Euler
step then runs only the expert over the action tokens, attending to that K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .gemma import GemmaActionExpert, GemmaPrefixLM, attention_bias
from .siglip import SiglipVision


@dataclass
class PrefixContext:
    """What the denoising steps need from the prefix pass."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per VLM layer, [B, Hkv, P, D], keys post-RoPE
    pad_mask: torch.Tensor  # [B, P] bool, valid prefix tokens
    num_valid: torch.Tensor  # [B] int64; the first action token's position


@dataclass
class RTCGuidance:
    """Real-time chunking: pull the new chunk's start towards the previous chunk's left-over.

    prev [B, H, A] (model space, zero-padded), weights [B, H] per-timestep guidance weights
    (all zero for items without RTC, which leaves them unguided exactly), max_weight [B].
    """

    prev: torch.Tensor
    weights: torch.Tensor
    max_weight: torch.Tensor

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


def sinusoidal_time_embedding(t: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """t [B] float32 -> [B, dim] float32; periods and angles in float64 like the reference."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = (1.0 / period * 2 * math.pi)[None, :] * t.double()[:, None]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def euler_times(num_steps: int) -> list[float]:
    """t of each step: float32(1 + k·dt), the sum taken in float64."""
    dt = -1.0 / num_steps
    return [float(torch.tensor(1.0 + k * dt, dtype=torch.float32)) for k in range(num_steps)]


class PaliGemmaFlowModel(nn.Module):
    """What Pi0 and Pi0.5 share: the SigLIP + PaliGemma prefix, run once into per-layer K/V, and the
    Euler loop. A family adds its expert and defines `time_condition` and `velocity`."""

    condition_name = "adarms_cond"  # what `time_condition` returns, as the trace names it

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.vision = SiglipVision(config.vision)
        self.projector = nn.Linear(config.vision.width, config.vlm.width)
        self.vlm = GemmaPrefixLM(config.vlm)

    # ---- prefix -------------------------------------------------------------------------
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, N, 3, H, W] in [-1, 1] -> image tokens [B, N * patches, W_vlm]."""
        b, n = images.shape[:2]
        feats = self.vision(images.flatten(0, 1))
        tokens = self.projector(feats.to(self.projector.weight.dtype))
        return tokens.reshape(b, n * tokens.shape[1], tokens.shape[2])

    def embed_prefix(self, images, image_masks, tokens, token_mask):
        """-> prefix embeddings [B, P, W] (images in slot order, then scaled token embeddings), pad mask [B, P]."""
        image_tokens = self.embed_images(images)
        lang = self.vlm.embed(tokens)
        embs = torch.cat([image_tokens.to(lang.dtype), lang], dim=1)
        per_image = image_tokens.shape[1] // images.shape[1]
        pad_mask = torch.cat([image_masks.repeat_interleave(per_image, dim=1), token_mask], dim=1)
        return embs, pad_mask

    def compute_prefix(self, embs: torch.Tensor, pad_mask: torch.Tensor) -> PrefixContext:
        # Fully bidirectional among valid tokens; padding neither attends nor is attended to,
        # and does not advance positions.
        positions = pad_mask.long().cumsum(1) - 1
        bias = attention_bias(pad_mask[:, None, :] & pad_mask[:, :, None])
        kv = self.vlm.prefix_kv(embs, bias, positions)
        return PrefixContext(kv=kv, pad_mask=pad_mask, num_valid=pad_mask.long().sum(1))

    # ---- denoising ----------------------------------------------------------------------
    def action_attention(self, ctx: PrefixContext, horizon: int):
        """Mask bias and positions of the action tokens: they see every valid prefix token and each other."""
        b = ctx.pad_mask.shape[0]
        allowed = torch.cat(
            [ctx.pad_mask[:, None, :].expand(b, horizon, -1),
             torch.ones(b, horizon, horizon, dtype=torch.bool, device=ctx.pad_mask.device)], dim=2)
        positions = ctx.num_valid[:, None] + torch.arange(horizon, device=ctx.pad_mask.device)
        return attention_bias(allowed), positions

    def denoise(self, ctx: PrefixContext, noise: torch.Tensor, num_steps: int,
                rtc: RTCGuidance | None = None, trace: dict | None = None) -> torch.Tensor:
        """Euler integration of the flow from t=1 (noise) to t=0 (actions), in float32."""
        dt = -1.0 / num_steps
        attn = self.action_attention(ctx, noise.shape[1])
        x = noise.float()
        for t in euler_times(num_steps):
            t_batch = torch.full((x.shape[0],), t, dtype=torch.float32, device=x.device)
            cond = self.time_condition(t_batch)
            v = self.velocity(x, cond, ctx, attn)
            if trace is not None:
                for name, value in (("x_t", x), ("v_t", v), (self.condition_name, cond)):
                    trace.setdefault(name, []).append(value)
            if rtc is not None:
                v = rtc.guide(v, x, t)
                if trace is not None:
                    trace.setdefault("v_guided", []).append(v)
            x = x + dt * v
        return x


class Pi05Model(PaliGemmaFlowModel):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        e = config.expert
        self.expert = GemmaActionExpert(e)
        self.action_in_proj = nn.Linear(config.max_action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, config.max_action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)

    def time_condition(self, t: torch.Tensor) -> torch.Tensor:
        """t [B] float32 -> AdaRMS condition [B, W_expert] (fp32)."""
        c = self.config
        emb = sinusoidal_time_embedding(t, self.expert.dims.width, c.time_min_period, c.time_max_period)
        w = self.time_mlp_in.weight
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb.to(w.dtype)))))

    def velocity(self, x_t: torch.Tensor, cond: torch.Tensor, ctx: PrefixContext, attn=None) -> torch.Tensor:
        """x_t [B, H, 32] float32 -> velocity [B, H, 32] float32."""
        bias, positions = attn if attn is not None else self.action_attention(ctx, x_t.shape[1])
        h = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype))
        out = self.expert(h, cond, ctx.kv, bias, positions)
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()

    @torch.no_grad()
    def sample(self, images, image_masks, tokens, token_mask, noise, num_steps: int,
               rtc: RTCGuidance | None = None) -> torch.Tensor:
        embs, pad_mask = self.embed_prefix(images, image_masks, tokens, token_mask)
        return self.denoise(self.compute_prefix(embs, pad_mask), noise, num_steps, rtc)
