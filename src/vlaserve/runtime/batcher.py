"""Dynamic batching in front of a Policy: Requests in, InferenceResults out.

One worker thread owns the policy (and so the device); asyncio handlers only enqueue and await.
Continuous batching: when the device is idle a request runs at once; requests that arrive while a
batch runs wait in the queue, and the moment it finishes everything queued (up to the batch limit,
one step count) runs together. A batch of 8 costs far less than 8 calls. `batch_delay_ms` (default 0)
is an optional extra wait for company after the first request of a batch.
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

from ..errors import InvalidInput, NonFiniteActions
from ..types import Request

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
    def num_steps(self) -> int | None:
        return self.request.num_steps


_STOP = object()
# How long a batch may wait for a client that is about to send its next request (its reply just went
# out and it usually answers within its think time): without it, two robots back to back ping-pong at
# batch size 1, each waiting out the other's whole batch. Only clients measured to come back that
# soon are waited for, so a paced robot never adds this wait.
COMPANY_WAIT_S = 0.005


class ReturningClients:
    """Each client's think time (reply sent -> next request), smoothed, and which clients are due back
    within COMPANY_WAIT_S. Clients are connections (Request.client); None is not tracked."""

    FORGET_S = 10.0  # a client silent this long has gone away

    def __init__(self):
        self._lock = threading.Lock()
        self._answered: dict = {}  # client -> when its last reply went out (not back since)
        self._think: dict = {}  # client -> smoothed think time, seconds

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

    def due(self, now: float) -> int:
        """Clients not back yet whose think time says they return within COMPANY_WAIT_S of now; one
        already overdue by more than that is idle (or gone), not about to send."""
        with self._lock:
            for client in [c for c, t in self._answered.items() if now - t > self.FORGET_S]:
                del self._answered[client]
                self._think.pop(client, None)
            return sum(1 for c, t in self._answered.items()
                       if c in self._think and abs(t + self._think[c] - now) <= COMPANY_WAIT_S)


class Batcher:
    def __init__(self, policy, max_batch_size: int = 8, batch_delay_ms: float = 0.0,
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
        self._queue: queue.Queue = queue.Queue()
        # Guards `_closed` together with the put, so nothing can be queued behind the stop marker.
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vlaserve-inference", daemon=True)
        self._thread.start()

    async def submit(self, request: Request):
        """Runs one request; the result's `timings` gains `queue_ms`."""
        loop = asyncio.get_running_loop()
        request = _Pending(request, loop, loop.create_future())
        self.clients.arrived(request.request.client, request.enqueued_at)
        with self._lock:
            if self._closed:
                raise BatcherClosed("the server is shutting down")
            self._queue.put(request)
        return await request.future

    def close(self) -> None:
        """Stops taking requests, finishes every queued one, then joins the worker."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        # Requests that did not fit the current batch (another num_steps), in arrival order.
        held: collections.deque = collections.deque()
        while True:
            first = held.popleft() if held else self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            for request in list(held):
                if len(batch) == self.max_batch_size:
                    break
                if request is not _STOP and request.num_steps == first.num_steps:
                    held.remove(request)
                    batch.append(request)
            started = time.perf_counter()
            deadline = started + self.batch_delay_s
            company_deadline = started + COMPANY_WAIT_S
            while len(batch) < self.max_batch_size:
                now = time.perf_counter()
                # Everything queued now; then wait only for the extra delay, or for clients due back.
                wait = max(0.0, deadline - now)
                if not wait and self.clients.due(now):
                    wait = max(0.0, company_deadline - now)
                try:
                    request = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
                if request is not _STOP and request.num_steps == first.num_steps:
                    batch.append(request)
                else:
                    held.append(request)
                    if request is _STOP:
                        break
            self._execute(batch)

    def _execute(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        if self.on_batch is not None:
            self.on_batch(len(batch))
        try:
            results = self._infer(batch)
        except Exception as error:  # noqa: BLE001 - the worker must survive anything one batch does
            if len(batch) > 1:
                # One bad request must not fail the others: re-run each alone, so the good ones get
                # their answers and only the culprit its error (logged once, by its own run).
                log.warning("a batch of %d failed (%s); re-running its requests one by one", len(batch),
                            type(error).__name__)
                for request in batch:
                    self._execute([request])
                return
            if not isinstance(error, InvalidInput):
                log.exception("inference failed")
            _resolve(batch[0], error=error)
            return
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

    def _infer(self, batch: list[_Pending]) -> list:
        results = self.policy.run([p.request for p in batch])
        if len(results) != len(batch):
            raise RuntimeError(f"infer_batch returned {len(results)} results for {len(batch)} observations")
        return results


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
