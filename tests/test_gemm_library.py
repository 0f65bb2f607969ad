"""`--gemm-library quack`: its option and its errors. The kernels themselves need a Hopper GPU and quack
(bench/gemm_library.py checks every output element against the default's, and the actions bit for bit,
there)."""

import importlib.util

import pytest
import torch

from conftest import golden_dir
from vlaserve import Policy
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError
from vlaserve.runtime.fast import cute
from vlaserve.runtime.fast.model import FastPi05


def test_gemm_library_choices_are_validated():
    assert RuntimeConfig().gemm_library == "cublas"
    with pytest.raises(ConfigError, match="gemm_library must be one of cublas, quack"):
        RuntimeConfig(gemm_library="cutlass")


@pytest.mark.skipif(importlib.util.find_spec("quack") is not None, reason="quack is installed here")
def test_quack_missing_says_how_to_install_it():
    with pytest.raises(ConfigError, match=r"pip install 'vlaserve\[cute\]'"):
        cute.require(torch.device("cuda"))


def test_quack_off_the_cuda_fast_path_is_an_error_not_a_silent_fallback():
    with pytest.raises(ConfigError, match="CUDA fast path only"):
        Policy.from_pretrained(golden_dir() / "checkpoint", device="cpu", dtype="float32", progress=False,
                               gemm_library="quack")
    model = Policy.from_pretrained(golden_dir() / "checkpoint", device="cpu", dtype="float32",
                                   progress=False).model  # float32: the fast path keeps stock kernels
    with pytest.raises(ConfigError, match="needs the Triton fast path"):
        FastPi05(model, gemm_library="quack")
