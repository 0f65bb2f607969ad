"""What every route shares: the policy, its batcher, settings and metrics, and the steps common to
all protocols (authorize, validate, infer, time)."""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import InvalidInput, NonFiniteActions
from ..processing.images import MAX_IMAGE_SIDE
from ..processing.layouts import KeyLayout, camera_aliases
from ..runtime.batcher import Batcher, BatcherClosed
from ..types import MAX_GUIDANCE_WEIGHT, MAX_INFERENCE_STEPS, MAX_NOISE_ABS, MAX_RTC_ABS, MAX_TASK_CHARS, Request
from .codec import MAX_NESTING_DEPTH
from .metrics import Metrics
from .schema import ApiError, Generation, api_error, parse_generation
from .sessions import Sessions
from .workers import Workers

MODEL_STAGES = ("preprocess_ms", "prefix_ms", "denoise_ms", "device_ms", "postprocess_ms")
# Where the host time around the device goes (OpenPI's policy_timing carries them too): checking and
# preparing the request on a worker thread, waiting in the queue, the batch's whole run on the
# inference thread, and the hand-back of its result to the event loop.
HOST_STAGES = ("prepare_ms", "queue_ms", "run_ms", "handback_ms")
TICKET_LIFETIME_S = 60.0
ROUTES = {"http": "/v1/actions/generations", "realtime": "/v1/actions/realtime", "openpi": "/openpi/policy"}


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    max_payload_bytes: int = 64 * 2**20
    max_batch_size: int = 8
    batch_delay_ms: float = 0.0
    camera_aliases: dict[str, str] = field(default_factory=camera_aliases)
    body_timeout_s: float = 60.0
    allowed_origins: tuple[str, ...] = ()  # browser origins that may call; "*" for any
    # Decoding and preprocessing, off the event loop: threads, decode processes, and the most jobs
    # waiting or running before new ones get 503.
    worker_threads: int = 4
    decode_processes: int = 1
    max_pending: int = 64
    # Enqueue the next batch on the device while this one runs (runtime/batcher.py); False: one at a time.
    overlap: bool = True

    @classmethod
    def from_options(cls, options: Mapping, runtime) -> "ServerSettings":
        """What `vlaserve serve` and each `serve-ray` replica build from the same options (cli.serve_options)."""
        return cls(api_key=options["api_key"], max_payload_bytes=int(options["max_payload_mb"] * 2**20),
                   max_batch_size=runtime.batch_limit, batch_delay_ms=options["batch_delay_ms"],
                   camera_aliases=camera_aliases(options["camera_aliases"]), body_timeout_s=options["body_timeout_s"],
                   allowed_origins=tuple(o.strip() for o in (options["allowed_origins"] or "").split(",") if o.strip()),
                   overlap=not options["serial_batches"])


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def policy_timing(model_timings: Mapping[str, float]) -> dict[str, float]:
    """OpenPI's `policy_timing`: the policy's stages (queue excluded)."""
    return {k: float(model_timings[k]) for k in (*MODEL_STAGES, *HOST_STAGES) if k in model_timings}


class Service:
    def __init__(self, policy, settings: ServerSettings):
        self.policy = policy
        self.settings = settings
        # What the hot path reads, fixed at startup (the live metadata is built per metadata request).
        m = policy.metadata
        self.identity = {"model": m["model"], "checkpoint": m["checkpoint"], "is_demo": m["is_demo"]}
        self.layout = KeyLayout(tuple(m["cameras"]), settings.camera_aliases, m["rename_map"])
        self.metrics = Metrics(settings.max_batch_size)
        self.metrics.watch_runtime(policy.runtime.stats)
        self.batcher: Batcher | None = None
        self.workers: Workers | None = None
        self.sessions = Sessions()
        # Where a websocket handshake is sent instead of being accepted here (a URL), or None to
        # accept it: serve-ray's direct websockets set this (fleet/direct.py).
        self.websocket_redirect: Callable[[Mapping], str | None] | None = None

    def start(self) -> None:
        self.policy.runtime.limit_host_threads()
        self.workers = Workers(self.settings.worker_threads, self.settings.decode_processes, self.settings.max_pending)
        self.workers.start()
        self.batcher = Batcher(self.policy, self.settings.max_batch_size, self.settings.batch_delay_ms,
                               on_batch=self.metrics.batch_size.observe, overlap=self.settings.overlap)

    def stop(self) -> None:
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
        m = self.metadata
        return {
            "object": "model.metadata",
            **m,
            "defaults": {"num_inference_steps": m["num_inference_steps"], "return_timing": False,
                         "response_format": "envelope", "output_format": {"json": "list", "msgpack": "numpy"}},
            "limits": {"max_inference_steps": MAX_INFERENCE_STEPS, "max_payload_bytes": self.settings.max_payload_bytes,
                       "max_batch_size": self.settings.max_batch_size, "batch_delay_ms": self.settings.batch_delay_ms,
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
            # What vlaserve_client reads: RTC on /v1 routes, and in which spaces prev_chunk may come.
            "features": {"rtc": True, "rtc_spaces": ["model"] if m["relative_actions"] else ["model", "action"]},
        }

    async def prepare(self, request: Request, in_request_body: bool) -> Request:
        """Checks the request against the checkpoint and preprocesses it, on a worker thread: the
        prepared request is what gets batched, so an observation is preprocessed once, and preparing
        the next batch overlaps the device's work on this one. (Preparing cheap requests on the event
        loop instead saved 1.1 ms at one robot but fragmented the batches of 4-8 robots: run 24.)"""
        try:
            await self.workers.in_thread(self.policy.prepare, request)
        except InvalidInput as e:
            raise api_error(e, in_request_body) from None
        return request

    async def infer(self, request: Request, in_request_body: bool):
        """Prepares, queues and runs one request. Returns the InferenceResult; its timings hold
        queue_ms and the model stages."""
        started = time.perf_counter()
        await self.prepare(request, in_request_body)
        prepared = time.perf_counter()
        try:
            with self.metrics.in_flight.track_inprogress():
                result = await self.batcher.submit(request)
            result.timings["prepare_ms"] = (prepared - started) * 1e3
            result.timings["handback_ms"] = ms_since(result.timings.pop("done_at"))
            return result
        except BatcherClosed as e:
            raise ApiError(503, "shutting_down", str(e)) from None
        except InvalidInput as e:
            raise api_error(e, in_request_body) from None
        except NonFiniteActions as e:
            raise ApiError(422, "non_finite_actions", str(e)) from None
        except Exception:  # the batcher logged it, with its traceback
            raise ApiError(500, "internal_error", "inference failed; see the server log") from None

    async def generate(self, body, started: float, msgpack_response: bool,
                       client: object = None) -> tuple[Generation, object, dict]:
        """Validates a /v1 request body and runs it. Returns the request, the InferenceResult and
        the timings so far (decode, queue, model stages). `client`: the connection it came on."""
        generation = parse_generation(body, self.identity, self.layout, msgpack_response)
        generation.request.client = client
        timings = {"decode_ms": ms_since(started)}
        result = await self.infer(generation.request, in_request_body=True)
        timings["queue_ms"] = result.timings["queue_ms"]
        timings.update({k: result.timings[k] for k in MODEL_STAGES if k in result.timings})
        return generation, result, timings

    def reply(self, generation: Generation, result, timings: dict, started: float) -> dict:
        """The response body. `encode_ms` covers converting the actions to their wire form; the final
        serialization of the body follows the timings it contains, so it can't be in them."""
        encode_start = time.perf_counter()
        actions = result.actions
        values = actions if generation.output_format == "numpy" else actions.tolist()
        timings["encode_ms"] = ms_since(encode_start)
        timings["total_ms"] = ms_since(started)
        self.metrics.observe_stages(timings)
        if generation.response_format == "raw":
            server = {k: timings[k] for k in ("decode_ms", "queue_ms", "encode_ms", "total_ms")}
            return {"actions": values, "server_timing": server, "policy_timing": policy_timing(result.timings)}
        body = {
            "id": f"actgen-{uuid.uuid4().hex}",
            "object": "action.generation",
            "created": int(time.time()),
            "model": self.identity["model"],
            "data": [{"index": 0, "action": {"values": values, "shape": list(actions.shape),
                                             "dtype": str(actions.dtype)}}],
        }
        if result.warnings:
            body["warnings"] = result.warnings
        if generation.return_timing:
            body["timings"] = {k: timings[k] for k in
                               ("decode_ms", "queue_ms", *MODEL_STAGES, "encode_ms", "total_ms")
                               if k in timings}
        return body
