"""Raw frames sent to the device ahead of their launch (runtime/uploads.py) give a batch the same model
inputs as frames stacked on the host and copied up in the launch: the same bytes, placed in the same slots.
Requests that cannot go that way (frames to resize, a keep-warm rehearsal) keep the host path, and a batch
that mixes the two runs from the host. Here the "device" is the CPU: the same thread and copies; the CUDA
stream and its ordering are tested on a GPU host (the last test)."""

import numpy as np
import pytest
import torch

from vlaserve.processing.prepare import into_buffers
from vlaserve.runtime.fast.buffers import BufferSpec
from vlaserve.runtime.uploads import FrameUploads

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def _observation(policy, layout: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    frames = {cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in CAMERAS}
    if layout == "chw":  # every camera channels-first
        frames = {cam: np.ascontiguousarray(f.transpose(2, 0, 1)) for cam, f in frames.items()}
    if layout == "mixed_layouts":  # one channels-first among channels-last ones
        frames["left_wrist_0_rgb"] = np.ascontiguousarray(frames["left_wrist_0_rgb"].transpose(2, 0, 1))
    if layout == "flipped":
        frames["base_0_rgb"] = frames["base_0_rgb"][::-1]
    if layout == "absent_camera":
        del frames["right_wrist_0_rgb"]
    if layout == "other_size":  # resized where the batch runs: not uploaded
        frames["base_0_rgb"] = rng.integers(0, 256, (180, 320, 3), dtype=np.uint8)
    state = rng.uniform(-1, 1, policy.config.state_dim).astype(np.float32)
    return {"images": frames, "state": state, "task": f"task {seed}"}


def _buffers(policy, inputs) -> dict:
    """Static buffers as the fast path has them, stale values in them, with `inputs` written in."""
    buffers = BufferSpec.of(policy.config, inputs.tokens.shape[0], torch.float32, inputs.tokens.shape[1]).allocate("cpu")
    for buffer in buffers.values():
        buffer.fill_(True) if buffer.dtype == torch.bool else buffer.fill_(7)
    into_buffers(inputs, buffers)
    return buffers


@pytest.fixture
def uploading(golden_policy):
    """The golden policy with frames sent ahead (on the CPU), as the fast path's runtime does."""
    uploads = FrameUploads(torch.device("cpu"))
    golden_policy.runtime.uploads = uploads
    yield golden_policy, uploads
    golden_policy.runtime.uploads = None


@pytest.mark.parametrize("layout", ["hwc", "chw", "mixed_layouts", "flipped", "absent_camera"])
def test_uploaded_frames_give_the_launchs_model_inputs(uploading, layout):
    policy, uploads = uploading
    pre = policy.preprocessor
    for size in (1, 3):
        host = [policy.request(_observation(policy, layout, i), seed=i) for i in range(size)]
        ahead = [policy.request(_observation(policy, layout, i), seed=i) for i in range(size)]
        for request in host:
            policy.prepare(request, upload=False)
        sent = uploads.uploads
        for request in ahead:
            policy.prepare(request)
        assert uploads.uploads == sent + size
        assert all(r.prepared.images is None and r.prepared.upload is not None for r in ahead)  # no host stack
        host_inputs, host_noise, _ = pre.collate(host)
        ahead_inputs, ahead_noise, _ = pre.collate(ahead)
        assert torch.equal(ahead_noise, host_noise)
        host_buffers, ahead_buffers = _buffers(policy, host_inputs), _buffers(policy, ahead_inputs)
        for name, buffer in host_buffers.items():
            assert torch.equal(ahead_buffers[name], buffer), name


def test_frames_to_resize_keep_the_host_path(uploading):
    policy, uploads = uploading
    pre = policy.preprocessor
    deferred, pre.defer_resize = pre.defer_resize, True
    try:
        sent = uploads.uploads
        request = policy.request(_observation(policy, "other_size", 0), seed=0)
        prepared = policy.prepare(request)
        assert uploads.uploads == sent and prepared.upload is None and prepared.images is not None
        assert prepared.pending  # resized where the batch runs, from the host's raw frame
    finally:
        pre.defer_resize = deferred


def test_a_batch_mixing_uploaded_and_host_frames_runs_from_the_host(uploading):
    """Float frames (already in [0, 1]) are never uploaded; in a batch with uploaded ones every item's images
    are converted on the host, as for any batch of bytes and floats."""
    policy, uploads = uploading
    pre = policy.preprocessor
    floats = _observation(policy, "hwc", 1)
    floats["images"] = {cam: f.astype(np.float32) / 255.0 for cam, f in floats["images"].items()}
    ahead = [policy.request(_observation(policy, "hwc", 0), seed=0), policy.request(floats, seed=1)]
    host = [policy.request(_observation(policy, "hwc", 0), seed=0), policy.request(floats, seed=1)]
    for request in ahead:
        policy.prepare(request)
    for request in host:
        policy.prepare(request, upload=False)
    assert ahead[0].prepared.upload is not None and ahead[1].prepared.upload is None
    ahead_inputs, _, _ = pre.collate(ahead)
    host_inputs, _, _ = pre.collate(host)
    assert ahead_inputs.images.dtype == torch.float32 and torch.equal(ahead_inputs.images, host_inputs.images)


def test_a_rehearsal_uploads_nothing(uploading):
    """Keep-warm prepares a copy of the last frame that never runs (Service.rehearse_request): no upload."""
    from vlaserve.server.service import ServerSettings, Service

    policy, uploads = uploading
    service = Service(policy, ServerSettings())
    sent = uploads.uploads
    service.rehearse_request(policy.request(_observation(policy, "hwc", 0)))
    assert uploads.uploads == sent


def test_served_actions_are_the_same_with_frames_sent_ahead(uploading):
    policy, _ = uploading
    observation = _observation(policy, "absent_camera", 5)
    ahead = policy.request(observation, seed=3)
    policy.prepare(ahead)
    assert ahead.prepared.upload is not None
    host = policy.request(observation, seed=3)
    policy.prepare(host, upload=False)
    (got,), (expected,) = policy.launch([ahead]).finish(), policy.launch([host]).finish()
    assert np.array_equal(got.actions, expected.actions)


def test_a_failed_upload_fails_its_batch_with_the_error():
    """No silent fallback: an upload that raised raises again where the batch collects its frames."""
    uploads = FrameUploads(torch.device("cpu"))
    upload = uploads.submit([torch.zeros(3, 224, 224, dtype=torch.uint8), torch.zeros(3, 100, 224, dtype=torch.uint8)])
    with pytest.raises(RuntimeError):
        upload.frames()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")
def test_on_a_gpu_the_launch_waits_for_the_uploads_copies(golden_policy):
    """The uploads' stream held up by work queued before the copies: the serving stream, which collates and
    converts the frames, must wait for them (without `Upload.frames`' wait it would read the block before the
    copies land: uninitialized memory, not the frames)."""
    policy = golden_policy
    uploads = FrameUploads(torch.device("cuda"))
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(uploads._stream):  # ~tens of ms of work ahead of the copies on the uploads' stream
        for _ in range(20):
            busy = busy @ busy / 4096
    requests = [policy.request(_observation(policy, "hwc", i), seed=i) for i in range(2)]
    for request in requests:
        policy.preprocessor.prepare(request, uploads.submit)
    inputs, _, _ = policy.preprocessor.collate(requests)
    buffers = BufferSpec.of(policy.config, 2, torch.float32, inputs.tokens.shape[1]).allocate("cuda")
    into_buffers(inputs, buffers)
    host = [policy.request(_observation(policy, "hwc", i), seed=i) for i in range(2)]
    host_inputs, _, _ = policy.preprocessor.collate(host)
    expected = BufferSpec.of(policy.config, 2, torch.float32, host_inputs.tokens.shape[1]).allocate("cuda")
    into_buffers(host_inputs, expected)
    assert torch.equal(buffers["images"].cpu(), expected["images"].cpu())


def test_the_option_is_refused_where_it_cannot_work(golden):
    """Asked for with the prefix cache (whose keys hash each request's frames on the host) or off the CUDA
    fast path (the CPU's eager model), it is an error at start-up, not an option silently ignored."""
    from vlaserve.config import RuntimeConfig
    from vlaserve.errors import ConfigError
    from vlaserve.family import load_policy_config
    from vlaserve.runtime.runner import Runtime

    with pytest.raises(ConfigError, match="upload_frames_ahead does not combine with prefix_cache"):
        RuntimeConfig(upload_frames_ahead=True, prefix_cache=4)
    config = load_policy_config(golden / "checkpoint")
    with pytest.raises(ConfigError, match="upload_frames_ahead runs on the CUDA fast path only"):
        Runtime(None, config, RuntimeConfig(device="cpu", upload_frames_ahead=True), torch.device("cpu"),
                torch.float32, "r")


def test_serve_takes_the_flag_and_the_config_key(tmp_path):
    from vlaserve.options import serve_options

    assert serve_options({})["runtime"].upload_frames_ahead is False
    assert serve_options({"upload_frames_ahead": True})["runtime"].upload_frames_ahead is True
    config = tmp_path / "serve.json"
    config.write_text('{"upload_frames_ahead": true}')
    assert serve_options({"config": str(config)})["runtime"].upload_frames_ahead is True


def test_a_backlog_never_holds_more_than_max_held_requests_frames_on_the_device(golden_policy):
    """Past `max_held` frames held (uploaded and not yet dropped with their request), a request's frames
    take the launch's way; once requests are done with, uploads resume."""
    import gc

    policy = golden_policy
    uploads = FrameUploads(torch.device("cpu"), max_held=2)
    requests = [policy.request(_observation(policy, "hwc", i), seed=i) for i in range(3)]
    for request in requests:
        policy.preprocessor.prepare(request, uploads.submit)
    assert [r.prepared.upload is not None for r in requests] == [True, True, False]
    assert requests[2].prepared.images is not None  # stacked on the host, as without uploads
    assert uploads.stats() == {"uploads": 2, "held": 2, "declined": 1}
    inputs, _, _ = policy.preprocessor.collate(requests)  # a mixed batch: from the host, every item
    assert inputs.images.shape[0] == 3
    del requests, inputs
    gc.collect()
    assert uploads.stats()["held"] == 0
    again = policy.request(_observation(policy, "hwc", 9), seed=9)
    assert policy.preprocessor.prepare(again, uploads.submit).upload is not None
