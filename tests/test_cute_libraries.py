"""`--gemm-library quack` and `--attention-library fa4` (the CuTe-DSL libraries): their options and
their errors. The kernels themselves need a Hopper GPU and the libraries (bench/bench_gpu.py
--gemm-library quack and --attention-library fa4 check the actions against fp32 there; the probes
that checked every output element, gemm_library.py and flash_probe.py, are in bench/ at 0bdbea4)."""

import importlib.util
import re

import pytest
import torch

from conftest import golden_dir
from vlaserve import Policy
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError
from vlaserve.runtime.fast import cute, flash
from vlaserve.runtime.fast.model import FastPi05


# (option, its default, a CuTe-DSL value, the module whose require() checks the packages, the package it imports)
LIBRARIES = [("gemm_library", "cublas", "quack", cute, "quack"), ("attention_library", "triton", "fa4", flash, "flash_attn")]


@pytest.mark.parametrize("option, default, value, module, package", LIBRARIES)
def test_library_choices_are_validated(option, default, value, module, package):
    assert getattr(RuntimeConfig(), option) == default
    with pytest.raises(ConfigError, match=f"{option} must be one of {default}, {value}"):
        RuntimeConfig(**{option: "cutlass"})


@pytest.mark.parametrize("option, default, value, module, package", LIBRARIES)
def test_a_missing_library_says_how_to_install_it(option, default, value, module, package, monkeypatch):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    # On a GPU the libraries support (elsewhere the GPU is refused first: tests/test_gpu_targets.py)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with pytest.raises(ConfigError, match=rf"{option} '{value}' needs .*pip install -e '\.\[cute\]'"):
        module.require(torch.device("cuda"))


@pytest.mark.parametrize("option, default, value, module, package", LIBRARIES)
def test_a_library_off_the_cuda_fast_path_is_an_error_not_a_silent_fallback(option, default, value, module, package):
    with pytest.raises(ConfigError, match="CUDA fast path only"):
        Policy.from_pretrained(golden_dir() / "checkpoint", device="cpu", dtype="float32", progress=False,
                               **{option: value})
    model = Policy.from_pretrained(golden_dir() / "checkpoint", device="cpu", dtype="float32",
                                   progress=False).model  # float32: the fast path keeps stock kernels
    with pytest.raises(ConfigError, match="needs the Triton fast path"):
        FastPi05(model, **{option: value})


def test_each_backend_says_where_it_runs():
    from vlaserve.runtime.fast.backends import CublasGemm, Fa4Attention, Fp8Gemm, QuackGemm, TritonAttention
    from vlaserve.runtime.fast.targets import TARGETS

    bf16 = torch.bfloat16
    h200, rtx4090, thor, a100 = TARGETS[90], TARGETS[89], TARGETS[110], TARGETS[80]
    # The defaults run wherever the fast path does, the Triton kernels or not (target None).
    assert all(cls.supports(t, dt, p) for cls in (CublasGemm, TritonAttention) for t in (None, h200, a100)
               for dt in (bf16, torch.float32) for p in ("resident", "offload"))
    # The CuTe DSL libraries: the Triton fast path in bf16 on sm90 / sm100; quack not with streamed layers.
    assert QuackGemm.supports(h200, bf16, "resident") and Fa4Attention.supports(TARGETS[100], bf16, "offload")
    assert not any(cls.supports(t, bf16, "resident") for cls in (QuackGemm, Fa4Attention) for t in (None, rtx4090, thor))
    assert not QuackGemm.supports(h200, torch.float16, "resident") and not QuackGemm.supports(h200, bf16, "offload")
    # fp8: FP8 tensor cores from sm89, or the emulation off the GPU kernels.
    assert Fp8Gemm.supports(None, torch.float32, "resident") and Fp8Gemm.supports(rtx4090, bf16, "resident")
    assert not Fp8Gemm.supports(a100, bf16, "resident")


def test_the_fast_paths_methods_take_no_library_flag():
    """The variants are chosen once, in __init__ (backends.py): the methods a call runs call self.gemm /
    self.attention and branch on no library, Triton or fp8 flag of their own."""
    import inspect

    from vlaserve.runtime.fast.pi0 import FastPi0

    flags = re.compile(r"self\.(quack|flash|use_triton)\b|isinstance\([^)]*Fp8|gemm_library|attention_library")
    for cls in (FastPi05, FastPi0):
        for name, method in vars(cls).items():
            if callable(method) and name != "__init__":
                assert not flags.search(inspect.getsource(method)), (cls.__name__, name)


def test_a_combination_no_backend_runs_is_refused_once(golden):
    from vlaserve.model.fp8 import convert_to_fp8
    from vlaserve.runtime.fast.backends import CublasGemm, Fp8Gemm, TritonAttention

    model = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False).model
    fast = FastPi05(model, use_triton=False)
    assert type(fast.gemm) is CublasGemm and type(fast.attention) is TritonAttention
    with pytest.raises(ConfigError, match="gemm_library must be one of cublas, quack, not 'fp8'"):
        FastPi05(model, use_triton=False, gemm_library="fp8")  # fp8 follows the weights, never the option
    model = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False).model
    convert_to_fp8(model)
    assert type(FastPi05(model, use_triton=False).gemm) is Fp8Gemm
    with pytest.raises(ConfigError, match="gemm_library 'quack' takes bfloat16 weights"):
        FastPi05(model, use_triton=False, gemm_library="quack")
