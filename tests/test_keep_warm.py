"""Keep-warm (server/warm.py, `--keep-warm`): a lone robot's host path rehearsed on the event loop shortly
before its batch is predicted to end. What it must never do is change a thing: answers, the global random
generator, the metrics. When it runs is the batcher's device clock's prediction; one is pending at most."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from openpi_client import msgpack_numpy

from vlaserve.batcher import DeviceClock
from vlaserve.server import ServerSettings, create_app
from vlaserve.server.openpi import rehearse
from vlaserve.server.service import Service
from vlaserve.server import warm as warm_module
from vlaserve.server.warm import LEAD_S, KeepWarm

SHAPE = (1, 10, True)


def observation(seed: int, with_noise: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    obs = {f"observation/{cam}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
           for cam in ("image", "wrist_image")}
    obs.update({"observation/state": rng.standard_normal(14).astype(np.float32), "prompt": "pick up the red block"})
    if with_noise:
        obs["noise"] = rng.standard_normal((50, 32)).astype(np.float32)
    return obs


def clock_with(device_ms: float) -> DeviceClock:
    clock = DeviceClock()
    clock.launched(SHAPE, 0.0, 0.0, asynchronous=True)
    clock.finished(SHAPE, device_ms)
    return clock


def openpi_frame(obs: dict) -> bytes:
    return msgpack_numpy.packb(obs)


def v1_body(obs: dict) -> bytes:
    observation = {"images": {k.removeprefix("observation/"): v for k, v in obs.items() if "image" in k},
                   "state": obs["observation/state"], "noise": obs["noise"]}
    return msgpack_numpy.packb({"input": {"task": obs["prompt"], "observation": observation}})


def serve(policy, settings: ServerSettings, route: str, frames: list[dict],
          stats_key: str = "keep_warm") -> tuple[list[np.ndarray], list[dict]]:
    """Each frame's actions from a lone client on `route` of a server with `settings`, and the metadata's
    `stats_key` after each answer."""
    with TestClient(create_app(policy, settings)) as client:
        answers, stats = [], []
        if route == "http":
            for obs in frames:
                response = client.post("/v1/actions/generations", content=v1_body(obs),
                                       headers={"Content-Type": "application/msgpack"})
                answers.append(msgpack_numpy.unpackb(response.content)["data"][0]["action"]["values"])
                stats.append(client.get("/v1/actions/metadata").json()[stats_key])
            return answers, stats
        path, encode = {"openpi": ("/openpi/policy", openpi_frame), "realtime": ("/v1/actions/realtime", v1_body)}[route]
        with client.websocket_connect(path) as ws:
            ws.receive_bytes()
            for obs in frames:
                ws.send_bytes(encode(obs))
                reply = msgpack_numpy.unpackb(ws.receive_bytes())
                answers.append(reply["actions"] if route == "openpi" else reply["data"][0]["action"]["values"])
                stats.append(client.get("/v1/actions/metadata").json()[stats_key])
        return answers, stats


@pytest.mark.parametrize("route", ["openpi", "realtime", "http"])
def test_a_lone_robots_answers_are_the_same_with_keep_warm_and_its_frames_are_rehearsed(golden_policy, route,
                                                                                        monkeypatch):
    # Due at once (a lead longer than any device time), so each runs before its answer: on this CPU one
    # due shortly before the predicted end may come after the answer, which drops it.
    monkeypatch.setattr(warm_module, "LEAD_S", 60.0)
    frames = [observation(i) for i in range(3)]
    plain, plain_stats = serve(golden_policy, ServerSettings(keep_warm=False), route, frames)
    warm, warm_stats = serve(golden_policy, ServerSettings(keep_warm=True), route, frames)
    assert plain_stats == [{"enabled": False, "rehearsals": 0, "pending": False}] * len(frames)
    # The first frame's batch shape has no device time yet: every later frame is rehearsed, before its answer.
    assert warm_stats == [{"enabled": True, "rehearsals": i, "pending": False} for i in range(len(frames))]
    for a, b in zip(plain, warm):
        assert np.array_equal(a, b)


def test_a_rehearsal_due_after_its_answer_is_dropped(golden_policy, monkeypatch):
    monkeypatch.setattr(warm_module, "LEAD_S", -60.0)  # each one due a minute after its batch's predicted end
    _, stats = serve(golden_policy, ServerSettings(keep_warm=True), "openpi", [observation(i) for i in range(3)])
    assert stats == [{"enabled": True, "rehearsals": 0, "pending": False}] * 3


def test_a_rehearsal_draws_no_noise_and_counts_nothing(golden_policy, monkeypatch):
    """...and it collates its request as a batch of one (what a direct launch runs on the event loop next),
    launching nothing."""
    service = Service(golden_policy, ServerSettings())
    obs = observation(5)
    collated, collate = [], golden_policy.preprocessor.collate
    monkeypatch.setattr(golden_policy.preprocessor, "collate", lambda requests: collated.append(requests) or collate(requests))
    monkeypatch.setattr(golden_policy.runtime, "launch", lambda *a, **k: pytest.fail("a rehearsal launched"))
    for rehearsal in (functools.partial(rehearse, openpi_frame(obs), service),
                      functools.partial(service.rehearse_generation, v1_body(obs))):
        rng_before = torch.random.get_rng_state()
        metrics_before = [(s.name, s.labels, s.value) for m in service.metrics.registry.collect() for s in m.samples]
        assert rehearsal() is True
        assert torch.equal(torch.random.get_rng_state(), rng_before)
        assert [(s.name, s.labels, s.value) for m in service.metrics.registry.collect()
                for s in m.samples] == metrics_before
        assert len(collated[-1]) == 1 and collated[-1][0].prepared is not None
    assert len(collated) == 2


def test_a_frame_decoded_off_the_event_loop_is_not_rehearsed(golden_policy):
    service = Service(golden_policy, ServerSettings())
    obs = observation(6)
    # Pixels as nested lists: more maps and lists than decode_in_place takes (bodies.INLINE_MSGPACK_CONTAINERS).
    nested = msgpack_numpy.packb({**obs, "observation/image": obs["observation/image"].tolist()})
    assert rehearse(nested, service) is False


def test_a_rehearsal_is_due_lead_before_the_predicted_end_and_one_is_pending_at_most():
    async def scenario():
        loop, ran = asyncio.get_running_loop(), []
        warm, clock = KeepWarm(enabled=True), clock_with(device_ms=30.0)
        scheduled_at = loop.time()
        warm.schedule(lambda: ran.append("first") or True, clock, SHAPE, time.perf_counter())
        when = warm._pending.when()
        # Due launch + device - LEAD_S after scheduling; the 5 ms allows for the loop clock read before the
        # call (microseconds; a loaded 2-core CI machine), far below the 28 ms being checked.
        assert when - scheduled_at == pytest.approx(clock.launch_s + 0.030 - LEAD_S, abs=0.005)
        now = time.perf_counter()
        warm.schedule(lambda: ran.append("second") or True, clock, SHAPE, now)  # the next request's replaces it
        warm.schedule(lambda: ran.append("unknown shape") or True, clock, (2, 10, True), now)  # no device time yet: none
        await asyncio.sleep(0.1)
        assert ran == ["second"] and warm.rehearsals == 1
        off = KeepWarm(enabled=False)
        off.schedule(lambda: ran.append("off") or True, clock, SHAPE, time.perf_counter())
        await asyncio.sleep(0.05)
        assert ran == ["second"] and off._pending is None
    asyncio.run(scenario())


def test_a_rehearsal_is_due_lead_before_its_own_batch_ends_when_a_batch_is_on_the_device():
    """With a batch on the device when the request is queued: launched after it was queued (--direct-launch
    launches it on the event loop; a quick launch thread may too), that batch is its own and ends at the
    clock's prediction (timed from now, as for an idle device, the rehearsal ran late enough to delay the
    answer's hand-back: H200, runs 200-202); launched before, it is another's, and the request runs behind it."""
    async def scenario(launched_after_queued: bool):
        loop = asyncio.get_running_loop()
        warm, clock = KeepWarm(enabled=True), clock_with(device_ms=30.0)
        clock.launch_s = 0.010  # a slow launch: a schedule as for an idle device would be 10 ms off
        now = time.perf_counter()
        queued_at = now - (0.013 if launched_after_queued else 0.001)
        clock.launched(SHAPE, now - 0.012, now - 0.002, asynchronous=True)  # began 12 ms ago, enqueued 2 ms ago
        scheduled_at = loop.time()
        warm.schedule(lambda: True, clock, SHAPE, queued_at)
        when = warm._pending.when()
        warm.cancel()
        return when - scheduled_at, clock.predicted_end() - now

    own, end_in = asyncio.run(scenario(True))
    behind, _ = asyncio.run(scenario(False))
    # Enqueued 2 ms ago, 30 ms of device time: the clock computes its end from the same `now` (float rounding only).
    assert end_in == pytest.approx(0.028, abs=0.001)
    # (5 ms: the loop clock read before the call, on a loaded 2-core CI machine; far below the 10-30 ms told apart)
    assert own == pytest.approx(end_in - LEAD_S, abs=0.005)
    assert behind == pytest.approx(end_in + 0.030 - LEAD_S, abs=0.005)


def test_a_failing_rehearsal_is_logged_and_turns_keep_warm_off(caplog):
    async def scenario():
        warm, clock, ran = KeepWarm(enabled=True), clock_with(device_ms=3.0), []

        def broken():
            ran.append(1)
            raise RuntimeError("a rehearsal bug")
        warm.schedule(broken, clock, SHAPE, time.perf_counter())
        await asyncio.sleep(0.05)
        warm.schedule(broken, clock, SHAPE, time.perf_counter())
        await asyncio.sleep(0.05)
        return warm, ran
    with caplog.at_level(logging.ERROR, logger="vlaserve.server.warm"):
        warm, ran = asyncio.run(scenario())
    assert ran == [1] and warm.stats() == {"enabled": False, "rehearsals": 0, "pending": False}
    assert [r.message for r in caplog.records] == ["keep-warm: a rehearsal failed; keep-warm is off from now on"]
