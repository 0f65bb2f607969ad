"""`--gemm-library quack` and `--attention-library fa4` (the CuTe-DSL libraries): their options and
their errors. The kernels themselves need a Hopper GPU and the libraries (bench/bench_gpu.py
--gemm-library quack and --attention-library fa4 check the actions against fp32 there; the probes
that checked every output element, gemm_library.py and flash_probe.py, are in bench/ at 0bdbea4)."""

import importlib.util

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
    with pytest.raises(ConfigError, match=rf"{option} '{value}' needs .*pip install 'vlaserve\[cute\]'"):
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
