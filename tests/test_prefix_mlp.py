"""`--prefix-mlp quack`: the interleaved gate/up layout it packs at load, and its errors. The kernel
itself needs a Hopper GPU and quack (bench/prefix_mlp.py checks its actions bit for bit there)."""

import importlib.util

import pytest
import torch

from conftest import golden_dir
from vlaserve import Policy
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError
from vlaserve.golden import GoldenCase, beyond_tolerance, case_dirs, compare_case
from vlaserve.runtime.fast import cute
from vlaserve.runtime.fast.model import FastPi05
from vlaserve.runtime.fast.weights import FusedWeights


def _fresh_policy():
    return Policy.from_pretrained(golden_dir() / "checkpoint", device="cpu", dtype="float32", progress=False)


def test_pairs_layout_is_the_only_copy_and_the_eager_model_still_matches_the_reference():
    policy = _fresh_policy()
    layers = policy.model.vlm.layers
    before = [(lyr.mlp.gate_proj.weight.clone(), lyr.mlp.up_proj.weight.clone()) for lyr in layers]
    fused = FusedWeights.of(policy.model, gate_up_pairs=True)
    assert fused.gate_up_pairs and FusedWeights.of(policy.model, gate_up_pairs=True) is fused
    for lyr, lw, (gate, up) in zip(layers, fused.vlm, before):
        g, u = lyr.mlp.gate_proj.weight, lyr.mlp.up_proj.weight
        assert torch.equal(lw.gate_up[0::2], gate) and torch.equal(lw.gate_up[1::2], up)
        # the parameters are views of the pairs tensor: one copy of the weights, not two
        assert g.data_ptr() == lw.gate_up.data_ptr()
        assert u.data_ptr() == lw.gate_up.data_ptr() + lw.gate_up.stride(0) * lw.gate_up.element_size()
        assert g.stride(0) == u.stride(0) == 2 * g.shape[1]
    for lw in fused.expert:  # only the prefix's layout changes
        assert lw.gate_up.is_contiguous()
    # The eager model now multiplies by strided views: still the reference's numbers (golden tolerance).
    case = GoldenCase.load(case_dirs(golden_dir())[0])
    exact, deltas = compare_case(policy, case)
    assert all(exact.values()) and not beyond_tolerance(case, deltas)


def test_offload_slots_cannot_take_the_pairs_layout():
    with pytest.raises(ValueError, match="offload"):
        FusedWeights(_fresh_policy().model, views_only=True, gate_up_pairs=True)


def test_prefix_mlp_choices_are_validated():
    assert RuntimeConfig().prefix_mlp == "cublas"
    with pytest.raises(ConfigError, match="prefix_mlp must be one of cublas, quack"):
        RuntimeConfig(prefix_mlp="cutlass")


@pytest.mark.skipif(importlib.util.find_spec("quack") is not None, reason="quack is installed here")
def test_quack_missing_says_how_to_install_it():
    with pytest.raises(ConfigError, match=r"pip install 'vlaserve\[cute\]'"):
        cute.require(torch.device("cuda"))


def test_quack_off_the_cuda_fast_path_is_an_error_not_a_silent_fallback():
    with pytest.raises(ConfigError, match="CUDA fast path only"):
        Policy.from_pretrained(golden_dir() / "checkpoint", device="cpu", dtype="float32", progress=False,
                               prefix_mlp="quack")
    model = _fresh_policy().model  # float32: the fast path keeps stock kernels, so no fused prefix MLP
    with pytest.raises(ConfigError, match="needs the Triton fast path"):
        FastPi05(model, prefix_mlp="quack")
