"""What Pi0 and Pi0.5 share: the SigLIP + PaliGemma prefix, run once per call into per-layer K/V
(`PrefixContext`), and the flow-matching sampler's Euler loop over the family's expert (its times,
`euler_times`, and the sinusoidal time embedding both families feed their expert)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from .gemma import GemmaPrefixLM, attention_bias
from ..types import RTCGuidance
from .rtc import guide
from .siglip import SiglipVision


@dataclass
class PrefixContext:
    """What the denoising steps need from the prefix pass."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per VLM layer, [B, Hkv, P, D], keys post-RoPE
    pad_mask: torch.Tensor  # [B, P] bool, valid prefix tokens
    num_valid: torch.Tensor  # [B] int64; the first action token's position


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
                v = guide(rtc, v, x, t)
                if trace is not None:
                    trace.setdefault("v_guided", []).append(v)
            x = x + dt * v
        return x
