"""Fused weights for the fast path, packed once at load: Q/K/V and gate/up become one matrix each,
whose row slices the model's own parameters then are (so the fused tensor is the only copy and the
eager model keeps running on the same storage). Gemma's (1 + w) norm weights are folded, in fp32.
fp8 layers (precision "fp8") fuse the same way, their per-output-channel scales along with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.fp8 import E4M3, Fp8Linear
from ...model.pi05 import Pi05Model


def _adjacent_span(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose row slices `parts` already are (back to back in one storage), or None."""
    first = parts[0]
    for a, b in zip(parts, parts[1:]):
        if (b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or b.dtype != a.dtype
                or b.shape[1:] != a.shape[1:] or not (a.is_contiguous() and b.is_contiguous())
                or b.data_ptr() != a.data_ptr() + a.numel() * a.element_size()):
            return None
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _fuse(*linears, attr: str = "weight", views_only: bool = False) -> torch.Tensor:
    """The layers' weights (or biases, or fp8 scales: `attr`) as one tensor whose slices the layers'
    tensors are, so the fused tensor is the only copy: their span when they already lie back to back
    (offload slots), else a concatenation the tensors are re-pointed into (`views_only` forbids that)."""
    parts = [getattr(lin, attr) for lin in linears]
    span = _adjacent_span([p.data for p in parts])
    if span is not None:
        return span
    if views_only:
        raise ValueError("fused weights must alias the offload slots, but the parts are not adjacent there")
    if parts[0].dtype == E4M3:  # some CUDA builds have no fp8 cat kernel: concatenate the bytes
        fused = torch.cat([p.data.view(torch.uint8) for p in parts], dim=0).view(E4M3)
    else:
        fused = torch.cat([p.data for p in parts], dim=0)
    offset = 0
    for p in parts:
        p.data = fused[offset:offset + p.shape[0]]
        offset += p.shape[0]
    return fused


@dataclass(frozen=True)
class Fp8Weight:
    """An fp8 weight [N, K] (fused or not), its per-output-channel scales [N] and the static
    activation scale of its input (None: per token). Slicing takes rows of both."""

    data: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None

    def __getitem__(self, rows: slice) -> "Fp8Weight":
        return Fp8Weight(self.data[rows], self.scale[rows], self.input_scale)


def weight_of(*linears, views_only: bool = False) -> "torch.Tensor | Fp8Weight":
    """The layers' weights fused into one matrix (one layer: its own), as an Fp8Weight for fp8 layers.
    Fused fp8 layers share their input, so a static activation scale is the same for each of them."""
    data = linears[0].weight if len(linears) == 1 else _fuse(*linears, views_only=views_only)
    if not isinstance(linears[0], Fp8Linear):
        return data
    scale = linears[0].weight_scale if len(linears) == 1 else _fuse(*linears, attr="weight_scale")
    return Fp8Weight(data, scale, linears[0].input_scale)


def _folded(norm) -> torch.Tensor:
    """Gemma's RMSNorm weight as the kernels take it: (1 + w), in fp32."""
    return 1.0 + norm.weight.float()


@dataclass
class LayerWeights:
    qkv: "torch.Tensor | Fp8Weight"  # [(Hq + 2 Hkv) D, W]
    o: "torch.Tensor | Fp8Weight"
    gate_up: "torch.Tensor | Fp8Weight"  # [2 M, W]
    down: "torch.Tensor | Fp8Weight"
    norm1: torch.Tensor | None  # (1 + w), fp32; None for the AdaRMS expert
    norm2: torch.Tensor | None


class FusedWeights:
    @staticmethod
    def of(model: Pi05Model, views_only: bool = False) -> "FusedWeights":
        """One fusion per model: a second engine on the same model shares it instead of copying."""
        if getattr(model, "_fused_weights", None) is None:
            model._fused_weights = FusedWeights(model, views_only)
        fp8_now = isinstance(model.vlm.layers[0].self_attn.q_proj, Fp8Linear)
        if isinstance(model._fused_weights.vlm[0].qkv, Fp8Weight) != fp8_now:
            raise ValueError("the model's layers changed precision after their weights were fused: convert to fp8 "
                             "before building a fast path (or a copy of a model that had one)")
        return model._fused_weights

    def __init__(self, model: Pi05Model, views_only: bool = False):
        self._model = model

        def layer(lyr, ada: bool) -> LayerWeights:
            a, m = lyr.self_attn, lyr.mlp
            return LayerWeights(
                qkv=weight_of(a.q_proj, a.k_proj, a.v_proj, views_only=views_only and not ada), o=weight_of(a.o_proj),
                gate_up=weight_of(m.gate_proj, m.up_proj, views_only=views_only and not ada),
                down=weight_of(m.down_proj),
                norm1=None if ada else _folded(lyr.input_layernorm),
                norm2=None if ada else _folded(lyr.post_attention_layernorm))

        self.vlm = [layer(lyr, ada=False) for lyr in model.vlm.layers]
        self.expert = [layer(lyr, ada=True) for lyr in model.expert.layers]
        self.vision_qkv = []
        for lyr in model.vision.layers:
            a = lyr.self_attn
            self.vision_qkv.append((weight_of(a.q_proj, a.k_proj, a.v_proj, views_only=views_only),
                                    _fuse(a.q_proj, a.k_proj, a.v_proj, attr="bias")))

    @torch.no_grad()
    def refresh(self) -> None:
        """The folded norm weights computed again, in place, from the model's norms (weights loaded into
        the parameters after the fusion: the fused matrices are their storage, and need nothing)."""
        for lyr, lw in zip(self._model.vlm.layers, self.vlm):
            lw.norm1.copy_(_folded(lyr.input_layernorm))
            lw.norm2.copy_(_folded(lyr.post_attention_layernorm))
