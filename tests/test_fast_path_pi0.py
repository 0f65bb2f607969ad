"""Pi0 on the fast path's math, on the CPU with stock kernels (no Triton, no graphs), against every Pi0
golden case: the plain-RMSNorm expert as a constant AdaRMS schedule, the state token's K/V computed
once into the static cache after the prefix, RTC with per-step guidance weights."""

import pytest
import torch

from fixtures import fixture_dir
from vlaserve.golden import GoldenCase, case_dirs
from vlaserve import Policy
from vlaserve.runtime.fast.buffers import BufferSpec
from vlaserve.runtime.fast.model import StaticRTC
from vlaserve.runtime.fast.pi0 import FastPi0, fast_model

GOLDEN = fixture_dir("pi0_golden")
CASES = case_dirs(GOLDEN)


@pytest.fixture(scope="module")
def pi0():
    policy = Policy.from_pretrained(GOLDEN / "checkpoint", device="cpu", dtype="float32", progress=False)
    return policy, fast_model(policy.model, use_triton=False)


@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_fast_pi0_math_matches_the_reference(pi0, case_dir):
    policy, fast = pi0
    assert isinstance(fast, FastPi0)
    case = GoldenCase.load(case_dir)
    rtcs = case.rtcs() or [None] * case.meta["batch_size"]
    inputs, _, guidance = policy.preprocessor.collate([policy.request(o, rtc=r)
                                                       for o, r in zip(case.observations(), rtcs)])
    b, n = inputs.image_masks.shape
    model = policy.model
    plen = n * model.vision.dims.num_patches + inputs.tokens.shape[1]
    k = torch.zeros(len(model.vlm.layers), b, -(-(plen + 1 + 50) // 64) * 64, model.vlm.dims.head_dim)
    v = torch.zeros_like(k)
    slots = inputs.vision_slots()
    sched = fast.schedule(case.meta["num_steps"])
    rtc = None
    if guidance is not None:
        rtc = StaticRTC.allocate(b, 50, 32, len(sched.times), "cpu")
        rtc.fill(guidance, sched.times)
    with torch.no_grad():
        pad = fast.prefix(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask, k, v, slots)
        context = fast.state_token(inputs.state, pad, k, v)
        actions = fast.denoise(context, torch.from_numpy(case.tensors["input.noise"]), sched, k, v, rtc)
    expected = torch.from_numpy(case.tensors["expected.actions_model"])
    # Same float32 function, other summation orders (fused GEMMs, SDPA): ~1e-6; bugs move it >= 5.6e-4.
    assert (actions - expected).abs().max() < 1e-5
    assert context.shape[1] == plen + 1 and bool(context[:, plen].all())


def test_the_static_buffers_hold_the_state_token():
    spec = BufferSpec(batch=2, cameras=3, resolution=224, token_len=48, prefix_len=816, horizon=50,
                      max_action_dim=32, layers=18, head_dim=256, kv_dtype=torch.bfloat16, state_dim=32)
    assert spec.context_len == 817 and spec.cache_len == 896  # 817 + 50 rounded up to the 64-key tile
    assert spec.layout()["state"] == ((2, 32), torch.float32) and spec.layout()["pad"][0] == (2, 817)
