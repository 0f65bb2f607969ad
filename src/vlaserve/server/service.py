"""What every route shares: the policy, its batcher, settings and metrics, and the steps common to
all protocols (authorize, validate, infer, time)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..batcher import Batcher, BatcherClosed
from ..errors import InvalidInput, NonFiniteActions, NotServing
from ..processing.images import MAX_IMAGE_SIDE
from ..processing.layouts import KeyLayout, camera_aliases
from ..types import (MAX_GUIDANCE_WEIGHT, MAX_INFERENCE_STEPS, MAX_NOISE_ABS, MAX_RTC_ABS, MAX_TASK_CHARS,
                     InferenceResult, Request)
from .bodies import NOT_IN_PLACE, decode_in_place
from .codec import MAX_NESTING_DEPTH, packb
from .metrics import Metrics
from .schema import ApiError, Generation, api_error, parse_generation
from .sessions import Sessions
from .warm import KeepWarm
from .workers import Workers

MODEL_STAGES = ("preprocess_ms", "prefix_ms", "denoise_ms", "device_ms", "postprocess_ms")
# Where the host time around the device goes (OpenPI's policy_timing carries them too): checking and
# preparing the request on a worker thread, waiting in the queue, the batch's whole run on the
# inference thread, and the hand-back of its result to the event loop; and, for a batch launched
# behind a running one, the device's time between the two (runtime/fast/graphs.py EventTimes).
HOST_STAGES = ("prepare_ms", "queue_ms", "run_ms", "handback_ms", "launch_gap_ms")
TICKET_LIFETIME_S = 60.0
ROUTES = {"http": "/v1/actions/generations", "realtime": "/v1/actions/realtime", "openpi": "/openpi/policy"}


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    max_payload_bytes: int = 64 * 2**20
    batch_delay_ms: float = 0.0
    camera_aliases: dict[str, str] = field(default_factory=camera_aliases)
    body_timeout_s: float = 60.0
    allowed_origins: tuple[str, ...] = ()  # browser origins that may call; "*" for any
    # Decoding and preprocessing, off the event loop: threads, decode processes, and the most jobs
    # waiting or running before new ones get 503.
    worker_threads: int = 4
    decode_processes: int = 1
    max_pending: int = 64
    # Enqueue the next batch on the device while this one runs (vlaserve/batcher.py); False: one at a time.
    overlap: bool = True
    keep_warm: bool = True  # server/warm.py
    direct_launch: bool = True  # a lone request launched by the thread that prepared it (vlaserve/batcher.py)

    @classmethod
    def from_options(cls, options: Mapping) -> "ServerSettings":
        """What `vlaserve serve` and each `serve-ray` replica build from the same options
        (options.serve_options). The batch size limit is the policy's (RuntimeConfig.batch_limit)."""
        return cls(api_key=options["api_key"], max_payload_bytes=int(options["max_payload_mb"] * 2**20),
                   batch_delay_ms=options["batch_delay_ms"],
                   camera_aliases=camera_aliases(options["camera_aliases"]), body_timeout_s=options["body_timeout_s"],
                   allowed_origins=tuple(o.strip() for o in (options["allowed_origins"] or "").split(",") if o.strip()),
                   overlap=not options["serial_batches"], keep_warm=options["keep_warm"],
                   direct_launch=options["direct_launch"])


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def policy_timing(model_timings: Mapping[str, float]) -> dict[str, float]:
    """OpenPI's `policy_timing`: the policy's stages, and the size of the batch the request ran in
    (the device time is that batch's)."""
    timing = {k: float(model_timings[k]) for k in (*MODEL_STAGES, *HOST_STAGES) if k in model_timings}
    if "batch_size" in model_timings:
        timing["batch_size"] = int(model_timings["batch_size"])
    return timing


class Service:
    def __init__(self, policy, settings: ServerSettings):
        self.policy = policy
        self.settings = settings
        # What the hot path reads, fixed at startup (the live metadata is built per metadata request).
        m = policy.metadata
        self.identity = {"model": m["model"], "checkpoint": m["checkpoint"], "is_demo": m["is_demo"],
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
        self.keep_warm = KeepWarm(settings.keep_warm)
        # What every rehearsal uses (server/warm.py): zero noise, and a result of zeros to encode as its reply.
        self._zero_noise = np.zeros(policy.preprocessor.noise_shape, dtype=np.float32)
        self._zero_result = InferenceResult(
            np.zeros((m["action_horizon"], m["action_dim"]), dtype=np.float32), self._zero_noise,
            {**{name: 0.0 for name in (*MODEL_STAGES, *HOST_STAGES)}, "batch_size": 1})
        # Where a websocket handshake is sent instead of being accepted here (a URL), or None to
        # accept it: serve-ray's direct websockets set this (fleet/direct.py).
        self.websocket_redirect: Callable[[Mapping], str | None] | None = None

    def start(self) -> None:
        self.policy.runtime.limit_host_threads()
        self.workers = Workers(self.settings.worker_threads, self.settings.decode_processes, self.settings.max_pending)
        self.workers.start()
        self.batcher = Batcher(self.policy, self.batch_limit, self.settings.batch_delay_ms,
                               on_batch=self.metrics.batch_size.observe, overlap=self.settings.overlap,
                               direct_launch=self.settings.direct_launch)

    def stop(self) -> None:
        self.keep_warm.cancel()
        if self.batcher is not None:
            self.batcher.close()
        if self.workers is not None:
            self.workers.close()

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """`Authorization: Bearer KEY`, `X-API-Key: KEY`, or openpi-client's `Authorization: Api-Key KEY`."""
        key = self.settings.api_key
        if key is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        offered = [headers.get("x-api-key", "")]
        if scheme.lower() in ("bearer", "api-key"):
            offered.append(token.strip())
        return any(hmac.compare_digest(o.encode(), key.encode()) for o in offered if o)

    def ticket(self, lifetime_s: float = TICKET_LIFETIME_S) -> str:
        """A short-lived proof of a checked API key, for a URL (a client following a redirect to
        another host or port drops its Authorization header)."""
        expires = str(int(time.time() + lifetime_s))
        return f"{expires}.{self._sign(expires)}"

    def valid_ticket(self, ticket: str | None) -> bool:
        if self.settings.api_key is None or not ticket:
            return False
        expires, _, signature = ticket.partition(".")
        return (expires.isdigit() and int(expires) >= time.time()
                and hmac.compare_digest(signature.encode(), self._sign(expires).encode()))

    def _sign(self, text: str) -> str:
        return hmac.new(self.settings.api_key.encode(), b"vlaserve-ticket:" + text.encode(), hashlib.sha256).hexdigest()

    def require_auth(self, headers: Mapping[str, str]) -> None:
        if not self.authorized(headers):
            raise ApiError(401, "unauthorized", "missing or wrong API key "
                                                "(send 'Authorization: Bearer KEY' or 'X-API-Key: KEY')")

    @property
    def metadata(self) -> dict:
        return self.policy.metadata  # live: fast path, prefix-cache stats and readiness change

    def public_metadata(self) -> dict:
        """SGLang's action.metadata structure (input, output, defaults, capabilities: what its clients
        read), with vlaserve's own fields beside it (the flat ones OpenPI clients read, limits, protocols)."""
        m = self.metadata
        cache, graphs = m["prefix_cache"] is not None, bool(m["fast_path"])
        return {
            **m,
            "object": "action.metadata",
            "policy_family": m["policy_type"],
            "input": {"image_keys": m["cameras"], "image_size": m["image_resolution"], "state_dim": m["state_dim"]},
            "output": {"action_type": "continuous", "action_horizon": m["action_horizon"],
                       "action_dim": m["action_dim"], "padded_action_dim": m["max_action_dim"], "dtype": "float32"},
            "defaults": {"num_inference_steps": m["num_inference_steps"], "action_horizon": m["action_horizon"],
                         "prefix_cache": "auto" if cache else False, "cuda_graph": "auto" if graphs else False,
                         "return_timing": True, "response_format": "envelope",
                         "output_format": {"json": "list", "msgpack": "numpy"}},
            "capabilities": {"exact_prefix_cache": cache, "cuda_graph": graphs, "realtime_websocket": True,
                             "openpi_websocket": True, "batch_inputs": True,
                             "max_batch_size": self.batch_limit, "multiple_candidates": False,
                             "rtc": True},
            "limits": {"max_inference_steps": MAX_INFERENCE_STEPS, "max_payload_bytes": self.settings.max_payload_bytes,
                       "max_batch_size": self.batch_limit, "batch_delay_ms": self.settings.batch_delay_ms,
                       "max_task_chars": MAX_TASK_CHARS, "max_image_side": MAX_IMAGE_SIDE,
                       "max_nesting_depth": MAX_NESTING_DEPTH, "max_noise_abs": MAX_NOISE_ABS,
                       "max_guidance_weight": MAX_GUIDANCE_WEIGHT, "max_rtc_abs": MAX_RTC_ABS,
                       "body_timeout_s": self.settings.body_timeout_s},
            "protocols": {
                "http": {"path": ROUTES["http"], "content_types": ["application/json", "application/msgpack"]},
                "realtime": {"path": ROUTES["realtime"], "encoding": "msgpack"},
                "openpi": {"path": ROUTES["openpi"], "also_at": "/", "encoding": "msgpack-numpy"},
            },
            "camera_aliases": self.settings.camera_aliases,
            "keep_warm": self.keep_warm.stats(),
            "direct_launch": {"enabled": self.settings.direct_launch,
                              "launches": self.batcher.direct_launches if self.batcher is not None else 0},
            # What vlaserve_client reads: RTC on /v1 routes, and in which spaces prev_chunk may come.
            "features": {"rtc": True, "rtc_spaces": ["model"] if m["relative_actions"] else ["model", "action"]},
        }

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

    async def infer(self, request: Request, in_request_body: bool, rehearsal: Callable[[], bool] | None = None):
        """Prepares, queues and runs one request. Returns the InferenceResult; its timings hold
        queue_ms and the model stages. `rehearsal`: the route's event-loop work for this request,
        rehearsed with --keep-warm (server/warm.py) when all of it ran on the event loop."""
        return (await self.infer_many([request], in_request_body, rehearsal=rehearsal))[0]

    async def infer_many(self, requests: list, in_request_body: bool, per_item_errors: bool = False,
                         rehearsal: Callable[[], bool] | None = None) -> list:
        """Prepares, queues and runs requests (an ApiError in the list stands for an item already
        refused). The prepared ones are queued as one group, so B of them fill batches up to the
        batch limit (more than the limit: several batches). Returns one InferenceResult per request;
        with `per_item_errors`, an item that fails gets its ApiError in its place, else the first
        failure is raised."""
        started = time.perf_counter()
        try:
            prepared, futures, prepared_at = await self._prepare_and_queue(requests, in_request_body, rehearsal)
        except BatcherClosed as e:
            raise ApiError(503, "shutting_down", str(e)) from None
        ready = [r for r in prepared if isinstance(r, Request)]
        outcomes = {}
        if ready:
            with self.metrics.in_flight.track_inprogress():
                done = await asyncio.gather(*futures, return_exceptions=True)
            self.keep_warm.cancel()  # a rehearsal still pending now would only delay the answer, or the next frame
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

    async def _prepare_and_queue(self, requests: list, in_request_body: bool,
                                 rehearsal: Callable[[], bool] | None = None) -> tuple[list, list, float]:
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
            if error is None and rehearsal is not None:  # this request's host path ran here, on the event loop
                self.keep_warm.schedule(rehearsal, self.batcher.clock, (1, todo[0].num_steps, todo[0].cuda_graph),
                                        prepared_at)
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

    async def generate(self, body, started: float, msgpack_response: bool, client: object = None,
                       rehearsal: Callable[[], bool] | None = None) -> tuple[Generation, list, dict]:
        """Validates a /v1 request body and runs it. Returns the request, one InferenceResult per
        observation (an ApiError for an item of a batch that failed) and the timings so far (decode,
        queue, model stages: a batch's slowest item's). `client`: the connection it came on;
        `rehearsal`: as `infer`'s."""
        generation = parse_generation(body, self.identity, self.layout, msgpack_response, self.action_shape)
        for request in generation.requests:
            if isinstance(request, Request):
                request.client = client
        timings = {"decode_ms": ms_since(started)}
        results = await self.infer_many(generation.requests, in_request_body=True,
                                        per_item_errors=generation.batched, rehearsal=rehearsal)
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

    def rehearse_request(self, request: Request) -> InferenceResult:
        """The part of a keep-warm rehearsal (server/warm.py) every route shares: `request` prepared and collated
        as a real one is (a lone robot's batch is collated on the event loop too: the batcher's direct launch), with
        zero noise (no draw from any generator); returns a result of zeros to encode as its reply."""
        request.noise, request.seed = self._zero_noise, None
        self.policy.rehearse(request)
        return self._zero_result

    def rehearse_generation(self, payload: bytes) -> bool:
        """Keep-warm's rehearsal of what a /v1 route runs on the event loop for a msgpack body of one
        observation of raw frames: decoding, validating and preparing it, building and encoding its reply;
        nothing of it is kept, queued, counted or sent. (A body decoded by a worker thread is not rehearsed.)"""
        body = decode_in_place(payload)
        if body is NOT_IN_PLACE:
            return False
        generation = parse_generation(body, self.identity, self.layout, True, self.action_shape)
        result = self.rehearse_request(generation.requests[0])
        packb(self.reply_body(generation, [result], {"decode_ms": 0.0, **result.timings}, time.perf_counter()))
        return True

    def reply_body(self, generation: Generation, results: list, timings: dict, started: float) -> dict:
        """The response body. `encode_ms` covers converting the actions to their wire form; the final
        serialization of the body follows the timings it contains, so it can't be in them."""
        encode_start = time.perf_counter()
        h = generation.action_horizon
        actions = [None if isinstance(r, ApiError) else r.actions[:h] for r in results]
        values = [a if a is None or generation.output_format == "numpy" else a.tolist() for a in actions]
        timings["encode_ms"] = ms_since(encode_start)
        timings["total_ms"] = ms_since(started)
        answered = [r for r in results if not isinstance(r, ApiError)]
        if generation.response_format == "raw":
            server = {k: timings[k] for k in ("decode_ms", "queue_ms", "encode_ms", "total_ms") if k in timings}
            body = {"server_timing": server}
            if answered:
                body["policy_timing"] = policy_timing(answered[-1].timings)
            if not generation.batched:
                body["actions"] = values[0]
            elif len(answered) == len(results):  # [B, H, D]
                stacked = np.stack(actions)
                body["actions"] = stacked if generation.output_format == "numpy" else stacked.tolist()
            else:  # an item failed: its actions are null, its error is in `errors`
                body["actions"] = values
                body["errors"] = [r.body()["error"] if isinstance(r, ApiError) else None for r in results]
            return body
        data = []
        for i, (result, value, array) in enumerate(zip(results, values, actions)):
            item = {"index": i, "input_index": i, "candidate_index": 0}
            if isinstance(result, ApiError):
                item.update(result.body())
            else:
                item["action"] = {"type": "continuous", "values": value, "shape": list(array.shape),
                                  "dtype": str(array.dtype)}
            data.append(item)
        shape = next((a.shape for a in actions if a is not None), (0, 0))
        body = {
            "id": f"actgen-{uuid.uuid4().hex}",
            "object": "action.generation",
            "created": int(time.time()),
            "model": self.identity["model"],
            "data": data,
            "usage": {"batch_size": len(results), "action_horizon": shape[0], "action_dim": shape[1],
                      "denoise_steps": self._steps(generation)},
        }
        warnings = sorted({w for r in answered for w in r.warnings})
        if warnings:
            body["warnings"] = warnings
        if generation.return_timing:
            body["timings"] = {k: timings[k] for k in
                               ("decode_ms", "queue_ms", *MODEL_STAGES, "encode_ms", "total_ms")
                               if k in timings}
        return body

    def _steps(self, generation: Generation) -> int:
        request = next((r for r in generation.requests if isinstance(r, Request)), None)
        return (request.num_steps if request is not None and request.num_steps else
                self.identity["num_inference_steps"])


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
