"""The fast path's library variants, chosen once when a FastPi05 is built: a GEMM backend for the
prefix's and SigLIP's projections (cuBLAS; quack, CuTe DSL, with the activations in its epilogue;
fp8, for a model converted to precision fp8; invariant, batch_invariant's fixed-order Triton GEMM) and an
attention backend for the prefix's and SigLIP's attention (our Triton kernel and torch's; FlashAttention-4;
invariant). Each class says where it runs (`supports(target, dtype,
profile)`) and what it needs when it does not; `gemm_backend` / `attention_backend` check the
combination once and raise ConfigError, so FastPi05's methods call `self.gemm` / `self.attention`
with no flag of their own. Every backend computes the same bits as the default one (cute.py,
flash.py say how).

target: the GPU the Triton kernels run on, None where they do not (CPU, Triton's interpreter, the
stock kernels); profile: "offload" when the prefix's layers stream in per call, else "resident".
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...model.fp8 import Fp8Linear, QuantizedRows, linear_fp8, quantize_rows
from ...model.gemma import MASK_VALUE
from . import cute, flash, fp8_kernels, kernels
from .launch_tables import LaunchTable
from .targets import Target
from .weights import Fp8Weight


class Backend:
    """A library variant: its option value (`name`), where it runs (`supports`) and, for the error where it
    does not, what it needs. The defaults run wherever the fast path does."""

    name: ClassVar[str]
    needs: ClassVar[str] = ""
    whole_model_on_triton: ClassVar[bool] = False  # FastPi05 then refuses a model whose stacks run stock kernels

    @classmethod
    def supports(cls, target: Target | None, dtype: torch.dtype, profile: str) -> bool:
        return True


class CublasGemm(Backend):
    """x @ w^T (+ bias) through cuBLAS (F.linear), then our Triton pass for an activation after it."""

    name = "cublas"

    def linear(self, x, w, bias: torch.Tensor | None = None, gemm: str | None = None):
        """x @ w^T (+ bias); `gemm` names the projection ("prefix_qkv", ...: cute.FROM_ROWS's keys)."""
        return F.linear(x, w, bias)

    def linear_gelu(self, gemm: str, x, w, bias) -> torch.Tensor:
        """gelu_tanh(x @ w^T + bias) (Triton path: SigLIP's fc1 and the GELU after it)."""
        return kernels.gelu(self.linear(x, w, bias))

    def gate_up_geglu(self, gemm: str, x, w_gate_up, w_down) -> "torch.Tensor | QuantizedRows":
        """GeGLU of x @ w_gate_up^T as w_down's GEMM takes it (Triton path: the prefix's MLP)."""
        return kernels.geglu(self.linear(x, w_gate_up))

    def quantizes(self, w) -> bool:
        """Whether the kernel producing w's GEMM input quantizes it for that GEMM itself."""
        return False


class QuackGemm(CublasGemm):
    """quack's GEMMs from the row count where each measured faster than cuBLAS (cute.FROM_ROWS),
    cuBLAS below it: the same bits either way (cute.py)."""

    name = "quack"
    needs = ("the Triton fast path (bfloat16, CUDA) on an sm90 or sm100 GPU, and a memory profile other than "
             "offload (its prefix waits on its weights' copies, not on its GEMMs)")

    @classmethod
    def supports(cls, target, dtype, profile) -> bool:
        return target is not None and target.cute_libraries and dtype == torch.bfloat16 and profile != "offload"

    def __init__(self, device: torch.device):
        cute.require(device)
        cute.register()

    @staticmethod
    def _on_quack(gemm: str | None, x2d: torch.Tensor) -> bool:
        from_rows = cute.FROM_ROWS.get(gemm)  # absent: cuBLAS at every size
        return from_rows is not None and x2d.shape[0] >= from_rows

    def linear(self, x, w, bias=None, gemm=None):
        return cute.linear(x, w, bias) if self._on_quack(gemm, x) else F.linear(x, w, bias)

    def linear_gelu(self, gemm, x, w, bias):
        return cute.linear_gelu(x, w, bias) if self._on_quack(gemm, x) else super().linear_gelu(gemm, x, w, bias)

    def gate_up_geglu(self, gemm, x, w_gate_up, w_down):
        if self._on_quack(gemm, x):
            return cute.geglu_linear(x, w_gate_up)
        return super().gate_up_geglu(gemm, x, w_gate_up, w_down)


class Fp8Gemm(CublasGemm):
    """A precision-fp8 model's GEMMs: an fp8 weight's through the fp8 GEMM (torch._scaled_mm where it
    runs), its input quantized by one Triton kernel on the Triton path, or by the kernel producing it
    where that kernel holds a whole row (fp8_kernels.py); other weights through cuBLAS."""

    name = "fp8"
    needs = "FP8 tensor cores (sm89 or newer)"

    @classmethod
    def supports(cls, target, dtype, profile) -> bool:
        return target is None or target.fp8

    def __init__(self, triton: bool):
        self.quantizer = fp8_kernels.quantize_rows if triton else quantize_rows

    def linear(self, x, w, bias=None, gemm=None):
        if isinstance(w, Fp8Weight):
            return linear_fp8(x, w.data, w.scale, bias, w.input_scale, quantizer=self.quantizer)
        return F.linear(x, w, bias)

    def gate_up_geglu(self, gemm, x, w_gate_up, w_down):
        gate_up = self.linear(x, w_gate_up)
        if self.quantizes(w_down) and gate_up.shape[1] // 2 <= fp8_kernels.GEGLU_MAX_WIDTH:
            return fp8_kernels.geglu_quantized(gate_up)
        return kernels.geglu(gate_up)

    def quantizes(self, w) -> bool:
        # per-token activation scales only: a static scale's quantizer stays a kernel of its own
        return isinstance(w, Fp8Weight) and w.input_scale is None


class InvariantGemm(CublasGemm):
    """batch_invariant's GEMMs (the prefix's, SigLIP's, its patch embedding and the projector): our Triton GEMM
    with one tile per operand dtype at every row count and no split (kernels.fixed_linear), where cuBLAS picks
    its algorithm, and so its summation order, by the row count; the activations after it as CublasGemm's."""

    name = "invariant"
    needs = "the Triton fast path (bfloat16 on CUDA, or Triton's interpreter)"
    whole_model_on_triton = True

    @classmethod
    def supports(cls, target, dtype, profile) -> bool:
        return kernels.available() and dtype != torch.float32

    def __init__(self, table: LaunchTable):
        self.table = table

    def linear(self, x, w, bias=None, gemm=None):
        return kernels.fixed_linear(x, w, bias, self.table)


class TritonAttention(Backend):
    """The prefix's attention through kernels.mqa_attention, its masked keys as an fp32 bias; SigLIP's through
    torch's scaled_dot_product_attention."""

    name = "triton"

    def __init__(self, table: LaunchTable):
        self.table = table

    def keys(self, cache_pad: torch.Tensor) -> torch.Tensor:
        """What every layer's attention reads of the valid keys [B, T] (once a prefix)."""
        return torch.where(cache_pad, 0.0, MASK_VALUE).to(torch.float32)

    def prefix(self, q, k_cache, v_cache, keys, num_heads: int, tokens: int) -> torch.Tensor:
        """q [B, num_heads * tokens, D] (head-major), k/v [B, T, D] -> [B, tokens, num_heads * D]."""
        cfg = kernels.prefix_attention_config(q.shape[0], self.table)
        return kernels.mqa_attention(q, k_cache, v_cache, keys, num_heads, tokens, cfg, self.table)

    def vision(self, qkv: torch.Tensor, images: int, patches: int, heads: int, head_dim: int) -> torch.Tensor:
        """SigLIP's attention: qkv [images * patches, 3 * heads * head_dim] (or [images, patches, ...]) ->
        [..., heads * head_dim] in qkv's leading shape."""
        q, k, v = qkv.view(images, patches, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)
        return attn.transpose(1, 2).reshape(qkv.shape[:-1] + (heads * head_dim,))


class Fa4Attention(TritonAttention):
    """FlashAttention-4 (flash.py), the valid keys as a key length."""

    name = "fa4"
    needs = "the Triton fast path (bfloat16, CUDA) on an sm90 or sm100 GPU"

    @classmethod
    def supports(cls, target, dtype, profile) -> bool:
        return target is not None and target.cute_libraries and dtype == torch.bfloat16

    def __init__(self, table: LaunchTable, device: torch.device):
        super().__init__(table)
        flash.require(device)

    def keys(self, cache_pad):
        return cache_pad.sum(1, dtype=torch.int32)

    def prefix(self, q, k_cache, v_cache, keys, num_heads, tokens):
        return flash.prefix_attention(q, k_cache, v_cache, keys, num_heads, tokens)


class InvariantAttention(TritonAttention):
    """batch_invariant's attention: the prefix's through kernels.mqa_attention with a batch-invariant table
    (its batch-1 tiles and key splits at every batch size), SigLIP's through kernels.fixed_vision_attention
    (torch's attention may split the keys by how many images fill the GPU)."""

    name = "invariant"
    needs = InvariantGemm.needs

    @classmethod
    def supports(cls, target, dtype, profile) -> bool:
        return InvariantGemm.supports(target, dtype, profile)

    def vision(self, qkv, images, patches, heads, head_dim):
        out = kernels.fixed_vision_attention(qkv.reshape(-1, qkv.shape[-1]), images, patches, heads, head_dim,
                                             self.table)
        return out.view(qkv.shape[:-1] + (heads * head_dim,))


GEMMS = {cls.name: cls for cls in (CublasGemm, QuackGemm, Fp8Gemm, InvariantGemm)}
ATTENTIONS = {cls.name: cls for cls in (TritonAttention, Fa4Attention, InvariantAttention)}


def _checked(option: str, registry: dict, name: str, target, dtype, profile) -> type:
    if name not in registry:
        raise ConfigError(f"{option} must be one of {', '.join(registry)}, not {name!r}")
    cls = registry[name]
    if not cls.supports(target, dtype, profile):
        raise ConfigError(f"{option} {name!r} needs {cls.needs}")
    return cls


def gemm_backend(library: str, model, target: Target | None, dtype: torch.dtype, profile: str, triton: bool,
                 device: torch.device, table: LaunchTable) -> CublasGemm:
    """The GEMM backend for `model`: fp8 where its layers are fp8 (library must then be cublas: fp8 has its
    own GEMM), else `library` ("cublas", "quack", or "invariant": batch_invariant's, with `table` a batch-invariant
    launch table); triton: the stock-kernel path's fp8 quantizer otherwise."""
    if any(isinstance(lin, Fp8Linear) for lin in model.expert.modules()):
        raise ConfigError("precision 'fp8+expert' runs on the eager model (fast_path=False): the fast path's "
                          "expert kernels take bfloat16 weights")
    fp8 = any(isinstance(lin, Fp8Linear) for lin in model.modules())
    if fp8 and library != "cublas":
        raise ConfigError(f"gemm_library {library!r} takes bfloat16 weights: precision fp8 runs its GEMMs through "
                          "its own fp8 GEMM (gemm_library cublas)")
    if library == Fp8Gemm.name:  # chosen by the weights, never by name
        raise ConfigError(f"gemm_library must be one of cublas, quack, not {library!r}")
    cls = _checked("gemm_library", GEMMS, "fp8" if fp8 else library, target, dtype, profile)
    if cls is QuackGemm:
        return QuackGemm(device)
    if cls is InvariantGemm:
        return InvariantGemm(_invariant(table))
    return Fp8Gemm(triton) if cls is Fp8Gemm else CublasGemm()


def attention_backend(library: str, target: Target | None, dtype: torch.dtype, profile: str, table: LaunchTable,
                      device: torch.device) -> TritonAttention:
    """The prefix's attention backend: `library` ("triton", "fa4", or "invariant" with a batch-invariant table)."""
    cls = _checked("attention_library", ATTENTIONS, library, target, dtype, profile)
    if cls is InvariantAttention:
        return InvariantAttention(_invariant(table))
    return Fa4Attention(table, device) if cls is Fa4Attention else TritonAttention(table)


def _invariant(table: LaunchTable) -> LaunchTable:
    if not table.batch_invariant:
        raise ConfigError(f"the invariant backends take a batch-invariant launch table, not {table.name!r} "
                          "(LaunchTable.batch_invariant_table)")
    return table
