"""How the server prepares and queues requests: a lone request of raw frames (a robot's) is prepared
and queued on the event loop, no thread hop; a lone one with work for the host (a PNG or JPEG to
decode, a frame to resize on a CPU server) is prepared and queued by a worker thread, without a hop
back through the event loop; several are prepared on workers, go back to the loop and are queued
there as one group (so they fill batches together)."""

import io

import asyncio
import threading

import numpy as np
import pytest
from PIL import Image

from vlaserve.server.schema import ApiError
from vlaserve.server.service import ServerSettings, Service
from vlaserve.types import EncodedImage, Observation, Request


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()  # kept as an EncodedImage by the request


def observation(golden_policy, seed: int, state_dim: int | None = None, side: int = 224,
                encoded: bool = False) -> Request:
    rng = np.random.default_rng(seed)
    images = {cam: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for cam in golden_policy.config.cameras}
    if encoded:
        images = {cam: _png(pixels) for cam, pixels in images.items()}
    state = rng.uniform(-1, 1, state_dim or golden_policy.config.state_dim).astype(np.float32)
    return Request.create(Observation.create(images, state, "stack the cups"), seed=seed, num_steps=1, default_steps=10)


@pytest.fixture
def service(golden_policy):
    service = Service(golden_policy, ServerSettings(decode_processes=1))
    service.start()
    queued_from = []
    submit_many = service.batcher.submit_many

    def recording(requests, loop=None):
        queued_from.append((threading.current_thread().name, len(requests)))
        return submit_many(requests, loop)

    service.batcher.submit_many = recording
    service.queued_from = queued_from
    yield service
    service.stop()


def _infer_one(service, request):
    async def run():
        return threading.current_thread().name, await service.infer(request, in_request_body=False)

    return asyncio.run(run())


def test_a_lone_request_of_raw_frames_is_prepared_and_queued_on_the_event_loop(service, golden_policy):
    assert golden_policy.config.image_resolution[0] == 224  # the frames below need no resize
    loop_thread, result = _infer_one(service, observation(golden_policy, 0))
    assert service.queued_from == [(loop_thread, 1)]
    assert result.actions.shape == (golden_policy.config.action_horizon, golden_policy.config.action_dim)
    assert {"prepare_ms", "queue_ms", "run_ms", "handback_ms"} <= set(result.timings)


@pytest.mark.parametrize("kind", ["png", "frames resized on the CPU"])
def test_a_lone_request_with_host_work_is_prepared_and_queued_by_a_worker(service, golden_policy, kind):
    request = (observation(golden_policy, 0, encoded=True) if kind == "png"
               else observation(golden_policy, 0, side=160))  # a CPU policy resizes on the host
    assert not golden_policy.is_light(request)
    _, result = _infer_one(service, request)
    [(thread, size)] = service.queued_from
    assert thread.startswith("vlaserve-work") and size == 1
    assert result.actions.shape == (golden_policy.config.action_horizon, golden_policy.config.action_dim)


def test_lightness_is_raw_bytes_at_the_models_size_or_resized_on_the_device(golden_policy):
    assert golden_policy.is_light(observation(golden_policy, 0))
    png = observation(golden_policy, 0, encoded=True)
    assert all(isinstance(image, EncodedImage) for image in png.observation.images.values())
    assert not golden_policy.is_light(png)
    assert not golden_policy.is_light(observation(golden_policy, 0, side=160))
    float_frames = observation(golden_policy, 0)
    float_frames.observation.images.update({c: (i / 255).astype(np.float32)
                                            for c, i in float_frames.observation.images.items()})
    assert not golden_policy.is_light(float_frames)  # float frames are range-checked and scaled on the host
    preprocessor = golden_policy.preprocessor
    preprocessor.defer_resize = True  # as on CUDA: a frame of another size is resized on the device
    try:
        assert golden_policy.is_light(observation(golden_policy, 0, side=160))
    finally:
        preprocessor.defer_resize = False


def test_several_requests_are_queued_as_one_group_from_the_event_loop(service, golden_policy):
    async def run():
        return threading.current_thread().name, await service.infer_many(
            [observation(golden_policy, i) for i in range(3)], in_request_body=True)

    loop_thread, results = asyncio.run(run())
    assert service.queued_from == [(loop_thread, 3)] and len(results) == 3


def test_a_lone_invalid_request_is_refused_and_never_queued(service, golden_policy):
    with pytest.raises(ApiError) as error:
        asyncio.run(service.infer(observation(golden_policy, 0, state_dim=3), in_request_body=False))
    assert error.value.status == 422 and error.value.field == "state"
    assert service.queued_from == []


def test_a_lone_request_after_shutdown_gets_503(service, golden_policy):
    service.batcher.close()
    with pytest.raises(ApiError) as error:
        asyncio.run(service.infer(observation(golden_policy, 0), in_request_body=False))
    assert error.value.status == 503 and error.value.type == "shutting_down"
