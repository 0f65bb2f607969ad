"""quack's GEMMs (CuTe DSL) for the prefix and SigLIP, with their activations in the epilogue:
`--gemm-library quack`.

The served default is cuBLAS for every GEMM, then our GeGLU / GELU pass over its bf16 output.
quack's GEMM does the same products in the same order (bit-identical outputs), and its epilogues
here round where the eager path does:
- the GEMM's output (+ bias) rounded to bf16, as cuBLAS stores it;
- GELU (tanh form, with tanh as our Triton kernel takes it) rounded to bf16;
- for the GeGLU, the product of that and the up half rounded to bf16 by the store.
So no output element differs from the served path's or from torch's eager ops (checked on every
element of a batch-8 and a batch-1 gate/up layer), and the pass's HBM round trip is gone.

Each GEMM takes quack from the row count where it measured faster (FROM_ROWS); below that the
default path runs unchanged, on the same weights (backends.QuackGemm). Needs the `cute` extra
(`pip install -e '.[cute]'` in vlaserve's clone) and an sm90 / sm100 GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

from ...errors import ConfigError
from . import targets

GEGLU, GELU = "vlaserve_geglu", "vlaserve_gelu"
# The fewest rows (tokens of the whole batch) from which quack's kernel beat cuBLAS's (+ our pass),
# at that batch size and every larger one, each GEMM over its layers in a CUDA graph (ALOHA-3 with
# the 96-token bucket: 864 prefix and 768 SigLIP rows a sample). Absent: cuBLAS at every size (the
# prefix's o; and the expert's GEMMs, 50 rows a sample, where quack was slower).
FROM_ROWS = {"prefix_gate_up": 2 * 864, "prefix_qkv": 4 * 864, "vision_fc1": 4 * 768, "vision_qkv": 8 * 768,
             "vision_o": 8 * 768}
# quack's epilogue registry and its closure keying (patched below) are internals: pinned versions.
PINNED = {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.8.1"}


def require(device: torch.device) -> None:
    """Raises ConfigError unless the pinned quack and CUTLASS DSL are installed and `device` is sm90 / sm100."""
    require_pinned("gemm_library 'quack'", PINNED, device, "--gemm-library cublas")


def require_pinned(option: str, pinned: dict[str, str], device: torch.device, default: str) -> None:
    """Raises ConfigError unless every {package: version} of `pinned` is installed and `device` is sm90 / sm100.
    option: what needs them ("gemm_library 'quack'"); default: the option that does without them."""
    targets.require_cute(device, option, default)
    for package, version in pinned.items():
        try:
            found = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(f"{option} needs {package}=={version}: pip install -e '.[cute]' "
                              f"(or serve with {default})") from None
        if found != version:
            raise ConfigError(f"{option} is built against {package}=={version}, found {found}: "
                              "pip install -e '.[cute]'")


def linear(x2d: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) [R, N] bf16, W [N, K]: F.linear's bits."""
    from quack.gemm_interface import gemm

    return gemm(x2d, w.t(), bias=bias, tuned=False)


def linear_gelu(x2d: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ W^T + bias) [R, N] bf16: SigLIP's fc1 and the GELU after it (after `register`)."""
    from quack.gemm_interface import gemm_act

    return gemm_act(x2d, w.t(), bias=bias, activation=GELU, store_preact=False, tuned=False)[1]


def geglu_linear(x2d: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ Wg^T) * (x @ Wu^T) [R, M] bf16, W = [Wg; Wu] [2M, K] (after `register`). quack's
    concat layout reads the halves as (gate_i, up_i) pairs: as fast as interleaved rows."""
    from quack.gemm_interface import gemm_act

    return gemm_act(x2d, w_gate_up.t(), activation=GEGLU, store_preact=False, tuned=False, concat_layout=("B",))[1]


@functools.cache
def register() -> None:
    """Registers the epilogues with quack (once a process)."""
    from quack import activation, gemm_interface

    _key_closures_by_name()
    ops = epilogue_ops()
    activation.gate_fn_map[GEGLU] = ops.gated(ops.gelu_served, rounded=True)
    gemm_interface.gated_to_pytorch_fn_map[GEGLU] = gemm_interface.gated_to_pytorch_fn_map["geglu"]
    activation.act_fn_map[GELU] = ops.rounded(ops.gelu_served)


def _key_closures_by_name() -> None:
    """quack 0.6.5 keys a compiled epilogue by the values its functions close over. Under CUTLASS
    DSL 4.8.1 the epilogue's functions close over a ContextVar of the DSL's and a code-object
    method descriptor, which it has no key for. Those values are module-level
    singletons, so their names identify them."""
    import contextvars

    from quack.gemm_runtime import identity

    original = identity.semantic_value_key

    def key(value, *args, **kwargs):
        if isinstance(value, contextvars.ContextVar):
            return ("contextvar", value.name)
        try:
            return original(value, *args, **kwargs)
        except TypeError:
            return ("opaque", type(value).__qualname__, getattr(value, "__qualname__", repr(value)))
    identity.semantic_value_key = key


@functools.cache
def epilogue_ops():
    """The epilogues' pieces, built on first use (the DSL takes seconds to import). `gated(gelu,
    rounded)` is a quack gate function over pairs of (gate, up) columns, `rounded(act)` an
    activation at the eager rounding points."""
    from types import SimpleNamespace

    from cutlass import Float32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def round_pair(x0, x1, *, loc=None, ip=None):
        # Both to the nearest bf16 (ties to even) with one packed cvt, back as fp32: 16 zero low bits.
        # (A cvt per value is markedly slower.)
        pair = llvm.inline_asm(llvm.StructType.get_literal([T.f32(), T.f32()]),
                               [Float32(x0).ir_value(loc=loc, ip=ip), Float32(x1).ir_value(loc=loc, ip=ip)],
                               "{.reg .b32 h; cvt.rn.bf16x2.f32 h, $3, $2; shl.b32 $0, h, 16; "
                               "and.b32 $1, h, 0xffff0000;}",
                               "=f,=f,f,f", has_side_effects=False, loc=loc, ip=ip)
        return (Float32(llvm.extractvalue(T.f32(), pair, [0], loc=loc, ip=ip)),
                Float32(llvm.extractvalue(T.f32(), pair, [1], loc=loc, ip=ip)))

    @dsl_user_op
    def ptx_f32(asm, *xs, loc=None, ip=None):
        # one PTX instruction on fp32 operands: what Triton emits for tl.exp and for fp32 `/`
        constraints = ",".join(["=f"] + ["f"] * len(xs))
        value = llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip) for x in xs], asm, constraints,
                                has_side_effects=False, loc=loc, ip=ip)
        return Float32(value)

    def gelu_served(x):
        # kernels.gelu_tanh: tanh(z) = 2 / (1 + exp(-2z)) - 1, exp as ex2.approx of -2z log2(e)
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = ptx_f32("ex2.approx.f32 $0, $1;", -2.0 * z * 1.4426950408889634)
        t = ptx_f32("div.full.f32 $0, $1, $2;", 2.0, 1.0 + e) - 1.0
        return 0.5 * x * (1.0 + t)

    def gated(gelu, rounded: bool):
        # gelu and rounded are closure cells: quack keys each compiled epilogue by them
        def gate_pair(x, y):  # x: two gates, y: their two ups
            if const_expr(not rounded):
                return (gelu(x[0]) * y[0], gelu(x[1]) * y[1])
            g, u = round_pair(*x), round_pair(*y)
            a = round_pair(gelu(g[0]), gelu(g[1]))
            return (a[0] * u[0], a[1] * u[1])

        @dsl_user_op
        def gate(x, y, *, loc=None, ip=None):
            if const_expr(isinstance(x, tuple)):
                return gate_pair(x, y)
            return gate_pair((x, x), (y, y))[0]
        return gate

    def rounded(act):
        # x (the GEMM's fp32 sum + bias) rounded to bf16 first, as cuBLAS stores it; then act, rounded
        # again (the store rounds once more: a no-op on a bf16 value). Pairs when quack hands them over.
        @dsl_user_op
        def fn(x, *, loc=None, ip=None):
            if const_expr(isinstance(x, tuple)):
                r = round_pair(*x)
                return round_pair(act(r[0]), act(r[1]))
            return round_pair(act(round_pair(x, x)[0]), 0.0)[0]
        return fn

    return SimpleNamespace(gelu_served=gelu_served, gated=gated, rounded=rounded)
