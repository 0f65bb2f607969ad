"""The prefix's gate/up GEMM with the GeGLU in its epilogue, through quack (CuTe DSL): `--prefix-mlp quack`.

The served default is cuBLAS for the GEMM, then our GeGLU pass over its bf16 output. quack's
GEMM does the same products in the same order (bit-identical outputs, runs 102-104), and its
epilogue here rounds where the eager path does:
- gate and up rounded to bf16, as cuBLAS stores them;
- GELU (tanh form, with tanh as our Triton kernel takes it) rounded to bf16;
- the product rounded to bf16 by the store.
So no output element differs from the served path's or from torch's eager ops. Runs 105-107
checked all 113M elements of a batch-8 layer, and 14M at batch 1. The pass's HBM round trip is
gone: a batch-8 layer takes 1154 against 1331 µs on an H200.

The weight's gate and up rows are interleaved at load (weights.py), because quack's gated
epilogue pairs adjacent output columns. Batch 1 runs cuBLAS and the GeGLU pass over that layout,
where quack's GEMM is slower (FROM_BATCH). Needs `pip install 'vlaserve[cute]'` and a Hopper (or
newer) GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

from ...errors import ConfigError

ACTIVATION = "vlaserve_geglu"
# Run 109 (bench/prefix_mlp.py, H200, calls in CUDA graphs, ms): b1 14.26 -> 14.64, b2 23.18 -> 22.54,
# b4 38.57 -> 37.48, b8 70.26 -> 67.57. So batch 1 keeps cuBLAS + the GeGLU pass (over the pairs layout).
FROM_BATCH = 2
# quack's epilogue registry and its closure keying (patched below) are internals: pinned versions.
PINNED = {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.8.1"}


def require(device: torch.device) -> None:
    """Raises ConfigError unless the pinned quack and CUTLASS DSL are installed and `device` is sm90+."""
    for package, version in PINNED.items():
        try:
            found = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(f"prefix_mlp 'quack' needs {package}=={version}: pip install 'vlaserve[cute]' "
                              "(or serve with --prefix-mlp cublas)") from None
        if found != version:
            raise ConfigError(f"prefix_mlp 'quack' is built against {package}=={version}, found {found}: "
                              "pip install 'vlaserve[cute]'")
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        raise ConfigError("prefix_mlp 'quack' runs on Hopper or newer GPUs (sm90+) only")


def geglu_linear(x2d: torch.Tensor, w_pairs: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ Wg^T) * (x @ Wu^T) [R, M] bf16, W_pairs [2M, K] with gate row i at 2i, up at 2i + 1
    (after `register`)."""
    from quack.gemm_interface import gemm_act

    return gemm_act(x2d, w_pairs.t(), activation=ACTIVATION, store_preact=False, tuned=False)[1]


@functools.cache
def register() -> None:
    """Registers the epilogue with quack (once a process)."""
    from quack import activation, gemm_interface

    _key_closures_by_name()
    ops = epilogue_ops()
    activation.gate_fn_map[ACTIVATION] = ops.gated(ops.gelu_served, rounded=True)
    gemm_interface.gated_to_pytorch_fn_map[ACTIVATION] = gemm_interface.gated_to_pytorch_fn_map["geglu"]


def _key_closures_by_name() -> None:
    """quack 0.6.5 keys a compiled epilogue by the values its functions close over. Under CUTLASS
    DSL 4.8.1 the epilogue's functions close over a ContextVar of the DSL's and a code-object
    method descriptor, which it has no key for (run 101). Those values are module-level
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
    """The epilogue's pieces, built on first use (the DSL takes seconds to import). `gated(gelu,
    rounded)` is a quack gate function over pairs of (gate, up) columns; bench/cute_probe.py
    builds its variants from the same pieces."""
    from types import SimpleNamespace

    from cutlass import Float32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def round_pair(x0, x1, *, loc=None, ip=None):
        # Both to the nearest bf16 (ties to even) with one packed cvt, back as fp32: 16 zero low bits.
        # A cvt per value cost ~0.5 ms a batch-8 layer (run 106: 1675 against 1177 µs).
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

    return SimpleNamespace(gelu_served=gelu_served, gated=gated)
