"""Request schema for /v1/actions (HTTP and the realtime websocket), and how validation errors
become HTTP errors.

Bodies arrive as JSON or msgpack and are decoded first; pydantic checks the structure here (missing
or extra fields, JSON types); the values are checked once, where the typed Request is built
(vlaserve.types), and what depends on the checkpoint by the policy. Both raise InvalidInput in the
Python API's field names, which `api_error` renames to the body's paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidInput, InvalidObservation
from ..processing.layouts import KeyLayout
from ..types import MAX_INFERENCE_STEPS, RTC_SCHEDULES, Observation, Request, RtcOptions

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


# Python API field -> its path in a /v1 request body (anything else lives under input.observation).
_BODY_PATHS = {"task": "input.task", "observation": "input.observation", "seed": "parameters.seed",
               "num_steps": "parameters.num_inference_steps"}


def api_error(error: InvalidInput, in_request_body: bool = False) -> ApiError:
    """422 naming the field: by its path in a /v1 request body, or as the Python API names it."""
    field = error.field
    if in_request_body and not field.startswith("rtc"):
        field = _BODY_PATHS.get(field, f"input.observation.{field}")
    kind = "invalid_observation" if isinstance(error, InvalidObservation) else "invalid_request"
    return ApiError(422, kind, error.message, field)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ObservationIn(_Strict):
    images: dict[str, Any] = Field(
        description="camera name -> image: HxWx3 or 3xHxW, uint8 values or floats in [0, 1]; or a PNG or JPEG "
                    "(msgpack bytes; in JSON base64 or a data:image/jpeg;base64, URL)")
    state: Any = Field(description="robot state, one number per state dimension")
    noise: Any = Field(None, description="optional flow-matching noise [action_horizon, max_action_dim]")
    images_normalized: bool = Field(False, description="float images are already in [-1, 1]")


class InputIn(_Strict):
    task: str | None = Field(None, description="the instruction, e.g. 'pick up the red block'")
    prompt: str | None = Field(None, description="alias of task (OpenPI's name)")
    observation: ObservationIn


class ParametersIn(_Strict):
    num_inference_steps: int | None = Field(None, description=f"1..{MAX_INFERENCE_STEPS}; default: the checkpoint's")
    seed: int | None = Field(None, description="0..2^63-1; seeds the noise when no noise is given")


class RuntimeIn(_Strict):
    return_timing: bool = False
    output_format: Literal["list", "numpy"] | None = Field(
        None, description="list: nested lists; numpy: a raw ndarray (msgpack responses only). "
                          "Default: numpy for msgpack responses, list for JSON")
    response_format: Literal["envelope", "raw"] = "envelope"


class RtcIn(_Strict):
    """Real-time chunking guidance (vlaserve.types.RtcOptions checks the values)."""

    prev_chunk: Any = Field(description="the previous chunk's unexecuted actions [T, D]")
    space: Literal["model", "action"] = RtcOptions.space
    inference_delay: int = Field(RtcOptions.inference_delay, description="control steps until the new chunk runs; >= 0")
    execution_horizon: int = Field(RtcOptions.execution_horizon, description="leading steps guided; >= 1")
    max_guidance_weight: float = Field(RtcOptions.max_guidance_weight, description="finite, >= 0")
    schedule: Literal[RTC_SCHEDULES] = RtcOptions.schedule


class GenerationRequest(_Strict):
    model: str | None = Field(None, description="if given, must name the served model")
    input: InputIn
    parameters: ParametersIn = ParametersIn()
    runtime: RuntimeIn = RuntimeIn()
    rtc: RtcIn | None = None


@dataclass
class Generation:
    """A validated /v1 request: the Request for the policy, and how to reply."""

    request: Request
    return_timing: bool = False
    output_format: str = "list"
    response_format: str = "envelope"


def parse_generation(body, identity: dict, layout: KeyLayout, msgpack_response: bool) -> Generation:
    """`identity`: the served model's name, checkpoint and default step count; `layout`: the server's key table."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be an object")
    try:
        parsed = GenerationRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        raise invalid(".".join(str(p) for p in error["loc"]) or None, error["msg"]) from None

    if parsed.model is not None and parsed.model not in (identity["model"], identity["checkpoint"]):
        raise invalid("model", f"this server serves {identity['model']!r}, not {parsed.model!r}")
    inp, obs_in = parsed.input, parsed.input.observation
    if (inp.task is None) == (inp.prompt is None):
        raise invalid("input.task", "give exactly one of input.task and input.prompt")
    runtime = parsed.runtime
    output_format = runtime.output_format or ("numpy" if msgpack_response else "list")
    if output_format == "numpy" and not msgpack_response:
        raise invalid("runtime.output_format", "numpy output needs a msgpack response "
                                               "(Accept: application/msgpack)")
    try:
        canonical = layout.canonical({"images": obs_in.images})
        observation = Observation.create(canonical["images"], obs_in.state,
                                         inp.task if inp.task is not None else inp.prompt, obs_in.images_normalized)
        rtc = None if parsed.rtc is None else RtcOptions.create(parsed.rtc.model_dump())
        request = Request.create(observation, obs_in.noise, parsed.parameters.seed,
                                 parsed.parameters.num_inference_steps, rtc,
                                 default_steps=identity["num_inference_steps"])
    except InvalidInput as e:
        raise api_error(e, in_request_body=True) from None
    return Generation(request, runtime.return_timing, output_format, runtime.response_format)
