"""SigLIP vision tower (no pooling head), as used by PaliGemma."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionDims
from .fp8 import activation_dtype
from .gemma import uninitialized_embedding


class SiglipAttention(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        inner = dims.num_heads * dims.head_dim
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        self.q_proj = nn.Linear(dims.width, inner)
        self.k_proj = nn.Linear(dims.width, inner)
        self.v_proj = nn.Linear(dims.width, inner)
        self.out_proj = nn.Linear(inner, dims.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        self.fc1 = nn.Linear(dims.width, dims.mlp_dim)
        self.fc2 = nn.Linear(dims.mlp_dim, dims.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm computed in the norm's precision (the serving dtype, as OpenPI), returned in the activation dtype."""
    return F.layer_norm(x.to(norm.weight.dtype), norm.normalized_shape, norm.weight, norm.bias, norm.eps).to(x.dtype)


class SiglipLayer(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dims.width, eps=dims.layer_norm_eps)
        self.self_attn = SiglipAttention(dims)
        self.layer_norm2 = nn.LayerNorm(dims.width, eps=dims.layer_norm_eps)
        self.mlp = SiglipMLP(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(layer_norm(self.layer_norm1, x))
        return x + self.mlp(layer_norm(self.layer_norm2, x))


class SiglipVision(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        self.dims = dims
        self.patch_embedding = nn.Conv2d(3, dims.width, kernel_size=dims.patch_size, stride=dims.patch_size)
        self.position_embedding = uninitialized_embedding(dims.num_patches, dims.width)
        self.layers = nn.ModuleList(SiglipLayer(dims) for _ in range(dims.depth))
        self.post_layernorm = nn.LayerNorm(dims.width, eps=dims.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [N, 3, H, W] in [-1, 1] -> [N, num_patches, width] in the layers' dtype."""
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(w.dtype)).flatten(2).transpose(1, 2)
        x = (x + self.position_embedding.weight).to(activation_dtype(self.layers[0].self_attn.q_proj))
        for layer in self.layers:
            x = layer(x)
        return layer_norm(self.post_layernorm, x)
