"""Pi0.5: SigLIP + Gemma-2B prefix, Gemma-300M action expert with AdaRMS time conditioning,
flow-matching sampler (the shared prefix and Euler loop: model/flow.py).

The prefix (images + prompt tokens) runs once per call and leaves per-layer K/V; each Euler
step then runs only the expert over the action tokens, attending to that K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .flow import PaliGemmaFlowModel, PrefixContext, sinusoidal_time_embedding
from .gemma import GemmaActionExpert
from .rtc import RTCGuidance


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
