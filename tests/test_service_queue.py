"""How the server queues prepared requests: a lone request (a robot's frame) is queued by the worker
thread that prepared it, without a hop back through the event loop; several go back to the loop
and are queued there as one group (so they fill batches together)."""

import asyncio
import threading

import numpy as np
import pytest

from vlaserve.server.schema import ApiError
from vlaserve.server.service import ServerSettings, Service
from vlaserve.types import Observation, Request


def observation(golden_policy, seed: int, state_dim: int | None = None) -> Request:
    rng = np.random.default_rng(seed)
    images = {cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in golden_policy.config.cameras}
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


def test_a_lone_request_is_queued_by_its_worker(service, golden_policy):
    result = asyncio.run(service.infer(observation(golden_policy, 0), in_request_body=False))
    [(thread, size)] = service.queued_from
    assert thread.startswith("vlaserve-work") and size == 1
    assert result.actions.shape == (golden_policy.config.action_horizon, golden_policy.config.action_dim)
    assert {"prepare_ms", "queue_ms", "run_ms", "handback_ms"} <= set(result.timings)


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
