"""Pi0: the SigLIP + Gemma-2B prefix and Euler loop both families share (model/flow.py), with a plain
Gemma-300M expert.

Where Pi0 differs from Pi0.5:
- the normalized state enters as one expert token, `state_proj(state)`, not through the prompt;
- time enters through the action tokens, `action_time_mlp_out(silu(action_time_mlp_in(cat[action, time])))`,
  not through AdaRMS: the expert has plain RMSNorms and plain residuals.

The state token attends to the valid prefix and itself only, so its K/V depend on neither x_t nor t.
`with_state` computes them once per call and appends them to the prefix K/V; every Euler step then
runs the action tokens alone, exactly as Pi0.5's do (they see every valid context token and each
other), with the same mask, positions, denoise loop and RTC code. The reference recomputes the state
token at every step; the values are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .flow import PaliGemmaFlowModel, PrefixContext, sinusoidal_time_embedding
from .gemma import GemmaActionExpert, attention_bias
from .rtc import RTCGuidance


class Pi0Model(PaliGemmaFlowModel):
    condition_name = "time_emb"  # Pi0 has no AdaRMS: the step's condition is the raw time embedding

    def __init__(self, config: ModelConfig, max_state_dim: int = 32):
        super().__init__(config)
        e = config.expert
        self.expert = GemmaActionExpert(e, adarms=False)
        self.state_proj = nn.Linear(max_state_dim, e.width)
        self.action_in_proj = nn.Linear(config.max_action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, config.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * e.width, e.width)
        self.action_time_mlp_out = nn.Linear(e.width, e.width)

    @property
    def max_state_dim(self) -> int:
        return self.state_proj.in_features

    # ---- the state token, once per call ------------------------------------------------
    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        """Normalized state [B, D <= max_state_dim] -> the state token [B, W_expert].

        Zero-padded after normalization, as the reference does."""
        state = F.pad(state.float(), (0, self.max_state_dim - state.shape[-1]))
        return self.state_proj(state.to(self.state_proj.weight.dtype))

    def state_attention(self, ctx: PrefixContext):
        """Mask bias [B, 1, P + 1] and position [B, 1] of the state token: it sees the valid prefix and
        itself, never the action tokens (its own attention block), and sits right after the prefix."""
        allowed = torch.cat([ctx.pad_mask, torch.ones_like(ctx.pad_mask[:, :1])], dim=1)[:, None]
        return attention_bias(allowed), ctx.num_valid[:, None]

    def with_state(self, ctx: PrefixContext, state: torch.Tensor) -> PrefixContext:
        """The prefix context extended by the state token's per-layer expert K/V: a valid context token
        at position num_valid, so the action tokens that follow start at num_valid + 1."""
        bias, positions = self.state_attention(ctx)
        state_kv: list = []
        self.expert(self.embed_state(state)[:, None], None, ctx.kv, bias, positions, new_kv=state_kv)
        kv = [(torch.cat([pk, sk], dim=2), torch.cat([pv, sv], dim=2))
              for (pk, pv), (sk, sv) in zip(ctx.kv, state_kv)]
        pad_mask = torch.cat([ctx.pad_mask, torch.ones_like(ctx.pad_mask[:, :1])], dim=1)
        return PrefixContext(kv=kv, pad_mask=pad_mask, num_valid=ctx.num_valid + 1)

    # ---- denoising (the loop itself is PaliGemmaFlowModel.denoise) ---------------------
    def time_condition(self, t: torch.Tensor) -> torch.Tensor:
        """t [B] float32 -> sinusoidal time embedding [B, W_expert] (fp32)."""
        c = self.config
        return sinusoidal_time_embedding(t, self.expert.dims.width, c.time_min_period, c.time_max_period)

    def embed_actions(self, x_t: torch.Tensor, time_emb: torch.Tensor) -> torch.Tensor:
        """x_t [B, H, A], time_emb [B, W] -> action tokens [B, H, W]; the action embedding comes first
        in the concatenation and no activation follows the output layer."""
        actions = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype))
        time = time_emb.to(actions.dtype)[:, None].expand_as(actions)
        return self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([actions, time], dim=-1))))

    def velocity(self, x_t: torch.Tensor, time_emb: torch.Tensor, ctx: PrefixContext, attn=None) -> torch.Tensor:
        """x_t [B, H, 32] float32 -> velocity [B, H, 32] float32; `ctx` must come from `with_state`."""
        bias, positions = attn if attn is not None else self.action_attention(ctx, x_t.shape[1])
        out = self.expert(self.embed_actions(x_t, time_emb), None, ctx.kv, bias, positions)
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()

    @torch.no_grad()
    def sample(self, images, image_masks, tokens, token_mask, state, noise, num_steps: int,
               rtc: RTCGuidance | None = None) -> torch.Tensor:
        embs, pad_mask = self.embed_prefix(images, image_masks, tokens, token_mask)
        ctx = self.with_state(self.compute_prefix(embs, pad_mask), state)
        return self.denoise(ctx, noise, num_steps, rtc)
