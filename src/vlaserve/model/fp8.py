"""FP8 (e4m3) linear layers: per-output-channel weight scales computed at load, activations
quantized per token (dynamic, the default) or with one calibrated scale per layer (static).

The product of the two fp8 operands is exact in fp32 and the scales are applied to the fp32
accumulator, so out[m, n] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k]. On CUDA (compute capability
8.9 and up, bfloat16 activations, K and N multiples of 16) torch._scaled_mm computes that on the fp8
tensor cores; everywhere else `linear_fp8` computes the same sum by dequantizing and multiplying in
fp32 (the emulation: the CPU's fp8 path and the reference the tests compare against).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value; e4m3fn has no infinity


def scales_for(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales mapping |values| <= amax onto [-448, 448]; an all-zero row gets scale 1 (any
    scale represents zeros exactly, and dividing by 0 would make NaNs)."""
    amax = amax.float()
    # Divided by a tensor, not the Python number: CUDA torch multiplies by a scalar divisor's rounded
    # reciprocal, 1 ulp off the quotient for some amax, so a GPU's scales would differ
    # from a CPU's and from the fast path's Triton quantizer (correctly rounded division).
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturating at +-448 (values past a static scale's range clip
    instead of becoming NaN). `scale` broadcasts against x."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scales [N]): one scale per output channel."""
    scale = scales_for(weight.detach().abs().amax(dim=1))
    return quantize(weight.detach(), scale[:, None]), scale


def quantize_rows(x2d: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (e4m3 [M, K], fp32 scales [M, 1]): each row (token) scaled by its own
    amax (dynamic), or every row by the calibrated `static_scale` (a 0-d tensor), saturating."""
    if static_scale is None:
        scale = scales_for(x2d.abs().amax(dim=1, keepdim=True))
    else:
        scale = static_scale.float().reshape(1, 1).expand(x2d.shape[0], 1).contiguous()
    return quantize(x2d, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


class QuantizedRows(NamedTuple):
    """Activations [M, K] quantized per row already, as quantize_rows gives them (on the fast path the
    kernel that produced them did it), and the dtype they had: the one the GEMM returns."""

    q: torch.Tensor  # e4m3 [M, K]
    scale: torch.Tensor  # fp32 [M, 1]
    dtype: torch.dtype


def scaled_mm_supported(device: torch.device, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm's row-wise fp8 GEMM runs this product: CUDA at compute capability
    8.9+ (Ada, Hopper, Blackwell), bfloat16 activations (row-wise scaling returns bfloat16 only),
    and the inner and output sizes multiples of 16 (its alignment rule)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    n, k = weight.shape
    return _fp8_tensor_cores(device.index) and k % 16 == 0 and n % 16 == 0


@lru_cache
def _fp8_tensor_cores(device_index: int | None) -> bool:
    """Asked once per device (the fast path calls linear_fp8 while it captures CUDA graphs)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def linear_fp8(x: "torch.Tensor | QuantizedRows", weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               quantizer=quantize_rows) -> torch.Tensor:
    """x [..., K] (any float dtype) @ dequant(weight [N, K] e4m3, weight_scale [N])^T + bias, with x
    quantized per token (or by `input_scale`); returned in x's dtype. `quantizer`: quantize_rows or
    a kernel computing the same (the fast path's, runtime/fast/fp8_kernels.py). x may come quantized
    per token already (QuantizedRows [M, K]; not for a layer with a static `input_scale`)."""
    n, k = weight.shape
    if isinstance(x, QuantizedRows):
        if input_scale is not None:
            raise ValueError("activations quantized per token were given to a layer with a static input scale")
        qx, sx, dtype, lead = x.q, x.scale, x.dtype, x.q.shape[:-1]
    else:
        qx, sx = quantizer(x.reshape(-1, k), input_scale)
        dtype, lead = x.dtype, x.shape[:-1]
    if scaled_mm_supported(qx.device, dtype, weight):
        # Row-major activations (a strided input quantizes into its own layout), column-major weights.
        out = torch._scaled_mm(qx.contiguous(), weight.t(), scale_a=sx, scale_b=weight_scale.view(1, n),
                               bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
    else:
        out = F.linear(dequantize(qx, sx), dequantize(weight, weight_scale[:, None]),
                       None if bias is None else bias.float()).to(dtype)
    return out.view(*lead, n)


class Fp8Linear(nn.Module):
    """A drop-in for nn.Linear with its weight in e4m3 (half of bf16's bytes) and per-output-channel
    scales; the bias and the activations stay in the serving dtype."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activation_dtype: torch.dtype, input_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.register_buffer("input_scale", input_scale)
        self.activation_dtype = activation_dtype
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @staticmethod
    def from_linear(linear: nn.Linear, input_scale: float | None = None) -> "Fp8Linear":
        weight, scale = quantize_weight(linear.weight)
        static = None if input_scale is None else torch.tensor(input_scale, dtype=torch.float32,
                                                                device=weight.device)
        return Fp8Linear(weight, scale, linear.bias, linear.weight.dtype, static)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_fp8(x, self.weight, self.weight_scale, self.bias, self.input_scale)

    def extra_repr(self) -> str:
        mode = "dynamic" if self.input_scale is None else "static"
        return f"in_features={self.in_features}, out_features={self.out_features}, activations={mode}"


def activation_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer takes and returns: its weight's, or an fp8 layer's activation dtype."""
    return linear.activation_dtype if isinstance(linear, Fp8Linear) else linear.weight.dtype


def fp8_targets(model: nn.Module, expert: bool = False) -> dict[str, tuple[nn.Module, str]]:
    """The linear layers fp8 applies to, by their name in `model`: SigLIP's attention and MLP
    projections and the Gemma prefix's q/k/v/o and gate/up/down (with `expert`, the action expert's
    too) -> (parent module, attribute). Everything else (embeddings, norms and the AdaRMS
    modulation, the projector, the action and time projections) keeps the serving precision."""
    stacks = [("vision", model.vision), ("vlm", model.vlm)] + ([("expert", model.expert)] if expert else [])
    targets = {}
    for stack_name, stack in stacks:
        for i, layer in enumerate(stack.layers):
            for part_name in ("self_attn", "mlp"):
                part = getattr(layer, part_name)
                for attr, child in part.named_children():
                    if isinstance(child, (nn.Linear, Fp8Linear)):
                        targets[f"{stack_name}.layers.{i}.{part_name}.{attr}"] = (part, attr)
    return targets


def convert_to_fp8(model: nn.Module, expert: bool = False,
                   input_scales: dict[str, float | None] | None = None) -> list[str]:
    """Replaces the fp8 targets' nn.Linear layers by Fp8Linear in place (the bf16 weights are freed);
    `input_scales`: a static activation scale per layer name (calibrate; None: that layer's tokens
    scaled one by one), else per-token scales everywhere.
    Returns the names converted."""
    targets = fp8_targets(model, expert)
    if input_scales is not None:
        missing = sorted(set(targets) - set(input_scales))
        if missing:
            raise ValueError(f"the activation scales lack {len(missing)} layers, e.g. {missing[0]}")
    for name, (parent, attr) in targets.items():
        linear = getattr(parent, attr)
        if isinstance(linear, Fp8Linear):
            raise ValueError(f"{name} is fp8 already")
        setattr(parent, attr, Fp8Linear.from_linear(linear, None if input_scales is None else input_scales[name]))
    return list(targets)
