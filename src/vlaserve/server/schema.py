"""Request schema and request-level validation for /v1/actions (HTTP and the realtime websocket).

Bodies arrive as JSON or msgpack, so they are decoded first and then validated here: pydantic checks
the structure (missing/extra fields, types), numpy conversions check the arrays. What an observation
must look like for this checkpoint (cameras, shapes, state dim) is the Policy's to check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidObservation
from .aliases import resolve_camera

# A request may ask for more Euler steps than the checkpoint's default, but one request must not be
# able to hold the inference worker for minutes.
MAX_INFERENCE_STEPS = 100


class ApiError(Exception):
    """An error the client caused, reported as {"error": {"type", "field", "message"}}."""

    def __init__(self, status: int, type: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.field = field
        self.message = message

    def body(self) -> dict:
        return {"error": {"type": self.type, "field": self.field, "message": self.message}}


def invalid(field: str | None, message: str) -> ApiError:
    return ApiError(422, "invalid_request", message, field)


def invalid_observation(error: InvalidObservation, in_request_body: bool = False) -> ApiError:
    """`in_request_body`: name the field by its path in a /v1 request body (Policy names it in obs)."""
    field = error.field
    if in_request_body:
        field = "input.task" if field == "task" else f"input.observation.{field}"
    return ApiError(422, "invalid_observation", error.message, field)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ObservationIn(_Strict):
    images: dict[str, Any] = Field(
        description="camera name -> image: HxWx3 or 3xHxW, uint8 values or floats in [0, 1]")
    state: Any = Field(description="robot state, one number per state dimension")
    noise: Any = Field(None, description="optional flow-matching noise [action_horizon, max_action_dim]")
    images_normalized: bool = Field(False, description="float images are already in [-1, 1]")


class InputIn(_Strict):
    task: str | None = Field(None, description="the instruction, e.g. 'pick up the red block'")
    prompt: str | None = Field(None, description="alias of task (OpenPI's name)")
    observation: ObservationIn


class ParametersIn(_Strict):
    num_inference_steps: int | None = Field(None, ge=1, le=MAX_INFERENCE_STEPS)
    seed: int | None = Field(None, ge=0, lt=2**63, description="seeds the noise when no noise is given")


class RuntimeIn(_Strict):
    return_timing: bool = False
    prefix_cache: bool = Field(True, description="hint: the GPU engine may reuse a cached prefix")
    cuda_graph: bool = Field(True, description="hint: the GPU engine may replay a CUDA graph")
    output_format: Literal["list", "numpy"] | None = Field(
        None, description="list: nested lists; numpy: a raw ndarray (msgpack responses only). "
                          "Default: numpy for msgpack responses, list for JSON")
    response_format: Literal["envelope", "raw"] = "envelope"


class RtcIn(_Strict):
    """Real-time chunking guidance. Options left out take the Policy's defaults."""

    prev_chunk: Any = Field(description="the previous chunk's unexecuted actions [T, D]")
    space: Literal["model", "action"] = "model"
    inference_delay: int | None = Field(None, ge=0)
    execution_horizon: int | None = Field(None, ge=1)
    max_guidance_weight: float | None = Field(None, ge=0, allow_inf_nan=False)
    schedule: Literal["linear", "exp", "ones", "zeros"] | None = None


class GenerationRequest(_Strict):
    model: str | None = Field(None, description="if given, must name the served model")
    input: InputIn
    parameters: ParametersIn = ParametersIn()
    runtime: RuntimeIn = RuntimeIn()
    rtc: RtcIn | None = None


@dataclass
class Generation:
    """A validated request, ready for the batcher."""

    observation: dict
    noise: np.ndarray | None = None
    seed: int | None = None
    num_steps: int | None = None
    rtc: dict | None = None
    return_timing: bool = False
    output_format: str = "list"
    response_format: str = "envelope"
    hints: dict[str, bool] = field(default_factory=dict)


def _numeric(value, field: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except (ValueError, TypeError):
            raise invalid(field, "must be a (nested) list of numbers with a regular shape") from None
    if value.dtype.kind not in "iuf":
        raise invalid(field, f"must hold numbers, got dtype {value.dtype}")
    return value


def image_array(value, field: str) -> np.ndarray:
    array = _numeric(value, field)
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind in "iu":
        if array.size and (array.min() < 0 or array.max() > 255):
            raise invalid(field, "integer pixel values must be in 0..255")
        return array.astype(np.uint8)
    return array.astype(np.float32, copy=False)


def float_array(value, field: str, shape: tuple[int | None, ...] | None = None) -> np.ndarray:
    array = _numeric(value, field).astype(np.float32, copy=False)
    if shape is not None and (array.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(array.shape, shape))):
        wanted = "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"
        raise invalid(field, f"must have shape {wanted}, got {list(array.shape)}")
    if not np.isfinite(array).all():
        raise invalid(field, "must be finite (no NaN or inf)")
    return array


def noise_array(value, field: str, metadata: dict) -> np.ndarray:
    return float_array(value, field, (metadata["action_horizon"], metadata["max_action_dim"]))


def parse_generation(body, metadata: dict, aliases: dict[str, str], msgpack_response: bool) -> Generation:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be an object")
    try:
        request = GenerationRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        raise invalid(".".join(str(p) for p in error["loc"]) or None, error["msg"]) from None

    if request.model is not None and request.model not in (metadata["model"], metadata["checkpoint"]):
        raise invalid("model", f"this server serves {metadata['model']!r}, not {request.model!r}")

    inp, obs_in = request.input, request.input.observation
    if (inp.task is None) == (inp.prompt is None):
        raise invalid("input.task", "give exactly one of input.task and input.prompt")
    cameras = tuple(metadata["cameras"])
    images = {}
    for name, image in obs_in.images.items():
        key = f"images.{name}"
        try:
            camera = resolve_camera(key, name, cameras, aliases)
        except InvalidObservation as e:
            raise invalid_observation(e, in_request_body=True) from None
        if camera is None:  # ignored by the layout table or the config (e.g. ALOHA's cam_low)
            continue
        if camera in images:
            raise invalid(f"input.observation.{key}", f"a second image for camera {camera!r}")
        images[camera] = image_array(image, f"input.observation.{key}")
    observation = {"images": images, "state": float_array(obs_in.state, "input.observation.state"),
                   "task": inp.task if inp.task is not None else inp.prompt}
    if obs_in.images_normalized:
        observation["images_normalized"] = True

    runtime = request.runtime
    output_format = runtime.output_format or ("numpy" if msgpack_response else "list")
    if output_format == "numpy" and not msgpack_response:
        raise invalid("runtime.output_format", "numpy output needs a msgpack response "
                                               "(Accept: application/msgpack)")
    return Generation(
        observation=observation,
        noise=None if obs_in.noise is None else noise_array(obs_in.noise, "input.observation.noise", metadata),
        seed=request.parameters.seed,
        num_steps=request.parameters.num_inference_steps,
        rtc=None if request.rtc is None else rtc_dict(request.rtc, metadata),
        return_timing=runtime.return_timing,
        output_format=output_format,
        response_format=runtime.response_format,
        hints={"prefix_cache": runtime.prefix_cache, "cuda_graph": runtime.cuda_graph},
    )


def rtc_dict(rtc: RtcIn, metadata: dict) -> dict:
    horizon = metadata["action_horizon"]
    # Action-space chunks carry the robot's dims; model-space ones any prefix of the padded dims
    # (LeRobot's left-over has only the robot's dims and is zero-padded).
    width = metadata["action_dim"] if rtc.space == "action" else metadata["max_action_dim"]
    prev = float_array(rtc.prev_chunk, "rtc.prev_chunk", (None, None))
    if not 1 <= prev.shape[0] <= horizon or not 1 <= prev.shape[1] <= width or (
            rtc.space == "action" and prev.shape[1] != width):
        dims = f"D = {width}" if rtc.space == "action" else f"1 <= D <= {width}"
        raise invalid("rtc.prev_chunk", f"must have shape [T, D] with 1 <= T <= {horizon} and {dims} "
                                        f"for space {rtc.space!r}, got {list(prev.shape)}")
    return {**rtc.model_dump(exclude_none=True), "prev_chunk": prev}
