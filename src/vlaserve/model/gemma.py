"""Gemma decoder pieces shared by the Pi0/Pi0.5 prefix LM and their action experts.

Both use multi-query attention (one K/V head), RoPE, GeGLU MLPs and RMSNorm. Pi0.5's expert
norms are adaptive (AdaRMS): scale, shift and a residual gate come from the time condition;
Pi0's expert uses the plain ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GemmaDims
from .fp8 import activation_dtype

# Additive mask value of the reference. Finite on purpose: a fully masked row (a padding
# query) then softmaxes to a uniform distribution instead of NaN.
MASK_VALUE = -2.3819763e38


def attention_bias(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, Q, K] -> additive float32 bias [B, Q, K]."""
    return torch.where(allowed, 0.0, MASK_VALUE).to(torch.float32)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, S] -> cos, sin [B, 1, S, head_dim] (computed in fp32, returned in `dtype`)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def mqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, K, D], bias [B, S, K] -> [B, S, Hq*D].

    Query heads that share a K/V head are folded into one longer query axis, so K/V are never
    repeated. Scores are softmaxed in fp32 like the reference's eager attention.
    """
    b, hq, s, d = q.shape
    hkv, kl = k.shape[1], k.shape[2]
    group = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, group * s, d), k.transpose(-1, -2)) * d**-0.5
    scores = scores.view(b, hkv, group, s, kl) + bias[:, None, None]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(b, hkv, group * s, kl), v).view(b, hq, s, d)
    return out.transpose(1, 2).reshape(b, s, hq * d)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm: the weight is stored as an offset from 1."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale and shift (and the following residual's gate) come from a condition."""

    def __init__(self, width: int, cond_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * width)

    def modulation(self, cond: torch.Tensor):
        """cond [B, C] -> scale, shift, gate, each [B, 1, width] in fp32."""
        return self.dense(cond.to(self.dense.weight.dtype)).float()[:, None].chunk(3, dim=-1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1 + scale) + shift).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, dims: GemmaDims):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.q_proj = nn.Linear(dims.width, dims.num_heads * dims.head_dim, bias=False)
        self.k_proj = nn.Linear(dims.width, dims.num_kv_heads * dims.head_dim, bias=False)
        self.v_proj = nn.Linear(dims.width, dims.num_kv_heads * dims.head_dim, bias=False)
        self.o_proj = nn.Linear(dims.num_heads * dims.head_dim, dims.width, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, W] -> q [B, Hq, S, D], k/v [B, Hkv, S, D]; q and k rotated."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class GemmaMLP(nn.Module):
    def __init__(self, dims: GemmaDims):
        super().__init__()
        self.gate_proj = nn.Linear(dims.width, dims.mlp_dim, bias=False)
        self.up_proj = nn.Linear(dims.width, dims.mlp_dim, bias=False)
        self.down_proj = nn.Linear(dims.mlp_dim, dims.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaLayer(nn.Module):
    def __init__(self, dims: GemmaDims, adarms_cond_dim: int | None = None):
        super().__init__()

        def norm() -> nn.Module:
            if adarms_cond_dim is None:
                return RMSNorm(dims.width, dims.rms_norm_eps)
            return AdaRMSNorm(dims.width, adarms_cond_dim, dims.rms_norm_eps)

        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(dims)
        self.post_attention_layernorm = norm()
        self.mlp = GemmaMLP(dims)


def uninitialized_embedding(num: int, width: int) -> nn.Embedding:
    """An embedding whose weights are left uninitialized: every model is filled from a checkpoint or
    with random values after construction. nn.Embedding's own normal_ init, on the meta device where
    the model is built, first imports torch._dynamo: ~3 s of every cold start."""
    return nn.Embedding(num, width, _weight=torch.empty(num, width))


class GemmaPrefixLM(nn.Module):
    """The PaliGemma language model, used only to fill the per-layer K/V of the prefix."""

    def __init__(self, dims: GemmaDims):
        super().__init__()
        self.dims = dims
        self.embed_tokens = uninitialized_embedding(dims.vocab_size, dims.width)
        self.layers = nn.ModuleList(GemmaLayer(dims) for _ in range(dims.depth))
        # Loaded for strictness; its output (the prefix hidden state) is never used.
        self.norm = RMSNorm(dims.width, dims.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return activation_dtype(self.layers[0].self_attn.q_proj)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # The reference scales by float32(sqrt(width)); the product is computed in fp32.
        scale = torch.tensor(self.dims.width**0.5, dtype=torch.float32)
        return (self.embed_tokens(tokens).float() * scale).to(self.embed_tokens.weight.dtype)

    def prefix_kv(self, embs: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor):
        """embs [B, P, W], bias [B, P, P], positions [B, P] -> per layer (k, v), each [B, Hkv, P, D]."""
        h = embs.to(self.dtype)
        cos, sin = rope_cos_sin(positions, self.dims.head_dim, self.dims.rope_theta, h.dtype)
        kv = []
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
            kv.append((k, v))
            if i == len(self.layers) - 1:
                break  # the last layer's attention output and MLP feed nothing we use
            h = h + layer.self_attn.o_proj(mqa_attention(q, k, v, bias))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return kv


class GemmaActionExpert(nn.Module):
    """The Gemma-300M action expert, no token embeddings. Pi0.5's norms are AdaRMS (`adarms`, the time
    condition modulates them and gates the residuals); Pi0's are plain RMSNorm with plain residuals."""

    def __init__(self, dims: GemmaDims, adarms: bool = True):
        super().__init__()
        self.dims = dims
        cond_dim = dims.width if adarms else None
        self.layers = nn.ModuleList(GemmaLayer(dims, adarms_cond_dim=cond_dim) for _ in range(dims.depth))
        eps = dims.rms_norm_eps
        self.norm = AdaRMSNorm(dims.width, dims.width, eps) if adarms else RMSNorm(dims.width, eps)

    @property
    def dtype(self) -> torch.dtype:
        return activation_dtype(self.layers[0].self_attn.q_proj)

    def forward(self, h, cond, prefix_kv, bias, positions, new_kv: list | None = None) -> torch.Tensor:
        """One pass over the action tokens.

        h [B, H, W] action embeddings; cond [B, W] time condition (None for plain norms); prefix_kv per
        layer (k, v); bias [B, H, P + H]; positions [B, H]. Returns the final-normed hidden state [B, H, W].
        `new_kv`, a list, receives each layer's (k, v) of these H tokens (post-RoPE).
        """
        h = h.to(self.dtype)
        cos, sin = rope_cos_sin(positions, self.dims.head_dim, self.dims.rope_theta, h.dtype)
        for layer, (prefix_k, prefix_v) in zip(self.layers, prefix_kv):
            x, gate = _expert_norm(layer.input_layernorm, h, cond)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            if new_kv is not None:
                new_kv.append((k, v))
            k, v = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
            h = _residual(h, layer.self_attn.o_proj(mqa_attention(q, k, v, bias)), gate)
            x, gate = _expert_norm(layer.post_attention_layernorm, h, cond)
            h = _residual(h, layer.mlp(x), gate)
        return _expert_norm(self.norm, h, cond)[0]


def _expert_norm(norm: nn.Module, h: torch.Tensor, cond: torch.Tensor | None):
    """-> normed h and the following residual's gate (None without a condition)."""
    if cond is None:
        return norm(h), None
    scale, shift, gate = norm.modulation(cond)
    return norm(h, scale, shift), gate


def _residual(h: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return h + out if gate is None else h + out * gate.to(h.dtype)
