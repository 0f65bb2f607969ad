"""The CUDA fast path's math, run on the CPU with stock kernels (no Triton, no graphs).

The Triton kernels and CUDA graphs need a GPU (bench/bench_gpu.py checks them there); what runs here
is everything else the fast path changes: fused weights, precomputed AdaRMS modulation, the static
K/V cache with the action tokens in its tail, the skipped last prefix layer, vision skipped for
absent trailing cameras, and RTC with per-step guidance weights.
"""

import pytest
import torch

from conftest import golden_dir
from vlaserve import Policy
from vlaserve.runtime.fast.model import FastPi05, StaticRTC
from vlaserve.golden import GoldenCase, case_dirs

CASES = case_dirs(golden_dir())


@pytest.fixture(scope="module")
def fast_policy(golden):
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)
    return policy, FastPi05(policy.model, use_triton=False)


@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_fast_path_math_matches_the_reference(fast_policy, case_dir):
    policy, fast = fast_policy
    case = GoldenCase.load(case_dir)
    rtcs = case.rtcs() or [None] * case.meta["batch_size"]
    inputs, _, guidance = policy.preprocessor.collate([policy.request(o, rtc=r)
                                                       for o, r in zip(case.observations(), rtcs)])
    b, n = inputs.image_masks.shape
    plen = n * policy.model.vision.dims.num_patches + inputs.tokens.shape[1]
    cache_len = -(-(plen + 50) // 64) * 64
    layers, head_dim = len(policy.model.vlm.layers), policy.model.vlm.dims.head_dim
    k = torch.zeros(layers, b, cache_len, head_dim)
    v = torch.zeros_like(k)
    slots = inputs.vision_slots()
    noise = torch.from_numpy(case.tensors["input.noise"])
    sched = fast.schedule(case.meta["num_steps"])
    rtc = None
    if case.rtcs():
        rtc = StaticRTC.allocate(b, 50, 32, len(sched.times), "cpu")
        rtc.fill(guidance, sched.times)
    with torch.no_grad():
        pad = fast.prefix(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask, k, v, slots)
        actions = fast.denoise(pad, noise, sched, k, v, rtc)
    expected = torch.from_numpy(case.tensors["expected.actions_model"])
    # Same float32 function, other summation orders (fused GEMMs, SDPA): ~1e-6, as the eager path.
    assert (actions - expected).abs().max() < 1e-5
    # The cache holds each item's valid tokens first, in order (a token's row is its RoPE position),
    # and the mask returned is that prefix; their K/V equal the reference's (absent cameras' slots
    # are skipped, so the masked rows are not compared).
    token_pad = torch.cat([inputs.image_masks.repeat_interleave(policy.model.vision.dims.num_patches, dim=1),
                           inputs.token_mask], dim=1)
    valid = token_pad.sum(1)
    assert torch.equal(pad, torch.arange(plen)[None] < valid[:, None])
    for layer in range(layers):
        ref = torch.from_numpy(case.tensors[f"expected.prefix_kv.{layer}.key"])[:, 0]
        for i in range(b):
            assert (k[layer, i, :valid[i]] - ref[i, token_pad[i]]).abs().max() < 1e-5


def test_a_prompt_bucket_runs_on_views_of_the_full_length_buffers(fast_policy):
    # FastRunner serves a prompt bucket from views of its batch size's full-length buffers (no
    # memory of its own): the prefix and Euler steps must give the reference's actions through them.
    from vlaserve.runtime.fast.buffers import BufferSpec

    policy, fast = fast_policy
    case = GoldenCase.load(CASES[0])
    inputs, _, _ = policy.preprocessor.collate([policy.request(o) for o in case.observations()])
    b, full_len = inputs.tokens.shape
    bucket = int(inputs.token_mask.sum(1).max()) + 1  # the longest prompt fits, one pad to spare
    assert bucket < full_len
    dtype = policy.model.vlm.dtype
    full = BufferSpec.of(policy.config, b, dtype).allocate("cpu")
    spec = BufferSpec.of(policy.config, b, dtype, bucket)
    view = spec.views(full)
    for name, (shape, _) in spec.layout().items():
        assert tuple(view[name].shape) == shape and view[name].data_ptr() == full[name].data_ptr()
    assert view["k_cache"].shape[2] < full["k_cache"].shape[2] and not view["k_cache"].is_contiguous()
    view["tokens"].copy_(inputs.tokens[:, :bucket])
    view["token_mask"].copy_(inputs.token_mask[:, :bucket])
    view["images"].copy_(inputs.images)
    view["image_masks"].copy_(inputs.image_masks)
    sched = fast.schedule(case.meta["num_steps"])
    with torch.no_grad():
        pad = fast.prefix(view["images"], view["image_masks"], view["tokens"], view["token_mask"], view["k_cache"],
                          view["v_cache"], inputs.vision_slots())
        actions = fast.denoise(pad, torch.from_numpy(case.tensors["input.noise"]), sched, view["k_cache"],
                               view["v_cache"])
    expected = torch.from_numpy(case.tensors["expected.actions_model"])
    # The padding the bucket drops is masked in the reference: the same float32 function over other
    # GEMM shapes, ~1e-6 (4.8e-7 here), under the 1e-5 the full-length test above allows.
    assert (actions - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match="does not fit"):
        BufferSpec.of(policy.config, b + 1, dtype).views(full)


def test_the_guidance_table_is_the_euler_loops_weights():
    """The fast path's per-step RTC guidance weights, computed on the host once per (schedule, max weight),
    are rtc_guidance_weight's at each step, bit for bit, including the schedule's ends (t = 1: the weight is
    1/0 -> clipped to the max; a zero max weight: an item without RTC)."""
    from vlaserve.model.flow import euler_times
    from vlaserve.model.rtc import guidance_table, rtc_guidance_weight

    max_weight = torch.tensor([5.0, 0.0, 10.0, 0.3])
    for times in (euler_times(10), euler_times(3), [1.0, 0.5, 0.0]):
        expected = torch.stack([rtc_guidance_weight(t, max_weight) for t in times])
        table = guidance_table(times, max_weight)
        assert table.dtype == torch.float32 and torch.equal(table, expected)
        assert torch.equal(guidance_table(times, max_weight), table)  # from the cache: the same
    assert guidance_table([1.0], max_weight)[0].tolist() == max_weight.tolist()


def test_static_rtc_goes_up_in_one_block():
    """StaticRTC's three buffers are views of one block, each 16-byte aligned (Triton specializes on it),
    and `fill` writes them through the host mirror: the guidance the table gives, prev and weights as sent."""
    from vlaserve.model.flow import euler_times
    from vlaserve.model.rtc import RTCGuidance, guidance_table

    g = torch.Generator().manual_seed(0)
    for b in (1, 3, 5):
        static = StaticRTC.allocate(b, 50, 32, 10, "cpu")
        block = static.mirror.device_block
        for t in (static.prev, static.weights, static.guidance):
            assert t.untyped_storage().data_ptr() == block.untyped_storage().data_ptr() and t.data_ptr() % 16 == 0
        assert all(static.guidance[s].data_ptr() % 16 == 0 for s in range(10))
        rtc = RTCGuidance(torch.randn(b, 50, 32, generator=g), torch.rand(b, 50, generator=g), torch.rand(b) * 10)
        static.fill(rtc, euler_times(10))
        assert torch.equal(static.prev, rtc.prev) and torch.equal(static.weights, rtc.weights)
        assert torch.equal(static.guidance, guidance_table(euler_times(10), rtc.max_weight))


class _HostEvent:
    """A CUDA event's stand-in on the CPU, where every operation has finished when it returns."""

    def record(self):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_fast_runner_takes_a_host_batch_into_its_static_buffers(fast_policy, case_dir, monkeypatch):
    """FastRunner.dispatch as the runtime calls it (host inputs, RTC from the host), without graphs on the CPU:
    the frames' bytes, masks, token ids and noise go into the batch size's static buffers (twice: the second
    call's values replace the first's, a bucket's views included) and RTC through StaticRTC's host mirror;
    the reference's actions, as the math test above (1e-5)."""
    from vlaserve.runtime.graphs import FastRunner

    policy, _ = fast_policy
    case = GoldenCase.load(case_dir)
    runner = FastRunner(policy.model, policy.config, use_graphs=False, use_triton=False)
    monkeypatch.setattr(runner, "_events", lambda: (_HostEvent(), _HostEvent(), _HostEvent()))
    rtcs = case.rtcs() or [None] * case.meta["batch_size"]
    inputs, _, guidance = policy.preprocessor.collate([policy.request(o, rtc=r)
                                                       for o, r in zip(case.observations(), rtcs)])
    noise = torch.from_numpy(case.tensors["input.noise"])
    expected = torch.from_numpy(case.tensors["expected.actions_model"])
    bucket = int(inputs.token_mask.sum(1).max()) + 1
    shorter = type(inputs)(inputs.images, inputs.image_masks, inputs.tokens[:, :bucket].contiguous(),
                           inputs.token_mask[:, :bucket].contiguous(), inputs.state, inputs.pending)
    other = torch.randn(noise.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        runner.dispatch(inputs, other, case.meta["num_steps"], guidance)  # stale values in every block
        for batch in (inputs, shorter):
            actions, _ = runner.dispatch(batch, noise, case.meta["num_steps"], guidance)
            # The fast path's float32 function against the reference's, other summation orders: the 1e-5 of
            # test_fast_path_math_matches_the_reference (stale inputs left anywhere would move it by far more).
            assert (actions - expected).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["hwc", "chw", "resize"])
def test_fast_runner_takes_camera_bytes_from_the_host(fast_policy, layout, monkeypatch):
    """Raw camera bytes, as robots send them (channels-last, or channels-first; one frame to resize where the
    batch runs), at a prompt bucket: FastRunner.dispatch from the host gives exactly the actions of the same
    kernels on `to_device`'s inputs (the eager runner's way up: the same conversion of the same bytes)."""
    import numpy as np

    from vlaserve.runtime.transfer import to_device
    from vlaserve.runtime.graphs import FastRunner

    policy, fast = fast_policy
    rng = np.random.default_rng(2)
    frames = [{cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in policy.config.cameras}
              for _ in range(2)]
    if layout == "chw":
        frames = [{cam: np.ascontiguousarray(f.transpose(2, 0, 1)) for cam, f in item.items()} for item in frames]
    if layout == "resize":
        frames[1][policy.config.cameras[0]] = rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)
    state = np.zeros(policy.config.state_dim, dtype=np.float32)
    pre = policy.preprocessor
    deferred, pre.defer_resize = pre.defer_resize, True
    try:
        requests = [policy.request({"images": f, "state": state, "task": "pick"}, seed=i) for i, f in enumerate(frames)]
        inputs, noise, _ = pre.collate(requests)
    finally:
        pre.defer_resize = deferred
    assert inputs.images.dtype == torch.uint8 and bool(inputs.pending) == (layout == "resize")
    bucket = int(inputs.token_mask.sum(1).max()) + 1
    inputs = type(inputs)(inputs.images, inputs.image_masks, inputs.tokens[:, :bucket].contiguous(),
                          inputs.token_mask[:, :bucket].contiguous(), inputs.state, inputs.pending)
    runner = FastRunner(policy.model, policy.config, use_graphs=False, use_triton=False)
    monkeypatch.setattr(runner, "_events", lambda: (_HostEvent(), _HostEvent(), _HostEvent()))
    moved = to_device(inputs, torch.device("cpu"))
    b = len(requests)
    k = torch.zeros(runner.buffers(b, bucket)["k_cache"].shape)
    v = torch.zeros_like(k)
    with torch.no_grad():
        actions, _ = runner.dispatch(inputs, noise, 10)
        pad = fast.prefix(moved.images, moved.image_masks, moved.tokens, moved.token_mask, k, v, inputs.vision_slots())
        expected = fast.denoise(pad, noise, fast.schedule(10), k, v)
    assert torch.equal(actions, expected)
