"""The data that crosses layers: one typed `Request` flows from the API (server or Python) to the
runner unchanged, and an `InferenceResult` comes back.

Checks that depend only on the values (types, finiteness, ranges) happen here, once, where a request
is built from what a client sent; checks that depend on the checkpoint (cameras, dims, shapes) are the
policy's. Every check raises an `InvalidInput` naming the field in the Python API's terms ("state",
"rtc.prev_chunk", "num_steps"); the server renames fields to its wire paths.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import InvalidObservation, InvalidRequest

# A request may ask for more Euler steps than the checkpoint's default, but one request must not be
# able to hold the inference worker for minutes.
MAX_INFERENCE_STEPS = 100
# Seeds of the noise's generator (torch.Generator.manual_seed takes any 64-bit value; the wire's
# integers are signed).
MAX_SEED = 2**63 - 1
# Bounds on what a request may carry, checked before any work (docs/server.md#limits). A longer task
# would only be truncated at the model's token length, after tokenizing it (which holds the GIL: a
# 16 MB task stalled every client for 20 s).
MAX_TASK_CHARS = 4096
# Flow-matching noise is standard normal: 100 sigma is never drawn, and larger values overflow.
MAX_NOISE_ABS = 100.0
# RTC: LeRobot's default guidance weight is 10; previous chunks are actions (robot units or
# normalized), far below this. Larger values overflow float32 inside the guidance.
MAX_GUIDANCE_WEIGHT = 1000.0
MAX_RTC_ABS = 1e6
RTC_SPACES = ("model", "action")
RTC_SCHEDULES = ("linear", "exp", "ones", "zeros")


def _numeric(value, field: str, error=InvalidRequest) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except (ValueError, TypeError):
            raise error(field, "must be a (nested) list of numbers with a regular shape") from None
    if value.dtype.kind not in "iuf":
        raise error(field, f"must hold numbers, got dtype {value.dtype}")
    return value


def float_array(value, field: str, ndim: int | None = None, max_abs: float | None = None) -> np.ndarray:
    """A finite float32 array of rank `ndim` (if given), its values within ±max_abs (if given)."""
    if value is None:
        raise InvalidRequest(field, "missing")
    array = _numeric(value, field).astype(np.float32, copy=False)
    if ndim is not None and array.ndim != ndim:
        raise InvalidRequest(field, f"must have rank {ndim}, got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise InvalidRequest(field, "must be finite (no NaN or inf)")
    if max_abs is not None and array.size and np.abs(array).max() > max_abs:
        raise InvalidRequest(field, f"values must lie in [-{max_abs:g}, {max_abs:g}]")
    return array


@dataclass(frozen=True)
class EncodedImage:
    """A PNG or JPEG camera frame as sent: bytes (msgpack), or base64 text (a data URL too). It is
    decoded when the request is prepared (processing.encoded), on a worker thread."""

    data: bytes | str


def image_array(value, field: str) -> np.ndarray | EncodedImage:
    """uint8 pixels stay bytes; other integers must be bytes in value; floats become float32. A PNG or
    JPEG (bytes, or base64 text) is kept as sent: Policy.prepare checks and decodes it, off the event loop."""
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return EncodedImage(value if isinstance(value, str) else bytes(value))
    array = _numeric(value, field)
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind in "iu":
        if array.size and (array.min() < 0 or array.max() > 255):
            raise InvalidRequest(field, "integer pixel values must be in 0..255")
        return array.astype(np.uint8)
    return array.astype(np.float32, copy=False)


def _integer(value, field: str, low: int, high: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(field, f"must be an integer in [{low}, {high}]")
    return int(value)


def _flag(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(field, "must be true or false")
    return value


@dataclass(frozen=True)
class Observation:
    """What the robot saw, with images keyed by the checkpoint's camera names."""

    images: dict[str, np.ndarray | EncodedImage]  # camera -> HxWx3 or 3xHxW, uint8 or float32; or a PNG/JPEG
    state: np.ndarray  # float32 [state_dim], raw (un-normalized)
    task: str
    images_normalized: bool = False  # float images already in [-1, 1]

    @staticmethod
    def create(images: dict, state, task, images_normalized: bool = False) -> "Observation":
        if not isinstance(images, dict):
            raise InvalidObservation("images", "expected a mapping camera -> image")
        if not isinstance(task, str):
            raise InvalidRequest("task", "expected a string")
        if not task.strip():
            raise InvalidRequest("task", "is empty; give the instruction, e.g. 'pick up the red block'")
        if len(task) > MAX_TASK_CHARS:
            raise InvalidRequest("task", f"at most {MAX_TASK_CHARS} characters, got {len(task)}")
        if not isinstance(images_normalized, bool):
            raise InvalidRequest("images_normalized", "must be true or false")
        arrays = {cam: image_array(image, f"images.{cam}") for cam, image in images.items() if image is not None}
        if not arrays:
            raise InvalidObservation("images", "no camera image: send at least one")
        return Observation(arrays, float_array(state, "state", ndim=1), task, images_normalized)


@dataclass(frozen=True)
class RtcOptions:
    """Real-time chunking guidance: pull the new chunk's start towards the previous chunk's
    unexecuted actions. The defaults here are the only ones (the server's schema shows them)."""

    prev_chunk: np.ndarray  # [T, D] float32: model space (D <= max_action_dim) or action space (D = action_dim)
    space: str = "model"
    inference_delay: int = 0
    execution_horizon: int = 10
    max_guidance_weight: float = 10.0
    schedule: str = "linear"

    @staticmethod
    def create(options: dict) -> "RtcOptions":
        if not isinstance(options, dict):
            raise InvalidRequest("rtc", "expected a mapping")
        unknown = sorted(set(options) - set(RtcOptions.__dataclass_fields__))
        if unknown:
            raise InvalidRequest(f"rtc.{unknown[0]}", "unknown RTC option")
        given = {k: v for k, v in options.items() if v is not None}
        prev = float_array(given.get("prev_chunk"), "rtc.prev_chunk", ndim=2, max_abs=MAX_RTC_ABS)
        space = given.get("space", "model")
        if space not in RTC_SPACES:
            raise InvalidRequest("rtc.space", f"expected one of {', '.join(RTC_SPACES)}")
        schedule = given.get("schedule", "linear")
        schedule = schedule.lower() if isinstance(schedule, str) else schedule
        if schedule not in RTC_SCHEDULES:
            raise InvalidRequest("rtc.schedule", f"expected one of {', '.join(RTC_SCHEDULES)}")
        weight = given.get("max_guidance_weight", 10.0)
        if not isinstance(weight, (int, float, np.number)) or isinstance(weight, bool) or not (
                math.isfinite(weight) and 0 <= weight <= MAX_GUIDANCE_WEIGHT):
            raise InvalidRequest("rtc.max_guidance_weight", f"expected a number in [0, {MAX_GUIDANCE_WEIGHT:g}]")
        return RtcOptions(prev, space, _integer(given.get("inference_delay", 0), "rtc.inference_delay", 0, 2**31),
                          _integer(given.get("execution_horizon", 10), "rtc.execution_horizon", 1, 2**31),
                          float(weight), schedule)


@dataclass(frozen=True)
class PreparedObservation:
    """One observation after host preprocessing (what the model sees, plus how it got there)."""

    images: torch.Tensor  # [N, 3, S, S]: float32 in [-1, 1], or uint8 bytes; slots in the reference's order
    image_mask: torch.Tensor  # [N] bool
    slot_cameras: list[str]  # camera of each slot
    tokens: torch.Tensor  # [L] int64
    token_mask: torch.Tensor  # [L] bool
    normalized_state: np.ndarray  # float32 [state_dim]
    state_bins: np.ndarray | None  # int64 [state_dim]: the prompt's state (Pi0.5); None when the prompt has none
    prompt: str
    truncated: bool
    noise: torch.Tensor  # [H, max_action_dim] float32: given, seeded or drawn
    rtc: "PreparedRtc | None"
    # Camera frames whose resize-with-pad runs on the device (slot, raw [3, H, W]: uint8, or float
    # in [0, 1]); their slots in `images` hold a placeholder until then (runtime/transfer.py).
    pending: tuple[tuple[int, torch.Tensor], ...] = ()
    # The weight version whose normalization statistics prepared it (Preprocessor.weight_version): a request
    # prepared before a weight update is prepared again with the new statistics before it runs.
    weight_version: int = 0


@dataclass(frozen=True)
class PreparedRtc:
    prev: torch.Tensor  # [H, max_action_dim] model space, zero-padded
    weights: torch.Tensor  # [H] per-timestep guidance weights
    max_weight: float


@dataclass
class Request:
    """One observation and how to run it; the unit the batcher queues and the runner serves."""

    observation: Observation
    # Euler steps, resolved when the request is built (the checkpoint's num_inference_steps unless
    # asked otherwise): the batcher groups requests by it, so an explicit default batches with none.
    num_steps: int
    noise: np.ndarray | None = None  # float32 [action_horizon, max_action_dim]
    seed: int | None = None  # seeds the noise when none is given
    rtc: RtcOptions | None = None
    prepared: PreparedObservation | None = None  # set once, by Policy.prepare
    created_at: float = field(default_factory=time.perf_counter)
    client: object = None  # who sent it (a connection), so the batcher can expect the client's next request
    # Per-request runtime controls: False skips the prefix cache (lookup and store) / graph replay for
    # this request. True means "when the server has one"; graph-less requests are batched apart.
    prefix_cache: bool = True
    cuda_graph: bool = True
    # What the result carries beside the actions: the noise used, and x at every Euler step.
    return_noise: bool = False
    return_trace: bool = False

    @property
    def graphs(self) -> bool:
        """Whether the request may replay CUDA graphs: a traced one runs without (its Euler loop writes
        each step's x out, which a captured graph does not), batched apart like `cuda_graph` false."""
        return self.cuda_graph and not self.return_trace

    @staticmethod
    def create(observation: Observation, noise=None, seed=None, num_steps=None, rtc=None, *,
               default_steps: int, prefix_cache: bool = True, cuda_graph: bool = True,
               return_noise: bool = False, return_trace: bool = False) -> "Request":
        """`default_steps`: the checkpoint's num_inference_steps, for a request that names none."""
        return Request(
            observation,
            num_steps=default_steps if num_steps is None else _integer(num_steps, "num_steps", 1, MAX_INFERENCE_STEPS),
            noise=None if noise is None else float_array(noise, "noise", ndim=2, max_abs=MAX_NOISE_ABS),
            seed=None if seed is None else _integer(seed, "seed", 0, MAX_SEED),
            rtc=None if rtc is None else rtc if isinstance(rtc, RtcOptions) else RtcOptions.create(rtc),
            prefix_cache=prefix_cache, cuda_graph=cuda_graph,
            return_noise=_flag(return_noise, "return_noise"), return_trace=_flag(return_trace, "return_trace"))


@dataclass
class ModelInputs:
    """A batch, ready for the model: plain tensors with the batch dimension first."""

    images: torch.Tensor  # [B, N, 3, S, S]
    image_masks: torch.Tensor  # [B, N]
    tokens: torch.Tensor  # [B, L]
    token_mask: torch.Tensor  # [B, L]
    state: torch.Tensor | None = None  # [B, max_state_dim] float32, normalized and zero-padded (Pi0); None: Pi0.5
    # Raw frames (item, slot, [3, H, W]: uint8, or float in [0, 1]) resized into `images` on the device
    # (runtime/transfer.py).
    pending: tuple[tuple[int, int, torch.Tensor], ...] = ()

    def vision_slots(self) -> int:
        """How many leading camera slots any item uses (absent cameras come last in the slot order):
        the vision tower skips the rest. Reads the masks where they are (a device round trip if on
        the device)."""
        present = self.image_masks.any(0).tolist()
        return len(present) - present[::-1].index(True) if any(present) else 0


@dataclass
class RTCGuidance:
    """A batch's real-time chunking inputs (model/rtc.py guides the Euler steps with them): prev [B, H, A]
    (model space, zero-padded), weights [B, H] per-timestep guidance weights (all zero for items without
    RTC, which leaves them unguided exactly), max_weight [B]."""

    prev: torch.Tensor
    weights: torch.Tensor
    max_weight: torch.Tensor

    def to(self, device) -> "RTCGuidance":
        return RTCGuidance(*(t.to(device, non_blocking=True) for t in (self.prev, self.weights, self.max_weight)))


@dataclass
class InferenceResult:
    actions: np.ndarray  # float32 [horizon, action_dim], un-normalized
    model_actions: np.ndarray  # float32 [horizon, max_action_dim], model space
    timings: dict[str, Any] = field(default_factory=dict)  # TIMING_STAGES in ms, plus batch_size
    warnings: list[str] = field(default_factory=list)
    # Asked for with Request.return_noise / return_trace, else None. noise: float32 [horizon, max_action_dim],
    # the noise the Euler loop started from (sent back as the request's noise, it gives these actions
    # again, bit for bit); trace: float32 [num_steps + 1, horizon, max_action_dim], x before each Euler
    # step and after the last (trace[0] is the noise, trace[-1] model_actions), model space.
    noise: np.ndarray | None = None
    trace: np.ndarray | None = None


# Milliseconds per stage of one call, the same names on every route: decode and encode are the
# server's; queue, preprocess, prefix, denoise and postprocess the runtime's; device = prefix + denoise.
TIMING_STAGES = ("decode_ms", "queue_ms", "preprocess_ms", "prefix_ms", "denoise_ms", "device_ms",
                 "postprocess_ms", "encode_ms", "total_ms")
