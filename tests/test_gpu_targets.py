"""The support matrix's resource check, without any GPU: every Triton kernel of the fast path, at every
launch configuration and batch size the runtime can choose, compiled once per launch table and the
features it runs with (CHECKED: the targets that share both compile the same kernels), for the target
standing for them (Triton compiles for a GPUTarget with the bundled ptxas; nothing runs), and its
shared memory, registers and threads per block held against that target's limits.

The launches are the ones kernels.py's wrappers make: each wrapper is called with meta tensors of
the Pi0.5 / Pi0 shapes (no memory, no device) while the kernels are replaced by recorders, so the
grid, arguments, constexprs and launch options are exactly what the runtime would pass. Each
recorded launch is then specialized as Triton's own launcher does (pointer alignment, integer
divisibility: triton.runtime.jit's binder) and compiled.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from vlaserve.checkpoint.weights import apply_dtype_policy
from vlaserve.config import GEMMA_VARIANTS, SIGLIP_SO400M_14, ModelConfig, RuntimeConfig
from vlaserve.family import load_policy_config
from vlaserve.errors import ConfigError
from vlaserve.runtime.fast import cute, flash, fp8_kernels, kernels, targets
from vlaserve.runtime.fast.launch_tables import LAUNCH_TABLES, SM90, LaunchTable, table_for
from vlaserve.runtime.memory import GIB, MemoryEstimate, cuda_budget
from vlaserve.runtime.runner import EagerRunner, Runtime
from vlaserve.startup.engine import start

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

BATCHES = range(1, 9)
HORIZON = 50
EXPERT, VLM, VISION = GEMMA_VARIANTS["gemma_300m"], GEMMA_VARIANTS["gemma_2b"], SIGLIP_SO400M_14
ACTION_DIM = 32
# Prompt lengths: 1 to 3 cameras of 256 patches plus the 200-token prompt or its 96-token bucket.
# No constexpr depends on the prefix length; the attention's key count is a runtime argument.
PREFIX_LEN = 3 * VISION.num_patches + 200



def _checked_targets() -> list[int]:
    """One target per launch table and feature set (TMA, PDL): of those sharing both, the one with the
    least shared memory a block, and with fp8 where any has it (its kernels are a superset)."""
    groups: dict[tuple, list] = {}
    for t in targets.TARGETS.values():
        groups.setdefault((t.launch_table, t.tma, t.pdl), []).append(t)
    chosen = [min(group, key=lambda t: (t.shared_per_block, not t.fp8, t.capability)) for group in groups.values()]
    return sorted(t.capability for t in chosen)


CHECKED = _checked_targets()


# @triton.jit functions that only other kernels call
HELPERS = {"_await_inputs", "gelu_tanh", "_gemm_two_column_blocks", "_online_softmax_step", "_rows"}
# The modules whose wrappers launch the fast path's kernels
LAUNCHERS = (kernels, fp8_kernels)


def launched_kernels(target: targets.Target) -> set[str]:
    """The kernels the launchers import: each must be launched somewhere in batches 1..8 (fp8's kernels
    where the target has fp8: precision fp8 is refused on the others)."""
    modules = LAUNCHERS if target.fp8 else (kernels,)
    return {n for module in modules for n, v in vars(module).items() if isinstance(v, JITFunction)} - HELPERS


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn: JITFunction, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def expert_step(b: int, table: LaunchTable) -> None:
    """One Euler step's kernels at batch b, as FastPi05._expert_triton / FastPi0 call them."""
    r, w, hd, hq = b * HORIZON, EXPERT.width, EXPERT.head_dim, EXPERT.num_heads
    h, y = meta(r, w), meta(r, w)
    scale, shift, gate = meta(w), meta(w), meta(w)
    cos, sin = meta(r, hd // 2, dtype=torch.float32), meta(r, hd // 2, dtype=torch.float32)
    cache_len = PREFIX_LEN + HORIZON
    k_cache, v_cache = meta(b, cache_len, hd), meta(b, cache_len, hd)
    tail = (k_cache[:, PREFIX_LEN:], v_cache[:, PREFIX_LEN:])
    for adaptive in (True, False):  # Pi0.5's AdaRMS (a shift), Pi0's plain RMS norm
        kernels.residual_norm(h, scale, shift if adaptive else None, eps=1e-6, table=table)
        kernels.linear_residual_norm(meta(r, hq * hd), meta(w, hq * hd), h, gate, scale,
                                     shift if adaptive else None, 1e-6, table)
        kernels.residual_norm(h, scale, shift if adaptive else None, delta=meta(r, w), gate=gate, eps=1e-6,
                              table=table)
    if kernels.through_cublas("qkv", b, table):
        q = kernels.qkv_rope_into_cache(meta(r, (hq + 2) * hd), cos, sin, *tail, hq, HORIZON, table=table)
    else:
        q = kernels.qkv_rope_into_cache(y, cos, sin, *tail, hq, HORIZON, w_qkv=meta((hq + 2) * hd, w), table=table)
    kernels.mqa_attention(q, k_cache, v_cache, meta(b, cache_len, dtype=torch.float32), hq, HORIZON,
                          kernels.attention_config(b, table), table)
    if kernels.through_cublas("gate_up", b, table):
        kernels.geglu(meta(r, 2 * EXPERT.mlp_dim))
    else:
        kernels.geglu_linear(y, meta(2 * EXPERT.mlp_dim, w), table)
    kernels.linear_residual_norm(meta(r, EXPERT.mlp_dim), meta(w, EXPERT.mlp_dim), h, gate, scale, shift, 1e-6,
                                 table)
    if r <= table["action"]["max_rows"]:  # FastPi05._denoise_fused: first, middle, last steps
        x = meta(r, ACTION_DIM, dtype=torch.float32)
        w_in, b_in = meta(w, ACTION_DIM, dtype=torch.float32), meta(w, dtype=torch.float32)
        w_out, b_out = meta(ACTION_DIM, w, dtype=torch.float32), meta(ACTION_DIM, dtype=torch.float32)
        rtc = (x, meta(r, dtype=torch.float32), meta(b, dtype=torch.float32))
        kernels.action_step(x, h, w_in, b_in, table=table)
        for guidance in (None, rtc):
            kernels.action_step(x, h, w_in, b_in, y, w_out, b_out, x, 0.1, 0.5, guidance, table=table)
            kernels.action_step(x, None, w_in, b_in, y, w_out, b_out, x, 0.1, 0.5, guidance, table=table)


def prefix(b: int, fp8: bool, table: LaunchTable) -> None:
    """The prefix's Triton kernels at batch b, as FastPi05.vision / _prefix_triton call them (`fp8`: with
    precision fp8's too)."""
    p, w, hd, hq = b * PREFIX_LEN, VLM.width, VLM.head_dim, VLM.num_heads
    patches = b * 3 * VISION.num_patches
    v = meta(patches, VISION.width)
    kernels.residual_layer_norm(v, meta(VISION.width), meta(VISION.width), 1e-6)
    kernels.residual_layer_norm(v, meta(VISION.width), meta(VISION.width), 1e-6, delta=v)
    kernels.gelu(meta(patches, VISION.mlp_dim))
    h = meta(p, w)
    kernels.residual_norm(h, meta(w), eps=1e-6, table=table)
    kernels.residual_norm(h, meta(w), delta=meta(p, w), eps=1e-6, table=table)
    cos, sin = meta(p, hd // 2, dtype=torch.float32), meta(p, hd // 2, dtype=torch.float32)
    k_cache, v_cache = meta(b, PREFIX_LEN + HORIZON, hd), meta(b, PREFIX_LEN + HORIZON, hd)
    kv = (k_cache[:, :PREFIX_LEN], v_cache[:, :PREFIX_LEN])
    slots = meta(p, dtype=torch.int32)
    q = kernels.qkv_rope_into_cache(meta(p, (hq + 2) * hd), cos, sin, *kv, hq, PREFIX_LEN, slots=slots, table=table)
    kernels.qkv_rope_into_cache(meta(p, 2 * hd), cos, sin, *kv, 0, PREFIX_LEN, slots=slots, table=table)  # last layer
    kernels.mqa_attention(q, *kv, meta(b, PREFIX_LEN, dtype=torch.float32), hq, PREFIX_LEN,
                          kernels.prefix_attention_config(b, table), table)
    kernels.geglu(meta(p, 2 * VLM.mlp_dim))
    if not fp8:
        return
    # precision fp8: the norms and the prefix's GeGLU quantizing their outputs for the fp8 GEMMs, and the
    # quantizer kernel before the others (every GEMM input's width: static activation scales take it)
    kernels.residual_layer_norm(v, meta(VISION.width), meta(VISION.width), 1e-6, quantize=True)
    kernels.residual_layer_norm(v, meta(VISION.width), meta(VISION.width), 1e-6, delta=v, quantize=True)
    kernels.residual_norm(h, meta(w), delta=meta(p, w), eps=1e-6, quantize=True, table=table)
    fp8_kernels.geglu_quantized(meta(p, 2 * VLM.mlp_dim))
    for rows, width in ((patches, VISION.width), (patches, VISION.mlp_dim), (p, w), (p, VLM.mlp_dim)):
        fp8_kernels.quantize_rows(meta(rows, width))


def invariant_gemms(b: int, table: LaunchTable) -> None:
    """batch_invariant's own kernels at batch b: its GEMMs (InvariantGemm: SigLIP's, the patch embedding, the
    projector, the prefix's) and SigLIP's attention (InvariantAttention), under its table."""
    patches, p = b * 3 * VISION.num_patches, b * PREFIX_LEN
    vision_heads = VISION.num_heads * VISION.head_dim
    shapes = ((patches, 3 * vision_heads, VISION.width), (patches, VISION.width, vision_heads),
              (patches, VISION.mlp_dim, VISION.width), (patches, VISION.width, VISION.mlp_dim),
              (patches, VISION.width, 3 * VISION.patch_size**2), (patches, VLM.width, VISION.width),
              (p, (VLM.num_heads + 2) * VLM.head_dim, VLM.width), (p, VLM.width, VLM.num_heads * VLM.head_dim),
              (p, 2 * VLM.mlp_dim, VLM.width), (p, VLM.width, VLM.mlp_dim))
    for rows, n, k in shapes:
        kernels.fixed_linear(meta(rows, k), meta(n, k), meta(n), table)
    kernels.fixed_vision_attention(meta(patches, 3 * vision_heads), b * 3, VISION.num_patches, VISION.num_heads,
                                   VISION.head_dim, table)


@contextlib.contextmanager
def recording_launches(recorded: list):
    """Within it the launchers' kernels are Recorders appending to `recorded` (the kernels are back
    after it, before anything compiles) -> the MonkeyPatch, for more patches undone with it."""
    with pytest.MonkeyPatch.context() as patch:
        for module in LAUNCHERS:
            for name, value in vars(module).items():
                if isinstance(value, JITFunction):
                    patch.setattr(module, name, Recorder(value, recorded))
        yield patch


def launches(target: targets.Target, batch_invariant: bool = True) -> list:
    """Every kernel launch of batches 1..8 under `target`'s launch table and features, and (`batch_invariant`)
    under its batch-invariant table (`vlaserve serve --batch-invariant`)."""
    recorded: list = []
    table = table_for(target)
    invariant = table.batch_invariant_table()
    with recording_launches(recorded):
        for b in BATCHES:
            expert_step(b, table)
            prefix(b, target.fp8, table)
            if batch_invariant:
                expert_step(b, invariant)
                prefix(b, False, invariant)
                invariant_gemms(b, invariant)
    return recorded


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel asks of a block, from Triton's metadata and ptxas' report."""

    kernel: str
    launch: str  # its constexprs and launch options
    shared: int  # bytes
    threads: int
    registers: int  # per thread
    spill_bytes: int  # stores to local memory: slower, never wrong

    def violations(self, target: targets.Target) -> list[str]:
        over = []
        if self.shared > target.shared_per_block:
            over.append(f"shared memory {self.shared} B > {target.shared_per_block} B")
        if self.threads > target.threads_per_block:
            over.append(f"{self.threads} threads > {target.threads_per_block}")
        if self.registers > target.registers_per_thread:
            over.append(f"{self.registers} registers a thread > {target.registers_per_thread}")
        if self.registers * self.threads > target.registers_per_block:
            over.append(f"{self.registers} x {self.threads} registers > {target.registers_per_block} a block")
        return [f"{self.kernel} [{self.launch}] on {target.name}: {v}" for v in over]


class UnsupportedArch(Exception):
    pass


def specialize(fn: JITFunction, args, kwargs, capability: int):
    """What Triton's launcher compiles for this launch on sm_<capability>: (ASTSource, options)."""
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_launch(source: ASTSource, options, capability: int) -> Resources:
    """Compiles one specialized launch for sm_<capability> and reads what it asks of a block."""
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # knobs.nvidia.dump_ptxas_log prints ptxas -v here
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options.__dict__)
    except Exception as e:  # the bundled ptxas does not know this architecture
        if "ptxas" in str(e) and re.search(r"(?i)unsupported|not defined|unknown", str(e)):
            raise UnsupportedArch(f"{get_ptxas(capability).path} cannot compile sm_{capability}") from e
        raise
    report = log.getvalue()
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert registers, f"no ptxas report for {source.fn.__name__}:\n{report}"
    launch = ", ".join(f"{source.fn.arg_names[path[0]]}={value}" for path, value in source.constants.items())
    launch += f", warps={options.num_warps}, stages={options.num_stages}"
    return Resources(source.fn.__name__, launch, compiled.metadata.shared, options.num_warps * 32, max(registers),
                     max(spills, default=0))


def specialized_launches(target: targets.Target, batch_invariant: bool = True) -> dict:
    """The distinct compiles behind launches(target, batch_invariant): {key: (ASTSource, options)}."""
    out = {}
    for fn, args, kwargs in launches(target, batch_invariant):
        source, options = specialize(fn, args, kwargs, target.capability)
        key = (fn.__name__, repr(source.signature), repr(source.constants), repr(source.attrs),
               repr(sorted(options.__dict__.items())))
        out.setdefault(key, (source, options))
    return out


@pytest.fixture
def fresh_compiles(monkeypatch):
    """Every compile runs ptxas (no cache hit) and prints its report."""
    monkeypatch.setattr(triton.knobs.compilation, "always_compile", True)
    monkeypatch.setattr(triton.knobs.nvidia, "dump_ptxas_log", True)


def test_one_check_stands_for_each_launch_table_and_feature_set():
    # sm87 compiles what sm80 does (the sm80 table, 163 KB), sm86 a subset of sm89's (no fp8), sm110 what
    # sm100 does; sm120 runs the sm89 table with TMA and PDL: other kernels, so a check of its own.
    assert CHECKED == [80, 89, 90, 100, 120]
    assert {targets.TARGETS[c].launch_table for c in CHECKED} == set(LAUNCH_TABLES)


@pytest.mark.slow
@pytest.mark.parametrize("capability", CHECKED)
def test_every_kernel_fits_every_target(capability, fresh_compiles):
    target = targets.TARGETS[capability]
    compiled = {}
    for key, (source, options) in specialized_launches(target).items():
        try:
            compiled[key] = compile_launch(source, options, capability)
        except UnsupportedArch as e:
            pytest.skip(str(e))
    kinds = {r.kernel for r in compiled.values()}
    assert kinds == launched_kernels(target)
    violations = [v for r in compiled.values() for v in r.violations(target)]
    assert not violations, "\n".join(violations)
    # Spills cost speed, not correctness: none in any kernel the default mode launches. The batch-invariant
    # table is not tuned yet (its batch-1 tiles at every row count; the fixed GEMM's one tile): a few of its
    # launches spill tens of bytes on some targets, which its GPU measurement (bench_gpu.py --batch-invariant) prices.
    default = specialized_launches(target, batch_invariant=False)
    spilling = [f"{r.kernel} [{r.launch}]: {r.spill_bytes} B" for key, r in compiled.items()
                if r.spill_bytes and key in default]
    assert not spilling, "\n".join(spilling)


def reduction_layouts(launch: tuple, capability: int) -> list[str]:
    """The layouts of a recorded launch's reductions' operands (one per reduction, in order), from the TTGIR
    Triton compiles for sm_<capability>: how a row's values are spread over the threads, and so the order
    in which a sum over them is taken."""
    fn, args, kwargs = launch
    source, options = specialize(fn, args, kwargs, capability)
    ttgir = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options.__dict__).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    return [layouts[name] for name in re.findall(r"\}\) : \(tensor<\d+xf32, (#\w+)>\) -> f32", ttgir)]


@pytest.mark.slow
@pytest.mark.parametrize("capability", [c for c in CHECKED if targets.TARGETS[c].fp8])
def test_a_norm_that_quantizes_its_output_sums_in_its_bf16_twins_order(capability):
    """The norms that quantize their outputs for fp8 GEMMs (SigLIP's LayerNorm, the prefix's RMSNorm) must
    give the bits their bf16 kernels give before fp8_kernels.quantize_rows: their mean and variance summed
    in the same order, so their reductions laid out alike. A 1-byte store alone would lay the whole
    kernel out 16 values a thread, where the 2-byte loads take 8 (kernel_code._quantize_row; on an H100
    that changed the LayerNorm's actions, run 254)."""
    recorded: list = []
    with recording_launches(recorded):
        for quantize in (False, True):
            patches = 8 * 3 * VISION.num_patches
            v = meta(patches, VISION.width)
            norm = meta(VISION.width, dtype=torch.float32)
            kernels.residual_layer_norm(v, norm, norm, 1e-6, delta=v, quantize=quantize)
            h = meta(8 * PREFIX_LEN, VLM.width)
            kernels.residual_norm(h, meta(VLM.width), delta=meta(2, *h.shape, dtype=torch.float32), eps=1e-6,
                                  quantize=quantize)
    bf16, fp8 = recorded[:2], recorded[2:]
    for plain, quantizing in zip(bf16, fp8):
        try:
            sums = reduction_layouts(plain, capability)
            with_amax = reduction_layouts(quantizing, capability)
        except Exception as e:  # the bundled ptxas does not know this architecture
            if "ptxas" in str(e):
                pytest.skip(str(e))
            raise
        assert len(with_amax) == len(sums) + 1 and with_amax[:len(sums)] == sums, (plain[0].__name__, sums, with_amax)


def test_a_configuration_over_the_limit_fails_the_check(fresh_compiles):
    # The sm90 table's batch-1 split-K GEMM (64 + 32 rows x 256 deep x 2 B x 3 stages in flight =
    # 144 KB) compiled for an RTX 4090 (sm89, 99 KB a block): the check must name it.
    rtx4090 = targets.TARGETS[89]
    on_sm90_table = replace(rtx4090, launch_table="sm90")
    splitk = [(s, o) for s, o in specialized_launches(on_sm90_table, batch_invariant=False).values()
              if s.fn.__name__ == "_splitk_gemm" and s.constants[(s.fn.arg_names.index("BLOCK_K"),)] == 256]
    resources = compile_launch(*splitk[0], 89)
    assert resources.shared == 144 * 1024
    (violation,) = resources.violations(rtx4090)
    assert "_splitk_gemm" in violation and "shared memory 147456 B > 101376 B" in violation
    assert not resources.violations(targets.TARGETS[80])  # 163 KB: fits


@pytest.mark.parametrize("capability, expected", [
    ((7, 5), None), ((8, 0), 80), ((8, 6), 86), ((8, 7), 87), ((8, 9), 89), ((9, 0), 90), ((10, 0), 100),
    ((10, 3), 100), ((11, 0), 110), ((12, 0), 120), ((12, 1), 120), ((13, 0), 120)])
def test_each_capability_maps_to_its_matrix_entry(capability, expected):
    target = targets.target_for(capability)
    assert (target.capability if target else None) == expected


@pytest.mark.parametrize("capability", sorted(targets.TARGETS))
def test_every_launch_pins_fp_fusion(capability, monkeypatch):
    """Every kernel launch of batches 1..8 (fp8's included) asks for FP fusion itself, so a Triton
    whose default differs (3.10 turns it off; TRITON_DEFAULT_FP_FUSION) compiles the same roundings
    the gates measured (kernels.launch_options)."""
    recorded = launches(targets.TARGETS[capability])
    assert {fn.__name__ for fn, _, _ in recorded} == launched_kernels(targets.TARGETS[capability])
    assert all(kwargs.get("enable_fp_fusion") is True for _, _, kwargs in recorded)


def test_the_h200_keeps_its_table_and_features():
    # Bit-identical actions on sm90 need the committed table and TMA + PDL exactly as before.
    assert LAUNCH_TABLES["sm90"] is SM90 and SM90.pdl is None and SM90.tma is None  # the default: auto, on from sm90
    h200 = table_for(targets.TARGETS[90])
    assert h200.configs is SM90.configs and h200.pdl is True and h200.tma is True
    assert targets.TARGETS[90].launch_table == "sm90"
    for cap in (90, 100, 110, 120):  # as kernels._hopper gates them: capability 9 or later
        assert targets.TARGETS[cap].tma and targets.TARGETS[cap].pdl
    for cap in (80, 86, 87, 89):
        assert not targets.TARGETS[cap].tma and not targets.TARGETS[cap].pdl


def test_a_launch_table_cannot_be_assigned_into():
    # One process may serve two GPUs' tables (or a bench try a config): none may rewrite another's.
    with pytest.raises(TypeError):
        SM90["splitk"]["stages"] = 2
    with pytest.raises(TypeError):
        SM90["batched"][65]["qkv"]["warps"] = 4
    tried = SM90.with_configs(splitk={"stages": 2})
    assert tried["splitk"]["stages"] == 2 and SM90["splitk"]["stages"] == 4 and tried["geglu"] == SM90["geglu"]


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_startup_names_the_gpu_and_the_path(monkeypatch, caplog):
    fake_gpu(monkeypatch, "NVIDIA GeForce RTX 4090", (8, 9))
    with caplog.at_level(logging.INFO, logger="vlaserve.runtime.fast.targets"):
        target = targets.choose_target(torch.device("cuda"))
    assert target is targets.TARGETS[89]
    assert caplog.messages == ["GPU NVIDIA GeForce RTX 4090 (sm_89): fast path, sm89 launch table, no TMA, no PDL"]
    table = table_for(target)  # what start-up hands the fast path next
    assert table["splitk"]["stages"] == 3 and table.pdl is False and table.tma is False
    assert not kernels.pdl_enabled(table) and not kernels.tma_enabled(table)

    caplog.clear()
    fake_gpu(monkeypatch, "NVIDIA Jetson AGX Orin", (8, 7))
    with caplog.at_level(logging.INFO, logger="vlaserve.runtime.fast.targets"):
        targets.choose_target(torch.device("cuda"))
    assert caplog.messages == ["GPU NVIDIA Jetson AGX Orin (sm_87): fast path, sm80 launch table, no TMA, no PDL; "
                               "memory shared with the CPU"]


def test_below_sm80_the_eager_model_serves_and_libraries_are_refused(monkeypatch, caplog, golden):
    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    config = load_policy_config(golden / "checkpoint")
    with caplog.at_level(logging.WARNING, logger="vlaserve.runtime.fast.targets"):
        runtime = Runtime(None, config, RuntimeConfig(device="cuda"), torch.device("cuda"), torch.bfloat16, "r")
        assert start(runtime) is None  # nothing to start: the eager model serves
    assert not runtime.fast_path and isinstance(runtime.runner, EagerRunner)
    assert caplog.messages == ["GPU Tesla T4 (sm_75): eager model; the fast path needs sm80 or newer "
                               "(bf16 tensor cores)"]
    with pytest.raises(ConfigError, match="gemm_library 'quack' runs on the CUDA fast path only"):
        start(Runtime(None, config, RuntimeConfig(device="cuda", gemm_library="quack"), torch.device("cuda"),
                      torch.bfloat16, "r"))


@pytest.mark.parametrize("gpu, capability", [("NVIDIA GeForce RTX 4090", (8, 9)), ("NVIDIA GeForce RTX 5090", (12, 0)),
                                             ("NVIDIA Jetson AGX Thor", (11, 0))])
def test_cute_libraries_are_refused_off_hopper_and_datacenter_blackwell(monkeypatch, gpu, capability):
    fake_gpu(monkeypatch, gpu, capability)
    sm = f"sm_{capability[0]}{capability[1]}"
    # Refused for the GPU before any package is looked for (installing them would not help).
    with pytest.raises(ConfigError, match=rf"gemm_library 'quack' runs on .* not on {gpu} \({sm}\): serve with "
                                          r"--gemm-library cublas"):
        cute.require(torch.device("cuda"))
    with pytest.raises(ConfigError, match=rf"attention_library 'fa4' .* not on {gpu} \({sm}\): serve with "
                                          r"--attention-library triton"):
        flash.require(torch.device("cuda"))


def test_cute_libraries_pass_the_gpu_check_on_hopper(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200", (9, 0))
    targets.require_cute(torch.device("cuda"), "gemm_library 'quack'", "--gemm-library cublas")


@pytest.mark.parametrize("integrated", [True, False])
def test_a_jetson_budget_is_its_free_memory_shared_with_pinned_layers(monkeypatch, integrated):
    # A 64 GB board (mem_get_info's total is the whole board's RAM) with 20 GB free as the OS sees it.
    free, board = 20 * GIB, 64 * GIB
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free, board))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(is_integrated=integrated))
    budget = cuda_budget(torch.device("cuda"))
    assert budget.usable == free  # never the board's 64 GB
    assert budget.shared_with_host is integrated and ("integrated GPU" in budget.source) is integrated
    # offload on a 15 GB device estimate with 6 GB of layers pinned in host memory: on an integrated
    # GPU both come out of the same 20 GB (21 GB needed); on a discrete one only the 15 GB counts.
    offload = MemoryEstimate("offload", 1, weights=10 * GIB, offload_slots=GIB, kv_and_buffers=GIB,
                             activations=2 * GIB, headroom=GIB, host_pinned=6 * GIB)
    assert offload.total == 15 * GIB
    assert budget.fits(offload) is not integrated


def euler_compiles(model, b: int, steps: int, with_rtc: bool) -> set:
    """The distinct compiles (Triton's specializations) of `steps` Euler steps at batch b on an H200."""
    from vlaserve.runtime.fast.model import StaticRTC
    from vlaserve.runtime.fast.pi0 import fast_model

    recorded: list = []
    with recording_launches(recorded) as patch:
        patch.setattr(kernels, "available", lambda: True)
        fast = fast_model(model, launch_table=table_for(targets.TARGETS[90]))
        cache = -(-(PREFIX_LEN + HORIZON) // 64) * 64
        k_cache = meta(VLM.depth, b, cache, VLM.head_dim)
        rtc = StaticRTC.allocate(b, HORIZON, ACTION_DIM, steps, "meta") if with_rtc else None
        pad = torch.ones(b, PREFIX_LEN + (1 if hasattr(model, "state_proj") else 0), dtype=torch.bool, device="meta")
        fast.denoise(pad, meta(b, HORIZON, ACTION_DIM, dtype=torch.float32), fast.schedule(steps), k_cache,
                     torch.empty_like(k_cache), rtc)
    compiles = set()
    for fn, args, kwargs in recorded:
        source, options = specialize(fn, args, kwargs, 90)
        compiles.add((fn.__name__, repr(source.signature), repr(source.constants), repr(source.attrs),
                      repr(sorted(options.__dict__.items()))))
    return compiles


def test_a_two_step_warm_up_compiles_every_kernel_of_the_call():
    """A capture's warm-up runs WARMUP_STEPS Euler steps, not the call's: it must launch every
    specialization the call launches (pointer alignments and integer divisibility from Triton's own
    binder; meta tensors' addresses carry their offsets), or the capture would compile inside the
    device lock. One step would not do: Pi0.5's fused action step between two steps is missed."""
    from vlaserve.model.pi0 import Pi0Model
    from vlaserve.model.pi05 import Pi05Model
    from vlaserve.startup.capture import WARMUP_STEPS

    config = ModelConfig.full_size()
    with torch.device("meta"):
        models = (Pi05Model(config), Pi0Model(config))
    for model in models:
        apply_dtype_policy(model, torch.bfloat16)
        for b in BATCHES:
            for with_rtc in (False, True):
                call = euler_compiles(model, b, 10, with_rtc)
                assert euler_compiles(model, b, WARMUP_STEPS, with_rtc) == call, (type(model).__name__, b, with_rtc)
    one_step = euler_compiles(models[0], 1, 1, False)
    assert one_step < euler_compiles(models[0], 1, 10, False)


@pytest.mark.parametrize("gpu, capability", [("Tesla T4", (7, 5)), ("NVIDIA A100-SXM4-80GB", (8, 0)),
                                             ("NVIDIA GeForce RTX 3090", (8, 6)), ("NVIDIA Jetson AGX Orin", (8, 7))])
def test_fp8_is_refused_without_fp8_tensor_cores(monkeypatch, gpu, capability, golden, caplog):
    """Neither torch._scaled_mm nor the e4m3 Triton kernels run below sm89 (Triton: "type fp8e4nv not
    supported in this architecture"): a policy asked for fp8 there is refused before anything loads, and
    so is `vlaserve check-precision`, naming the GPU."""
    from vlaserve.cli import main
    from vlaserve.policy import Policy

    fake_gpu(monkeypatch, gpu, capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(Policy, "__init__", lambda *a, **k: pytest.fail("the policy was built"))
    sm = f"sm_{capability[0]}{capability[1]}"
    refusal = rf"precision '{{}}' needs FP8 tensor cores .* which {gpu} \({sm}\) lacks: serve with --precision bf16"
    for precision in ("fp8", "fp8+expert"):
        with pytest.raises(ConfigError, match=refusal.format(re.escape(precision))):
            Policy.from_pretrained(golden / "checkpoint", device="cuda", precision=precision, progress=False)
    assert main(["check-precision", str(golden / "checkpoint"), "--device", "cuda"]) == 2  # a usage error's code
    assert any(re.search(refusal.format("fp8"), m) for m in caplog.messages)


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_fp8_passes_the_gpu_check_from_sm89(monkeypatch, capability):
    fake_gpu(monkeypatch, "a GPU", capability)
    targets.require_fp8(torch.device("cuda"), "fp8")
    targets.require_fp8(torch.device("cpu"), "fp8")  # the CPU computes fp8 by dequantizing (the emulation)
