"""Camera frames of another size than the model's are resized where the batch runs (on a GPU server,
the GPU: prepare keeps them raw and runtime.transfer.to_device finishes them). The same torch operations run
either way, so on one device the answers must be bit-identical to resizing during prepare."""

import numpy as np
import pytest
import torch

from conftest import golden_dir
from vlaserve.golden import GoldenCase, beyond_tolerance, case_dirs, compare_case
from vlaserve.processing.images import bytes_to_model_range, finish_frame, prepare_image
from vlaserve.runtime.transfer import into_buffers
from vlaserve.runtime.fast.buffers import BufferSpec

CASES = case_dirs(golden_dir())


@pytest.fixture
def deferring(golden_policy):
    golden_policy.preprocessor.defer_resize = True
    yield golden_policy
    golden_policy.preprocessor.defer_resize = False


def _frames(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"base_0_rgb": rng.integers(0, 256, (480, 640, 3), dtype=np.uint8),  # needs a resize
            "left_wrist_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),  # does not
            "right_wrist_0_rgb": rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)}


@pytest.mark.parametrize("size", [(480, 640), (180, 320), (36, 72), (300, 200)])
@pytest.mark.parametrize("dtype", ["uint8", "float"])
def test_finished_frame_equals_the_host_resize(size, dtype):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    if dtype == "float":
        image = image.astype(np.float32) / 255.0
    host = prepare_image(image, 224, "images.cam")
    raw = prepare_image(image, 224, "images.cam", keep_bytes=True, defer_resize=True)
    assert raw.shape[1:] == size  # left for the device
    assert torch.equal(finish_frame(raw, 224), host)


def test_bytes_become_the_references_model_inputs_for_every_value():
    """The reference feeds the model uint8 / 255.0 (a true float32 division: LeRobot divides on the
    host, pi05_golden/README) and maps [0, 1] to [-1, 1] as x * 2 - 1; numpy computes that here."""
    reference = np.arange(256, dtype=np.float32) / np.float32(255) * np.float32(2) - np.float32(1)
    assert np.array_equal(bytes_to_model_range(torch.arange(256, dtype=torch.uint8)).numpy(), reference)
    # (a multiplication by 1/255, what CUDA torch does for a division by a Python number, is not it)
    assert (np.arange(256, dtype=np.float32) * (np.float32(1) / np.float32(255)) * 2 - 1 != reference).sum() == 111


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")
@pytest.mark.parametrize("size", [(224, 224), (480, 640), (180, 320), (36, 72), (300, 200)])
def test_on_a_gpu_frames_become_the_same_model_inputs_as_on_the_host(size):
    rng = np.random.default_rng(1)
    everything = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(bytes_to_model_range(everything.cuda()).cpu(), bytes_to_model_range(everything))
    image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    raw = prepare_image(image, 224, "images.cam", keep_bytes=True, defer_resize=True)
    assert torch.equal(finish_frame(raw.cuda(), 224).cpu(), prepare_image(image, 224, "images.cam"))


def test_deferred_resize_gives_the_same_actions(golden_policy, deferring):
    observations = [{"images": _frames(s), "state": np.full(14, 0.1 * s, np.float32), "task": "stack the cups"}
                    for s in range(3)]
    deferring.preprocessor.defer_resize = False
    expected = [r.actions for r in deferring.infer_batch(observations, seeds=[1, 2, 3])]
    deferring.preprocessor.defer_resize = True
    request = deferring.request(observations[0])
    prepared = deferring.prepare(request)
    assert [slot for slot, _ in prepared.pending] == [0, 2]  # the two cameras that need a resize
    got = [r.actions for r in deferring.infer_batch(observations, seeds=[1, 2, 3])]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_mixed_bytes_and_float_batch_resolves_on_the_host(golden_policy, deferring):
    frames = _frames(7)
    floats = {cam: (im.astype(np.float32) / 255.0) for cam, im in frames.items()}
    observations = [{"images": frames, "state": np.zeros(14, np.float32), "task": "t"},
                    {"images": floats, "state": np.zeros(14, np.float32), "task": "t"}]
    got = deferring.infer_batch(observations, seeds=[0, 0])
    deferring.preprocessor.defer_resize = False
    want = deferring.infer_batch(observations, seeds=[0, 0])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.actions, b.actions)


def test_prefix_cache_tells_deferred_frames_apart():
    from vlaserve.runtime.prefix_cache import PrefixCache

    cache = PrefixCache(4, "ns")
    placeholder = torch.zeros(3, 3, 224, 224, dtype=torch.uint8)
    mask, tokens, tmask = torch.ones(3, dtype=torch.bool), torch.ones(8, dtype=torch.long), torch.ones(8, dtype=torch.bool)
    a = torch.zeros(3, 480, 640, dtype=torch.uint8)
    b = a.clone()
    b[0, 0, 0] = 1
    keys = {cache.key(placeholder, mask, tokens, tmask, [(0, f)]) for f in (a, b)}
    keys.add(cache.key(placeholder, mask, tokens, tmask, [(1, a)]))
    keys.add(cache.key(placeholder, mask, tokens, tmask))
    assert len(keys) == 4


@pytest.mark.slow  # every golden case again; test_deferred_resize_gives_the_same_actions is the quick one
@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_golden_cases_with_deferred_resize(deferring, case_dir):
    """The golden resize cases (float frames of 180x320 and 480x640) resized in runtime.transfer.to_device."""
    case = GoldenCase.load(case_dir)
    exact, deltas = compare_case(deferring, case)
    assert all(exact.values()), {k: v for k, v in exact.items() if not v}
    # test_golden's tolerances (golden.tolerance): float32 reimplementations agree to ~1e-6, bugs show >= 1e-3.
    too_far = beyond_tolerance(case, deltas)
    assert not too_far, too_far


@pytest.mark.parametrize("view", ["flipped", "read_only", "chw", "strided"])
def test_uint8_frames_of_any_memory_layout_prepare_alike(view):
    """uint8 frames become tensor views (one copy later, in the batch's stack); flipped (negative
    strides), read-only (msgpack payloads), CHW and sliced arrays give the same pixels as a plain copy."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, (224, 448, 3), dtype=np.uint8)
    image = {"flipped": base[::-1, ::2], "strided": base[:, ::2], "chw": np.ascontiguousarray(base[:, ::2].transpose(2, 0, 1)),
             "read_only": base[:, ::2].copy()}[view]
    if view == "read_only":
        image.setflags(write=False)
    expected = torch.from_numpy(np.ascontiguousarray(np.asarray(image if view == "chw" else image.transpose(2, 0, 1))))
    got = prepare_image(image, 224, "images.cam", keep_bytes=True)
    assert torch.equal(got, expected)
    assert torch.equal(prepare_image(image, 224, "images.cam"), expected.float() / 255.0 * 2.0 - 1.0)


@pytest.mark.parametrize("layout", ["hwc", "chw", "flipped", "absent_camera", "other_size"])
def test_frames_stay_bytes_on_the_host_and_become_the_old_host_result_on_the_device(golden_policy, layout):
    """A request's uint8 frames are stacked as they lie (no float conversion, no resize, no transposition
    on the host) and `to_device` (here the CPU) gives exactly the contiguous float images the host
    computed before: bytes_to_model_range of the frames stacked channels-first, blank slots at -1."""
    from vlaserve.processing.images import bytes_to_model_range
    from vlaserve.runtime.transfer import to_device

    rng = np.random.default_rng(7)
    frames = {cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in
              ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")}
    if layout == "chw":
        frames["left_wrist_0_rgb"] = np.ascontiguousarray(frames["left_wrist_0_rgb"].transpose(2, 0, 1))
    if layout == "flipped":
        frames["base_0_rgb"] = frames["base_0_rgb"][::-1]
    if layout == "absent_camera":
        del frames["right_wrist_0_rgb"]
    if layout == "other_size":
        frames["base_0_rgb"] = rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)
    pre = golden_policy.preprocessor
    state = np.zeros(golden_policy.config.state_dim, dtype=np.float32)
    requests = [golden_policy.request({"images": frames, "state": state, "task": "t"}, seed=i) for i in range(2)]
    deferred = pre.defer_resize
    pre.defer_resize = layout == "other_size"
    try:
        for batch in (requests[:1], requests):
            inputs, _, _ = pre.collate(batch)
            assert inputs.images.dtype == torch.uint8  # nothing converted on the host
            if layout in ("hwc", "absent_camera", "other_size"):  # nor transposed: channels-last, as sent
                assert inputs.images.permute(0, 1, 3, 4, 2).is_contiguous()
            chw = [torch.from_numpy(np.ascontiguousarray(np.asarray(f).transpose(2, 0, 1) if f.shape[-1] == 3 else f))
                   for f in frames.values()]
            if layout == "other_size":  # resized where the batch runs, by the same operations as on the host
                chw[0] = prepare_image(frames["base_0_rgb"], 224, "f", keep_bytes=False)
                expected = torch.stack([chw[0]] + [bytes_to_model_range(c) for c in chw[1:]])
            else:
                chw += [torch.zeros(3, 224, 224, dtype=torch.uint8)] * (3 - len(chw))
                expected = bytes_to_model_range(torch.stack(chw))
            device_images = to_device(inputs, torch.device("cpu")).images
            assert device_images.is_contiguous()
            assert torch.equal(device_images, expected.expand(len(batch), *expected.shape))
            # The fast path's way up: straight into its static buffers (stale values there before).
            buffers = BufferSpec.of(golden_policy.config, len(batch), torch.float32, inputs.tokens.shape[1]).allocate("cpu")
            for buffer in buffers.values():
                buffer.fill_(True) if buffer.dtype == torch.bool else buffer.fill_(7)
            into_buffers(inputs, buffers)
            assert torch.equal(buffers["images"], device_images)
            for name in ("image_masks", "tokens", "token_mask"):
                assert torch.equal(buffers[name], getattr(inputs, name))
    finally:
        pre.defer_resize = deferred


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")
def test_on_a_gpu_the_buffers_get_the_hosts_model_inputs(golden_policy):
    """A robot's batch of raw frames (one to resize, one absent camera) written into CUDA buffers, as the fast
    path does, holds exactly what the host computes for it."""
    from vlaserve.runtime.transfer import to_device

    rng = np.random.default_rng(11)
    frames = {"base_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
              "left_wrist_0_rgb": rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)}
    state = np.zeros(golden_policy.config.state_dim, dtype=np.float32)
    pre = golden_policy.preprocessor
    deferred, pre.defer_resize = pre.defer_resize, True
    try:
        requests = [golden_policy.request({"images": frames, "state": state, "task": "t"}, seed=i) for i in range(2)]
        inputs, _, _ = pre.collate(requests)
    finally:
        pre.defer_resize = deferred
    assert inputs.images.dtype == torch.uint8 and inputs.pending
    buffers = BufferSpec.of(golden_policy.config, 2, torch.bfloat16, inputs.tokens.shape[1]).allocate("cuda")
    into_buffers(inputs, buffers)
    host = to_device(inputs, torch.device("cpu"))
    for name in ("images", "image_masks", "tokens", "token_mask"):
        assert torch.equal(buffers[name].cpu(), getattr(host, name)), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)"))])
@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_the_captured_conversion_writes_what_the_launched_one_does(golden_policy, device, layout):
    """The fast path's way in for bytes (`BytesIn`: the frames copied into a channels-last byte buffer, their
    conversion replayed from a CUDA graph; on the CPU the same function called): the buffers hold exactly what
    `into_buffers` writes without it, for batches of 1 and 2 with a frame resized where the batch runs and an
    absent camera, and a second batch through the same graph replaces the first's values (stale ones before)."""
    from types import SimpleNamespace

    from vlaserve.runtime.graphs import _Graph
    from vlaserve.runtime.transfer import BytesIn

    pre, state = golden_policy.preprocessor, np.zeros(golden_policy.config.state_dim, dtype=np.float32)

    def batch(seed: int, size: int):
        frames = dict(_frames(seed))
        del frames["right_wrist_0_rgb"]
        if layout == "chw":
            frames = {cam: np.ascontiguousarray(f.transpose(2, 0, 1)) for cam, f in frames.items()}
        requests = [golden_policy.request({"images": frames, "state": state, "task": "t"}, seed=i) for i in range(size)]
        deferred, pre.defer_resize = pre.defer_resize, True
        try:
            return pre.collate(requests)[0]
        finally:
            pre.defer_resize = deferred

    for size in (1, 2):
        spec = BufferSpec.of(golden_policy.config, size, torch.float32)
        buffers, expected = spec.allocate(device), spec.allocate(device)
        buffers["images"].fill_(7)
        if device == "cuda":  # torch's kernels loaded before the capture, as FastRunner's warm-up does
            BytesIn.conversion(buffers)()
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            bytes_in = BytesIn(buffers, lambda fn: _Graph(fn, pool, stream))
        else:
            bytes_in = BytesIn(buffers, lambda fn: SimpleNamespace(replay=fn))
        for seed in (5, 6):
            inputs = batch(seed, size)
            assert inputs.images.dtype == torch.uint8 and inputs.pending
            into_buffers(inputs, buffers, bytes_in)
            into_buffers(inputs, expected)
            assert torch.equal(buffers["images"], expected["images"]), (size, seed)
            assert not torch.equal(buffers["images"][0, 0], buffers["images"][0, 1])


def test_float_images_and_a_state_go_straight_into_the_buffers_as_they_are(golden_policy):
    """Float images (sent normalized, or a batch mixing them with bytes) are copied as they are; Pi0's
    state too (its buffers have one)."""
    from vlaserve.types import ModelInputs

    rng = np.random.default_rng(3)
    images = torch.from_numpy(rng.uniform(-1, 1, (2, 3, 3, 224, 224)).astype(np.float32))
    inputs = ModelInputs(images, torch.tensor([[True, True, False]] * 2), torch.arange(96).repeat(2, 1),
                         torch.ones(2, 96, dtype=torch.bool), torch.from_numpy(rng.standard_normal((2, 32)).astype(np.float32)))
    buffers = BufferSpec.of(golden_policy.config, 2, torch.float32, 96, state_dim=32).allocate("cpu")
    into_buffers(inputs, buffers)
    for name in ("images", "image_masks", "tokens", "token_mask", "state"):  # (to_device is into_buffers too)
        assert torch.equal(buffers[name], getattr(inputs, name))
