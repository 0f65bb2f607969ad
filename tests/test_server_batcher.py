"""The Batcher in front of the real golden Policy (float32, CPU), without a server.

A gate holds the worker inside its first batch while more requests queue up, so the batches that
follow are formed from a known queue rather than from timing luck.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from vlaserve.batcher import Batcher, BatcherClosed

# Batched vs single inference of the same inputs differ only in float32 reduction order
# (measured up to 7e-7 on these actions); 1e-4 is 10x below the smallest bug-sized change (1.2e-3).
ATOL = 1e-4


def observation(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": {"base_0_rgb": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
            "state": rng.normal(size=14).astype(np.float32), "task": f"task {seed}"}


class GatedPolicy:
    """Delegates to the real policy; records each batch; the first batch waits for `gate`;
    batches containing a task listed in `fail_on` raise."""

    def __init__(self, policy, fail_on=()):
        self.policy = policy
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[tuple[list[str], int | None]] = []
        self.fail_on = set(fail_on)

    def launch(self, requests):
        tasks = [r.observation.task for r in requests]
        self.batches.append((tasks, requests[0].num_steps))
        if len(self.batches) == 1:
            self.entered.set()
            self.gate.wait()
        if self.fail_on & set(tasks):
            raise RuntimeError("injected failure")
        return self.policy.launch(requests)


def submit(batcher: Batcher, policy, obs: dict, seed=None, num_steps=None):
    return batcher.submit(policy.request(obs, seed=seed, num_steps=num_steps))


async def _submit_while_gated(batcher: Batcher, gated: GatedPolicy, requests: list[dict]):
    """Submits requests[0], waits until the worker holds it, queues the rest, opens the gate."""
    loop = asyncio.get_running_loop()
    first = asyncio.ensure_future(submit(batcher, gated.policy, **requests[0]))
    await loop.run_in_executor(None, gated.entered.wait)
    rest = [asyncio.ensure_future(submit(batcher, gated.policy, **r)) for r in requests[1:]]
    await asyncio.sleep(0.05)  # let every submit reach the queue
    gated.gate.set()
    return await asyncio.gather(first, *rest, return_exceptions=True)


def test_batches_group_equal_steps_respect_the_size_limit_and_match_single_inference(golden_policy):
    gated = GatedPolicy(golden_policy)
    sizes = []
    batcher = Batcher(gated, max_batch_size=3, batch_delay_ms=1.0, on_batch=sizes.append)
    steps = [1, 2, 1, 2, 1, 1, 2, 1]
    requests = [{"obs": observation(i), "seed": i, "num_steps": s} for i, s in enumerate(steps)]
    try:
        results = asyncio.run(_submit_while_gated(batcher, gated, requests))
    finally:
        batcher.close()

    for request, result in zip(requests, results):
        expected = golden_policy.infer(request["obs"], seed=request["seed"], num_steps=request["num_steps"])
        np.testing.assert_allclose(result.actions, expected.actions, rtol=0, atol=ATOL)
        assert result.timings["queue_ms"] >= 0
    by_task = {r["obs"]["task"]: r["num_steps"] for r in requests}
    for tasks, num_steps in gated.batches:
        assert {by_task[t] for t in tasks} == {num_steps}  # one step count per batch
    assert sizes == [len(tasks) for tasks, _ in gated.batches]
    assert max(sizes) == 3 and sum(sizes) == len(requests)
    # After the gated single: 4 more 1-step requests (3 + 1) and 3 2-step ones (3).
    assert sorted(sizes[1:]) == [1, 3, 3]


def test_a_failing_batch_fails_only_its_bad_request_and_the_worker_survives(golden_policy):
    gated = GatedPolicy(golden_policy, fail_on={"task 2"})
    batcher = Batcher(gated, max_batch_size=8, batch_delay_ms=1.0)
    requests = [{"obs": observation(i), "seed": i, "num_steps": 1} for i in range(4)]
    try:
        results = asyncio.run(_submit_while_gated(batcher, gated, requests))
        assert not isinstance(results[0], Exception)
        # Tasks 1-3 shared a batch that failed; each was re-run alone, so only task 2 failed.
        assert [t for t, _ in gated.batches[1:]] == [["task 1", "task 2", "task 3"], ["task 1"], ["task 2"], ["task 3"]]
        assert str(results[2]) == "injected failure"
        for i in (1, 3):
            expected = golden_policy.infer(requests[i]["obs"], seed=i, num_steps=1)
            np.testing.assert_allclose(results[i].actions, expected.actions, rtol=0, atol=ATOL)
        after = asyncio.run(submit(batcher, golden_policy, observation(9), seed=9, num_steps=1))
        assert after.actions.shape == (50, 14)
    finally:
        batcher.close()


def test_close_drains_queued_requests_then_refuses_new_ones(golden_policy):
    gated = GatedPolicy(golden_policy)
    batcher = Batcher(gated, max_batch_size=2, batch_delay_ms=1.0)

    async def scenario():
        loop = asyncio.get_running_loop()
        futures = [asyncio.ensure_future(submit(batcher, golden_policy, observation(i), seed=i, num_steps=1))
                   for i in range(5)]
        await loop.run_in_executor(None, gated.entered.wait)
        await asyncio.sleep(0.05)
        closing = loop.run_in_executor(None, batcher.close)  # blocks until drained
        await asyncio.sleep(0.05)
        with pytest.raises(BatcherClosed):
            await submit(batcher, golden_policy, observation(9))
        gated.gate.set()
        await closing
        return await asyncio.gather(*futures)

    results = asyncio.run(scenario())
    assert len(results) == 5 and all(r.actions.shape == (50, 14) for r in results)
    assert sum(len(tasks) for tasks, _ in gated.batches) == 5


def test_continuous_batching_runs_a_lone_request_at_once_and_queued_ones_together(golden_policy):
    """Default batch delay 0: the first request starts alone (no waiting for company); the two that
    arrive while it runs form the next batch the moment it finishes."""
    gated = GatedPolicy(golden_policy)
    batcher = Batcher(gated, max_batch_size=8)
    requests = [{"obs": observation(i), "seed": i, "num_steps": 1} for i in range(3)]
    try:
        results = asyncio.run(_submit_while_gated(batcher, gated, requests))
    finally:
        batcher.close()
    assert [tasks for tasks, _ in gated.batches] == [["task 0"], ["task 1", "task 2"]]
    for request, result in zip(requests, results):
        expected = golden_policy.infer(request["obs"], seed=request["seed"], num_steps=1)
        np.testing.assert_allclose(result.actions, expected.actions, rtol=0, atol=ATOL)


def test_a_request_naming_the_default_step_count_batches_with_one_that_names_none(golden_policy):
    """The step count is resolved when a request is built, so the batcher sees the checkpoint's
    default on both (it groups by step count; comparing 10 with "unset" would split them)."""
    default = golden_policy.config.num_inference_steps
    gated = GatedPolicy(golden_policy)
    batcher = Batcher(gated, max_batch_size=8)
    requests = [{"obs": observation(0), "seed": 0}, {"obs": observation(1), "seed": 1, "num_steps": default},
                {"obs": observation(2), "seed": 2}]
    try:
        results = asyncio.run(_submit_while_gated(batcher, gated, requests))
    finally:
        batcher.close()
    assert gated.batches == [(["task 0"], default), (["task 1", "task 2"], default)]
    assert [r.timings["batch_size"] for r in results] == [1, 2, 2]


def test_only_clients_due_back_are_waited_for():
    """A client that came back 1 ms after each reply is expected again right after its next reply;
    one that is long overdue (idle, or gone) is not."""
    from vlaserve.batcher import COMPANY_WAIT_S, ReturningClients

    clients = ReturningClients()
    clients.answered(["robot"], 0.0)
    clients.arrived("robot", 0.001)  # think time 1 ms
    clients.answered(["robot"], 1.0)
    assert clients.due(1.0) == 1  # due back at 1.001, within the wait
    assert clients.due(1.0 + 10 * COMPANY_WAIT_S) == 0  # overdue: not about to send
    clients.arrived("robot", 1.001)
    assert clients.due(1.001) == 0  # back: nothing to wait for
    clients.answered([None, "new"], 2.0)  # untracked and never-measured clients are never waited for
    assert clients.due(2.0) == 0


def test_a_paced_client_is_never_waited_for():
    """A robot at 4 Hz comes back ~230 ms after each reply: even when that return is predicted right
    now it is not waited for (its latency moves the prediction by more than the wait; bench_fleet run
    177), while a back-to-back client with the same prediction is."""
    from vlaserve.batcher import BACK_TO_BACK_S, ReturningClients

    clients = ReturningClients()
    clients.answered(["paced", "quick"], 0.0)
    clients.arrived("paced", 0.230)
    clients.arrived("quick", BACK_TO_BACK_S)  # the longest think time still back to back
    clients.answered(["paced"], 1.0)
    clients.answered(["quick"], 1.22)
    assert clients.due(1.23) == 1  # both predicted back at 1.23: only the back-to-back one counts
    clients.running(["paced"])
    assert clients.due(1.23, running_ends=1.0) == 1


def test_a_client_in_the_running_batch_is_due_when_its_answer_and_think_time_fit_the_wait():
    """Two robots back to back: robot a's request is on the device, robot b's batch is being formed
    just before a's ends. a (think time 4 ms) is waited for when its answer is predicted within
    COMPANY_WAIT_S - 4 ms, not when it is further off, nor when the end is not predictable."""
    from vlaserve.batcher import COMPANY_WAIT_S, ReturningClients

    assert COMPANY_WAIT_S == 0.005  # the numbers below are chosen around it
    clients = ReturningClients()
    clients.answered(["a"], 0.0)
    clients.arrived("a", 0.004)
    clients.running(["a"])
    assert clients.due(1.0, running_ends=1.0005) == 1  # back at ~1.0045
    assert clients.due(1.0, running_ends=1.01) == 0  # back at ~1.014: past the wait
    assert clients.due(1.0) == 0  # no prediction: not waited for
    clients.answered(["a"], 1.001)  # answered: counted once, as an answered client
    assert clients.due(1.001, running_ends=1.002) == 1


class AsyncDevice:
    """A policy on a pretend asynchronous device: `launch` returns at once; a batch's `finish`
    blocks until the test releases it (batches launched while `holding` are held). Each answer's
    actions are its request's seed, and every batch reports DEVICE_MS of device time."""

    DEVICE_MS = 500.0

    def __init__(self):
        self.batches: list[AsyncBatch] = []
        self.lock = threading.Lock()
        self.holding = False

    def launch(self, requests):
        with self.lock:
            batch = AsyncBatch(requests, release=not self.holding)
            self.batches.append(batch)
        return batch

    def release_all(self) -> None:
        with self.lock:
            self.holding = False
            for batch in self.batches:
                batch.release.set()

    def launched(self, n: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.batches) >= n:
                    return True
            time.sleep(0.002)
        return False


class AsyncBatch:
    def __init__(self, requests, release: bool):
        self.requests, self.finished = requests, False
        self.release = threading.Event()
        if release:
            self.release.set()

    def done(self) -> bool:
        return self.release.is_set()

    def finish(self):
        from vlaserve.types import InferenceResult

        assert self.release.wait(10)
        self.finished = True
        return [InferenceResult(np.full((50, 14), r.seed, np.float32), np.zeros((50, 32), np.float32),
                                {"device_ms": AsyncDevice.DEVICE_MS}) for r in self.requests]


def test_the_next_batch_is_enqueued_while_the_device_still_runs_this_one():
    """Once batches of a size have been timed, the next batch is formed shortly before the running
    one is due to finish (its predicted end), from everything queued by then, and launched behind
    it. Nothing here depends on how fast the CI is: the running batch finishes only when the test
    releases it."""
    from vlaserve.types import Observation, Request

    device = AsyncDevice()
    batcher = Batcher(device, max_batch_size=8)

    def request(seed: int) -> Request:
        return Request(Observation({}, np.zeros(14, np.float32), f"task {seed}"), num_steps=10, seed=seed)

    async def scenario():
        loop = asyncio.get_running_loop()
        first = await batcher.submit(request(0))  # a batch of 1, timed: the clock learns its 500 ms
        device.holding = True
        running = asyncio.ensure_future(batcher.submit(request(1)))
        assert await loop.run_in_executor(None, device.launched, 2)
        queued = [asyncio.ensure_future(batcher.submit(request(s))) for s in (2, 3)]
        # Overlap: launched ~500 ms after batch 2 (its predicted end), batch 2 still unreleased.
        enqueued_behind = await loop.run_in_executor(None, device.launched, 3, 2.0)
        still_running = not device.batches[1].finished
        device.release_all()
        return first, await running, await asyncio.gather(*queued), enqueued_behind, still_running

    try:
        first, running, queued, enqueued_behind, still_running = asyncio.run(scenario())
    finally:
        device.release_all()
        batcher.close()
    assert still_running
    assert enqueued_behind
    assert [[r.seed for r in b.requests] for b in device.batches] == [[0], [1], [2, 3]]
    for seed, result in zip(range(4), [first, running, *queued]):
        assert (result.actions == seed).all()  # each answer went to its own request


def test_a_batch_that_fails_on_the_device_fails_only_its_bad_request():
    """An error that surfaces only when a batch is waited for (on the completion thread): its requests
    are re-run one by one, so the good ones get their answers and only the culprit its error."""
    from vlaserve.types import Observation, Request

    class FailingOnFinish(AsyncDevice):
        def launch(self, requests):
            batch = super().launch(requests)
            if any(r.seed == 13 for r in requests):
                batch.finish = lambda: (_ for _ in ()).throw(RuntimeError("device fault"))
            return batch

    device = FailingOnFinish()
    device.holding = True  # the first batch stays on the "device" until all three requests are queued
    batcher = Batcher(device, max_batch_size=8)

    async def scenario():
        loop = asyncio.get_running_loop()
        requests = [Request(Observation({}, np.zeros(14, np.float32), f"task {s}"), num_steps=10, seed=s)
                    for s in (1, 13, 2, 3)]
        first = asyncio.ensure_future(batcher.submit(requests[0]))
        assert await loop.run_in_executor(None, device.launched, 1)
        rest = [asyncio.ensure_future(batcher.submit(r)) for r in requests[1:]]
        await asyncio.sleep(0.05)
        device.release_all()
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        assert batcher.alive  # both threads survived the fault
        return answers

    try:
        one, bad, two, three = asyncio.run(scenario())
    finally:
        device.release_all()
        batcher.close()
    assert str(bad) == "device fault"
    for seed, result in ((1, one), (2, two), (3, three)):
        assert (result.actions == seed).all()
    assert [[r.seed for r in b.requests] for b in device.batches] == [[1], [13, 2, 3], [13], [2], [3]]


@pytest.mark.parametrize("graph_less", [{1: "off", 3: "off", 5: "off"}, {1: "traced", 3: "off", 5: "traced"}],
                         ids=["cuda_graph_false", "traced_and_cuda_graph_false"])
def test_graph_less_requests_are_batched_apart(golden_policy, graph_less):
    """runtime.cuda_graph false, or a trace asked for (which runs without graph replay): a batch holds graphed
    requests or graph-less ones, never both; only the traced results carry a trace."""
    gated = GatedPolicy(golden_policy)
    batcher = Batcher(gated, max_batch_size=8, batch_delay_ms=1.0)

    async def scenario():
        loop = asyncio.get_running_loop()
        requests = [golden_policy.request(observation(i), seed=i, num_steps=1,
                                          return_trace=graph_less.get(i) == "traced") for i in range(6)]
        for i, request in enumerate(requests):
            request.cuda_graph = graph_less.get(i) != "off"
        first = asyncio.ensure_future(batcher.submit(requests[0]))
        await loop.run_in_executor(None, gated.entered.wait)
        rest = [asyncio.ensure_future(batcher.submit(r)) for r in requests[1:]]
        await asyncio.sleep(0.05)
        gated.gate.set()
        return await asyncio.gather(first, *rest)

    try:
        results = asyncio.run(scenario())
    finally:
        batcher.close()
    batches = [[int(t.split()[1]) for t in tasks] for tasks, _ in gated.batches]
    assert sorted(sorted(b) for b in batches[1:]) == [[1, 3, 5], [2, 4]]
    for i, result in enumerate(results):
        expected = golden_policy.infer(observation(i), seed=i, num_steps=1).actions
        np.testing.assert_allclose(result.actions, expected, rtol=0, atol=ATOL)
        assert (result.trace is not None) == (graph_less.get(i) == "traced")
        if result.trace is not None:  # x before the one step, and after it
            assert result.trace.shape[0] == 2 and np.array_equal(result.trace[-1], result.model_actions)


def test_a_group_fills_batches_up_to_the_limit_in_order(golden_policy):
    """submit_many (a request of B observations): B = 7 over a limit of 3 runs as 3 + 3 + 1, in order."""
    gated = GatedPolicy(golden_policy)
    batcher = Batcher(gated, max_batch_size=3, batch_delay_ms=0.0)

    async def scenario():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(submit(batcher, golden_policy, observation(100), seed=0, num_steps=1))
        await loop.run_in_executor(None, gated.entered.wait)
        group = batcher.submit_many([golden_policy.request(observation(i), seed=i, num_steps=1) for i in range(7)])
        gated.gate.set()
        return await asyncio.gather(first, *group)

    try:
        results = asyncio.run(scenario())
    finally:
        batcher.close()
    assert [tasks for tasks, _ in gated.batches[1:]] == [[f"task {i}" for i in r] for r in ((0, 1, 2), (3, 4, 5), (6,))]
    for i, result in enumerate(results[1:]):
        expected = golden_policy.infer(observation(i), seed=i, num_steps=1).actions
        np.testing.assert_allclose(result.actions, expected, rtol=0, atol=ATOL)


def _request(seed: int, client=None):
    from vlaserve.types import Observation, Request

    request = Request(Observation({}, np.zeros(14, np.float32), f"task {seed}"), num_steps=10, seed=seed)
    request.client = client
    return request


def test_a_request_waits_for_another_client_due_back_and_they_run_as_one_batch():
    """Two robots back to back: the first of them back after a shared answer does not run alone while
    the other is due within COMPANY_WAIT_S: the launch thread waits for the other, and they run as one
    batch. Which clients are due is ReturningClients' (its think-time tests); here it says one is, so
    nothing rests on this machine's timing."""
    device = AsyncDevice()
    batcher = Batcher(device, max_batch_size=8)
    batcher.clients.due = lambda now, running_ends=None: 1

    async def scenario():
        batches_before = len(device.batches)
        # Both submitted in one turn of the loop: b reaches the queue within the launch thread's company wait.
        await asyncio.gather(batcher.submit(_request(100, "a")), batcher.submit(_request(101, "b")))
        return batches_before

    try:
        batches_before = asyncio.run(scenario())
    finally:
        batcher.close()
    assert [r.seed for r in device.batches[batches_before].requests] == [100, 101]


def test_closing_refuses_new_requests_and_answers_those_made_before():
    device = AsyncDevice()
    batcher = Batcher(device, max_batch_size=8)

    async def scenario():
        answer = await batcher.submit(_request(7))
        batcher.close()
        with pytest.raises(BatcherClosed):
            await batcher.submit(_request(8))
        return answer

    answer = asyncio.run(scenario())
    assert (answer.actions == 7).all()
