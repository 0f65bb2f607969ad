"""Dynamic batching in front of a Policy: Requests in, InferenceResults out.

The batcher is the layer above the policy: it decides which requests run together and calls
`Policy.launch` on each batch; the policy knows nothing of it (the server, or a caller that wants
batching, creates one over a policy).

Two threads own the policy (and so the device); asyncio handlers only enqueue and await. The
launch thread forms batches and enqueues them on the device; the completion thread waits for each,
post-processes it and hands its results back. Continuous batching: when the device is idle a request
runs at once; requests that arrive while a batch runs wait in the queue, and when it is about to
finish everything queued (up to the batch limit, one step count) is enqueued behind it, so the
device goes from one batch to the next without waiting for the host: the next batch's collation and
host-to-device copies overlap the end of this one, and this one's results go back while the next
runs. A batch of 8 costs far less than 8 calls. `batch_delay_ms` (default 0) is an optional extra
wait for company after the first request of a batch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidInput, NonFiniteActions
from .policy import Policy
from .types import Request

log = logging.getLogger(__name__)


class BatcherClosed(RuntimeError):
    """The batcher is draining or stopped and takes no new requests."""


@dataclass
class _Pending:
    request: Request
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)

    @property
    def key(self) -> tuple:
        """Requests batch together only with the same key: one step count, graphs or none (Request.graphs)."""
        return self.request.num_steps, self.request.graphs


_STOP = object()
# The next batch is formed this long, plus the host's measured time to enqueue one, before the
# running batch is predicted to finish: late enough that it takes everything queued by then, early
# enough that its host work is done when the device frees.
LAUNCH_MARGIN_S = 0.0005
# How long a batch may wait for a client that is about to send its next request (its reply just went
# out and it usually answers within its think time): without it, two robots back to back ping-pong at
# batch size 1, each waiting out the other's whole batch.
COMPANY_WAIT_S = 0.005
# Only clients that send again this soon after a reply (back to back: ~4-5 ms in bench_fleet's levels of
# 2 and 4 robots: the reply's hand-back and sending, the network and the client, the next frame's
# decoding and preparing) are waited for. A paced robot's think time is its period minus its
# latency (a 4 Hz robot: ~230 ms), and its return predicted from it is off by however much its
# latency moved: waiting for it delayed whole batches for robots that did not come, which turned
# 16 robots at 4 Hz from mostly batches of 1 into batches of 2-4 (bench_fleet).
BACK_TO_BACK_S = 0.010


class ReturningClients:
    """Each client's think time (reply sent -> next request), smoothed, and which clients sending back
    to back (think time at most BACK_TO_BACK_S) are due back within COMPANY_WAIT_S: answered ones, and
    ones in the batch on the device whose answer is predicted soon enough (two robots back to back:
    the next batch is formed just before the running one ends, and waiting ~its think time for the
    other robot turns two batches of 1 into one of 2). Clients are connections (Request.client); None
    is not tracked."""

    FORGET_S = 10.0  # a client silent this long has gone away

    def __init__(self):
        self._lock = threading.Lock()
        self._answered: dict = {}  # client -> when its last reply went out (not back since)
        self._think: dict = {}  # client -> smoothed think time, seconds
        self._running: set = set()  # clients whose request is in a batch on the device

    def running(self, clients) -> None:
        with self._lock:
            self._running.update(c for c in clients if c is not None)

    def arrived(self, client, now: float) -> None:
        if client is None:
            return
        with self._lock:
            answered = self._answered.pop(client, None)
            if answered is not None:
                think = now - answered
                previous = self._think.get(client)
                self._think[client] = think if previous is None else 0.5 * previous + 0.5 * think

    def answered(self, clients, now: float) -> None:
        with self._lock:
            for client in clients:
                if client is not None:
                    self._answered[client] = now
                    self._running.discard(client)

    def due(self, now: float, running_ends: float | None = None) -> int:
        """Back-to-back clients not back yet whose think time says they return within COMPANY_WAIT_S
        of now (one already overdue by more than that is idle, or gone, not about to send); with
        `running_ends` (when the batch on the device is predicted to be answered), also its
        back-to-back clients whose think time brings them back by then + COMPANY_WAIT_S."""
        with self._lock:
            for client in [c for c, t in self._answered.items() if now - t > self.FORGET_S]:
                del self._answered[client]
                self._think.pop(client, None)
            quick = {c: t for c, t in self._think.items() if t <= BACK_TO_BACK_S}
            due = sum(1 for c, t in self._answered.items() if c in quick and abs(t + quick[c] - now) <= COMPANY_WAIT_S)
            if running_ends is not None:
                due += sum(1 for c in self._running if c in quick and running_ends + quick[c] - now <= COMPANY_WAIT_S)
            return due


class DeviceClock:
    """When the device will be done with everything launched, predicted from the device time of
    earlier batches of the same size and step count (a shape never seen yet: not predicted, so the
    next batch waits for it to finish), and how long the host takes to launch a batch."""

    def __init__(self):
        self._cond = threading.Condition()
        self._in_flight = 0
        self._end: float | None = 0.0  # perf_counter seconds; None: not predictable
        self._device_s: dict[tuple, float] = {}
        self.launch_s = 0.0  # smoothed host time from forming a batch to its launch returning

    def launched(self, shape: tuple, started: float, now: float, asynchronous: bool) -> None:
        """A batch was enqueued between `started` and `now`. A launch that returned with its work
        done (the eager model runs synchronously) leaves nothing to overlap: the next batch waits
        for its answers, as without overlap."""
        with self._cond:
            cost = self._device_s.get(shape) if asynchronous else None
            self._end = None if cost is None or self._end is None else max(now, self._end) + cost
            self._in_flight += 1
            if asynchronous:
                self.launch_s = 0.8 * self.launch_s + 0.2 * (now - started) if self.launch_s else now - started

    def finished(self, shape: tuple, device_ms: float | None) -> None:
        with self._cond:
            if device_ms is not None:
                previous = self._device_s.get(shape)
                cost = device_ms / 1e3
                self._device_s[shape] = cost if previous is None else 0.7 * previous + 0.3 * cost
            self._in_flight -= 1
            if not self._in_flight:
                self._end = 0.0
            self._cond.notify_all()

    def _turn_in(self, now: float) -> float:
        """Seconds until the next batch may be formed (<= 0: now); inf when only a finish can tell."""
        if not self._in_flight:
            return 0.0
        if self._in_flight == 1 and self._end is not None:
            return self._end - (self.launch_s + LAUNCH_MARGIN_S) - now
        return float("inf")

    def predicted_end(self) -> float | None:
        """When everything launched is predicted to be done (perf_counter seconds); None: nothing in
        flight, or not predictable."""
        with self._cond:
            return self._end if self._in_flight else None

    def await_turn(self) -> None:
        """Returns once nothing is in flight, or the last launch is predicted to end within the
        host's launch time plus LAUNCH_MARGIN_S (and at most one batch runs: none is queued behind it)."""
        with self._cond:
            while (wait := self._turn_in(time.perf_counter())) > 0:
                self._cond.wait(None if wait == float("inf") else wait)


class Batcher:
    def __init__(self, policy: Policy, max_batch_size: int = 8, batch_delay_ms: float = 0.0,
                 on_batch: Callable[[int], None] | None = None):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if batch_delay_ms < 0:
            raise ValueError("batch_delay_ms must be non-negative")
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.batch_delay_s = batch_delay_ms / 1000.0
        self.on_batch = on_batch
        self.clients = ReturningClients()
        self.clock = DeviceClock()
        self._queue: queue.Queue = queue.Queue()
        self._launched: queue.Queue = queue.Queue()  # (batch, LaunchedBatch, started) in launch order
        # Guards `_closed` together with the put, so nothing can be queued behind the stop marker.
        self._lock = threading.Lock()
        # Requests that did not fit the batch being formed (another key, or past the limit), in arrival order.
        self._held: collections.deque = collections.deque()
        self._closed = False
        self._launcher = threading.Thread(target=self._run, name="vlaserve-launch", daemon=True)
        self._completer = threading.Thread(target=self._complete, name="vlaserve-complete", daemon=True)
        self._launcher.start()
        self._completer.start()

    async def submit(self, request: Request):
        """Runs one request; the result's `timings` gains `queue_ms`."""
        return await self.submit_many([request])[0]

    def submit_many(self, requests: list[Request],
                    loop: asyncio.AbstractEventLoop | None = None) -> list[asyncio.Future]:
        """Queues requests as one group (they reach the launch thread together, so a group of B
        fills batches up to the limit instead of racing it); one future per request, each failing alone.
        `loop`: the event loop that awaits the futures, when called from another thread (the server's
        worker that prepared a request queues it: one thread hop less than going back through the loop)."""
        loop = loop or asyncio.get_running_loop()
        pending = [_Pending(r, loop, loop.create_future()) for r in requests]
        for p in pending:
            self.clients.arrived(p.request.client, p.enqueued_at)
        with self._lock:
            if self._closed:
                raise BatcherClosed("the server is shutting down")
            self._queue.put(pending[0] if len(pending) == 1 else pending)
        return [p.future for p in pending]

    def close(self) -> None:
        """Stops taking requests, finishes every queued one, then joins the threads."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._launcher.join()
        self._completer.join()

    @property
    def alive(self) -> bool:
        return self._launcher.is_alive() and self._completer.is_alive()

    def _run(self) -> None:
        held = self._held
        while True:
            self.clock.await_turn()
            first = held.popleft() if held else self._queue.get()
            if isinstance(first, list):  # a group: its first request leads, the rest wait in line first
                held.extendleft(reversed(first[1:]))
                first = first[0]
            if first is _STOP:
                self._launched.put(_STOP)
                return
            self._execute(self._form(first))

    def _form(self, first: _Pending) -> list[_Pending]:
        """The batch `first` leads: the held requests of its key, then what the queue brings now, or within
        `batch_delay_s`, or within COMPANY_WAIT_S while clients are due back; the rest is held."""
        held = self._held
        batch = [first]
        for request in list(held):
            if len(batch) == self.max_batch_size:
                break
            if request is not _STOP and request.key == first.key:
                held.remove(request)
                batch.append(request)
        started = time.perf_counter()
        deadline = started + self.batch_delay_s
        company_deadline = started + COMPANY_WAIT_S
        while len(batch) < self.max_batch_size:
            now = time.perf_counter()
            # Everything queued now; then wait only for the extra delay, or for clients due back.
            wait = max(0.0, deadline - now)
            if not wait and self.clients.due(now, self.clock.predicted_end()):
                wait = max(0.0, company_deadline - now)
            try:
                request = self._queue.get(timeout=wait)
            except queue.Empty:
                break
            if request is _STOP:
                held.append(request)
                break
            for item in request if isinstance(request, list) else [request]:
                if item.key == first.key and len(batch) < self.max_batch_size:
                    batch.append(item)
                else:
                    held.append(item)
        return batch

    def _execute(self, batch: list[_Pending]) -> None:
        """Launches a batch and queues it for the completion thread; a batch that fails to launch
        is split as `_settle` does."""
        started = time.perf_counter()
        if self.on_batch is not None:
            self.on_batch(len(batch))
        try:
            launched = self.policy.launch([p.request for p in batch])
        except Exception as error:  # noqa: BLE001 - the worker must survive anything one batch does
            self._failed(batch, error)
            return
        self.clock.launched(self._shape(batch), started, time.perf_counter(), asynchronous=not launched.done())
        self.clients.running([p.request.client for p in batch])
        self._launched.put((batch, launched, started))

    def _complete(self) -> None:
        while True:
            item = self._launched.get()
            if item is _STOP:
                return
            batch, launched, started = item
            device_ms = None
            try:
                results = launched.finish()
                if len(results) != len(batch):
                    raise RuntimeError(f"the policy returned {len(results)} results for {len(batch)} requests")
                device_ms = results[0].timings.get("device_ms")
            except Exception as error:  # noqa: BLE001 - the worker must survive anything one batch does
                self._failed(batch, error)
            else:
                self._answer(batch, results, started)
            finally:
                self.clock.finished(self._shape(batch), device_ms)

    def _failed(self, batch: list[_Pending], error: Exception) -> None:
        if len(batch) > 1:
            # One bad request must not fail the others: re-run each alone, so the good ones get
            # their answers and only the culprit its error (logged once, by its own run).
            log.warning("a batch of %d failed (%s); re-running its requests one by one", len(batch),
                        type(error).__name__)
            for request in batch:
                self._run_alone(request)
            return
        if not isinstance(error, InvalidInput):
            log.exception("inference failed", exc_info=error)
        self.clients.answered([batch[0].request.client], time.perf_counter())  # an error is its reply
        _resolve(batch[0], error=error)

    def _run_alone(self, request: _Pending) -> None:
        started = time.perf_counter()
        try:
            results = self.policy.launch([request.request]).finish()
        except Exception as error:  # noqa: BLE001
            self._failed([request], error)
            return
        self._answer([request], results, started)

    def _answer(self, batch: list[_Pending], results: list, started: float) -> None:
        done = time.perf_counter()
        self.clients.answered([p.request.client for p in batch], done)
        for request, result in zip(batch, results):
            result.timings["queue_ms"] = (started - request.enqueued_at) * 1000.0
            result.timings["run_ms"] = (done - started) * 1000.0
            result.timings["done_at"] = done  # perf_counter seconds: the caller measures the hand-back
            if np.isfinite(result.actions).all():
                _resolve(request, result=result)
            else:
                _resolve(request, error=NonFiniteActions(
                    "the model's actions for this request are not finite (NaN or inf); "
                    "its noise, RTC or state values are too extreme"))

    @staticmethod
    def _shape(batch: list[_Pending]) -> tuple:
        return len(batch), *batch[0].key


def _resolve(request: _Pending, result=None, error: Exception | None = None) -> None:
    def settle() -> None:
        if request.future.done():  # the caller went away (cancelled); nobody is waiting
            return
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    try:
        request.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # that event loop is already closed: the server stopped while this request ran
