"""Service: a validated request to a batcher submission and a reply, for every protocol's routes.

Beside it: the settings (server.settings), the API key (server.access), the metadata clients read
(server.metadata), the reply body and the timings (server.replies)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping


from ..batcher import Batcher, BatcherClosed
from ..errors import InvalidInput, NonFiniteActions, NotServing, WeightUpdateRefused
from ..processing.layouts import KeyLayout
from ..types import Request
from .access import TICKET_LIFETIME_S, Access
from .metadata import public_metadata
from .metrics import Metrics
from .replies import MODEL_STAGES, failed_status, ms_since, reply_body
from .schema import ApiError, Generation, api_error, parse_generation
from .sessions import Sessions
from .settings import ServerSettings
from .weight_updates import refusal
from .workers import Workers


class Service:
    def __init__(self, policy, settings: ServerSettings):
        self.policy = policy
        self.settings = settings
        self.access = Access(settings.api_key, settings.admin_api_key)
        # What the hot path reads, fixed at startup (the live metadata is built per metadata request).
        m = policy.metadata
        # What a request's `model` may name: the served name, the checkpoint's path, the hub id it records.
        names = frozenset(n for n in (m["model"], m["checkpoint"], m["hub_id"]) if n)
        self.identity = {"model": m["model"], "names": names, "is_demo": m["is_demo"],
                         "num_inference_steps": m["num_inference_steps"]}
        self.action_shape = {"action_horizon": m["action_horizon"], "action_dim": m["action_dim"],
                             "padded_action_dim": m["max_action_dim"]}
        self.layout = KeyLayout(tuple(m["cameras"]), settings.camera_aliases, m["rename_map"])
        self.batch_limit = policy.runtime.settings.batch_limit  # RuntimeConfig owns it: graphs and memory use it too
        self.metrics = Metrics(self.batch_limit)
        self.metrics.watch_runtime(policy.runtime.stats)
        self.metrics.record_precision(m["precision"])
        self.batcher: Batcher | None = None
        self.workers: Workers | None = None
        self.sessions = Sessions()
        # Where a websocket handshake is sent instead of being accepted here (a URL), or None to
        # accept it: serve-ray's direct websockets set this (fleet/direct.py).
        self.websocket_redirect: Callable[[Mapping], str | None] | None = None
        # Why this server refuses weight updates (a serve-ray replica: fleet/replica.py), or None.
        self.weight_updates_refused: str | None = None

    def start(self) -> None:
        self.policy.runtime.limit_host_threads()
        self.workers = Workers(self.settings.worker_threads, self.settings.decode_processes, self.settings.max_pending)
        self.workers.start()
        self.batcher = Batcher(self.policy, self.batch_limit, self.settings.batch_delay_ms,
                               on_batch=self.metrics.batch_size.observe)

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        if self.workers is not None:
            self.workers.close()

    # The API key's checks (server.access), where the routes, the handshake and the fleet call them.
    def authorized(self, headers: Mapping[str, str]) -> bool:
        return self.access.authorized(headers)

    def require_auth(self, headers: Mapping[str, str]) -> None:
        self.access.require_auth(headers)

    def require_admin(self, headers: Mapping[str, str], client_host: str | None) -> None:
        self.access.require_admin(headers, client_host)

    def ticket(self, lifetime_s: float = TICKET_LIFETIME_S) -> str:
        return self.access.ticket(lifetime_s)

    def valid_ticket(self, ticket: str | None) -> bool:
        return self.access.valid_ticket(ticket)

    @property
    def metadata(self) -> dict:
        return self.policy.metadata  # live: fast path, prefix-cache stats and readiness change

    def public_metadata(self) -> dict:
        """server.metadata's (SGLang's action.metadata structure, with vlaserve's own fields beside it)."""
        return public_metadata(self.metadata, self.settings, self.batch_limit)

    async def update_weights(self, model_path: str) -> dict:
        """POST /update_weights_from_disk: the policy's weights swapped in place (Policy.update_weights), off the
        event loop -> SGLang's reply ({"success", "message"}) with the new weight_version and the timings."""
        if self.weight_updates_refused is not None:
            raise ApiError(409, "update_unavailable", self.weight_updates_refused)
        try:
            done = await asyncio.to_thread(self.policy.update_weights, model_path)
        except WeightUpdateRefused as e:
            raise refusal(e) from None
        self.metrics.weight_updates.inc()
        return {"success": True, "message": f"weights updated from {done['checkpoint']} (version "
                                            f"{done['weight_version']})", **done}

    async def prepare(self, requests: list, in_request_body: bool) -> list:
        """Checks each request against the checkpoint and preprocesses it, on worker threads: the
        prepared request is what gets batched, so an observation is preprocessed once, and preparing
        the next batch overlaps the device's work on this one (a lone raw-frame request is prepared
        on the event loop instead: _prepare_and_queue). Returns each request, or the ApiError it fails with (an ApiError given stays). The requests
        share at most `worker_threads` jobs, so a batch of any size takes a bounded share of the backlog."""
        todo = [r for r in requests if isinstance(r, Request)]
        jobs = [todo[i::self.settings.worker_threads] for i in range(min(len(todo), self.settings.worker_threads))]
        done = await asyncio.gather(*(self.workers.in_thread(_prepare_each, self.policy, job) for job in jobs))
        errors = {id(r): e for job, outcome in zip(jobs, done) for r, e in zip(job, outcome) if e is not None}
        return [api_error(errors[id(r)], in_request_body) if id(r) in errors else r for r in requests]

    async def infer(self, request: Request, in_request_body: bool):
        """Prepares, queues and runs one request. Returns the InferenceResult; its timings hold
        queue_ms and the model stages."""
        return (await self.infer_many([request], in_request_body))[0]

    async def infer_many(self, requests: list, in_request_body: bool, per_item_errors: bool = False) -> list:
        """Prepares, queues and runs requests (an ApiError in the list stands for an item already
        refused). The prepared ones are queued as one group, so B of them fill batches up to the
        batch limit (more than the limit: several batches). Returns one InferenceResult per request;
        with `per_item_errors`, an item that fails gets its ApiError in its place, else the first
        failure is raised."""
        started = time.perf_counter()
        try:
            prepared, futures, prepared_at = await self._prepare_and_queue(requests, in_request_body)
        except BatcherClosed as e:
            raise ApiError(503, "shutting_down", str(e)) from None
        ready = [r for r in prepared if isinstance(r, Request)]
        outcomes = {}
        if ready:
            with self.metrics.in_flight.track_inprogress():
                done = await asyncio.gather(*futures, return_exceptions=True)
            outcomes = {id(r): outcome for r, outcome in zip(ready, done)}
        results = []
        for item in prepared:
            outcome = item if isinstance(item, ApiError) else self._outcome(outcomes[id(item)], in_request_body)
            if isinstance(outcome, ApiError):
                if not per_item_errors:
                    raise outcome
            else:
                outcome.timings["prepare_ms"] = (prepared_at - started) * 1e3
                outcome.timings["handback_ms"] = ms_since(outcome.timings.pop("done_at"))
            results.append(outcome)
        if any(not isinstance(r, ApiError) for r in results):
            self.metrics.first_action()
        return results

    async def _prepare_and_queue(self, requests: list, in_request_body: bool) -> tuple[list, list, float]:
        """Prepares the requests and queues the prepared ones: (each request or its ApiError, the queued
        ones' futures, when preparing ended). A lone request of raw frames (a robot's) is prepared and
        queued right here; another lone one (PNG / JPEG to decode, frames to resize on the host) by
        the worker that prepared it, without a hop back through the event loop first (bench_prepare.py
        measures the hops)."""
        todo = [r for r in requests if isinstance(r, Request)]
        if len(todo) != 1:
            prepared = await self.prepare(requests, in_request_body)
            prepared_at = time.perf_counter()
            ready = [r for r in prepared if isinstance(r, Request)]
            return prepared, self.batcher.submit_many(ready) if ready else [], prepared_at
        args = (self.policy, self.batcher, todo[0], asyncio.get_running_loop())
        if self.policy.is_light(todo[0]):
            # Raw bytes (a robot's frame): prepared here, on the event loop (a copy, no decode), without the
            # hop to a worker and its wake-up. Robots sending at once still batch together: the
            # batcher waits for clients due back (batcher.COMPANY_WAIT_S).
            error, futures, prepared_at = _prepare_and_queue_one(*args)
        else:
            error, futures, prepared_at = await self.workers.in_thread(_prepare_and_queue_one, *args)
        prepared = [api_error(error, in_request_body) if r is todo[0] and error is not None else r for r in requests]
        return prepared, futures, prepared_at

    @staticmethod
    def _outcome(outcome, in_request_body: bool):
        """An InferenceResult, or the ApiError its failure is answered with."""
        if not isinstance(outcome, BaseException):
            return outcome
        if isinstance(outcome, BatcherClosed):
            return ApiError(503, "shutting_down", str(outcome))
        if isinstance(outcome, InvalidInput):
            return api_error(outcome, in_request_body)
        if isinstance(outcome, NonFiniteActions):
            return ApiError(422, "non_finite_actions", str(outcome))
        if isinstance(outcome, NotServing):  # the warm-up failed or is stuck: this server can't run batches
            return ApiError(503, "not_serving", str(outcome))
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        return ApiError(500, "internal_error", "inference failed; see the server log")  # the batcher logged it

    async def generate(self, body, started: float, msgpack_response: bool,
                       client: object = None) -> tuple[Generation, list, dict]:
        """Validates a /v1 request body and runs it. Returns the request, one InferenceResult per
        observation (an ApiError for an item of a batch that failed) and the timings so far (decode,
        queue, model stages: a batch's slowest item's). `client`: the connection it came on."""
        generation = parse_generation(body, self.identity, self.layout, msgpack_response, self.action_shape)
        for request in generation.requests:
            if isinstance(request, Request):
                request.client = client
        timings = {"decode_ms": ms_since(started)}
        results = await self.infer_many(generation.requests, in_request_body=True,
                                        per_item_errors=generation.batched)
        if generation.batched:  # each error names its observation
            results = [r.in_batch(i, len(results)) if isinstance(r, ApiError) else r for i, r in enumerate(results)]
        answered = [r for r in results if not isinstance(r, ApiError)]
        for key in ("queue_ms", *MODEL_STAGES):
            values = [r.timings[key] for r in answered if key in r.timings]
            if values:
                timings[key] = max(values)
        return generation, results, timings

    def reply(self, generation: Generation, results: list, timings: dict, started: float) -> dict:
        """The response body, its stages observed in the metrics."""
        body = self.reply_body(generation, results, timings, started)
        self.metrics.observe_stages(timings)
        return body

    def http_reply(self, generation: Generation, results: list, timings: dict, started: float) -> tuple[dict, int]:
        """The response body and its HTTP status: 200 when any observation was answered; when every
        observation of a batch failed, their status (the highest where they differ), the body's `error`
        saying so beside the items' own."""
        body = self.reply(generation, results, timings, started)
        status = failed_status(results)
        if status != 200:
            first = results[0].body()["error"]
            body["error"] = {**first, "message": f"every observation of the batch failed; {first['message']}"}
        return body, status

    def reply_body(self, generation: Generation, results: list, timings: dict, started: float) -> dict:
        return reply_body(generation, results, timings, started, self.identity)


def _prepare_and_queue_one(policy, batcher: Batcher, request: Request,
                           loop: asyncio.AbstractEventLoop) -> tuple[InvalidInput | None, list, float]:
    """One worker job: prepares a request and, when it is valid, queues it on the batcher for `loop`."""
    error = _prepare_each(policy, [request])[0]
    prepared_at = time.perf_counter()
    return error, [] if error is not None else batcher.submit_many([request], loop), prepared_at


def _prepare_each(policy, requests: list[Request]) -> list[InvalidInput | None]:
    """One worker job: prepares requests in turn; each one's InvalidInput (None when it is fine)."""
    errors = []
    for request in requests:
        try:
            policy.prepare(request)
            errors.append(None)
        except InvalidInput as e:
            errors.append(e)
    return errors
