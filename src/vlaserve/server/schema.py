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

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import InvalidInput, InvalidObservation
from ..processing.layouts import KeyLayout
from ..types import MAX_INFERENCE_STEPS, MAX_SEED, RTC_SCHEDULES, Observation, Request, RtcOptions
from .codec import DecodeError, tensor_object

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

    def in_batch(self, index: int, size: int) -> "ApiError":
        """The same error, its message naming the observation of a batch it is about."""
        return ApiError(self.status, self.type, f"observation {index} of {size}: {self.message}", self.field)


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
    task: str | list[str] | None = Field(None, description="the instruction, e.g. 'pick up the red block' "
                                                           "(a batch: one for all, or one per observation)")
    prompt: str | list[str] | None = Field(None, description="alias of task (OpenPI's name)")
    observation: ObservationIn


class ParametersIn(_Strict):
    num_inference_steps: int | None = Field(None, description=f"1..{MAX_INFERENCE_STEPS}; default: the checkpoint's")
    seed: int | list[int] | None = Field(
        None, description="0..2^63-1; seeds the noise when no noise is given. A batch: one seed per observation "
                          "(a list of B), or one for all (item i: seed + i)")
    action_horizon: int | None = Field(None, description="return this many leading actions (1..the checkpoint's "
                                                         "action_horizon); default all")
    action_dim: int | None = Field(None, description="the model's padded action dim (metadata "
                                                     "output.padded_action_dim); only that value is accepted")

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_list(cls, value):
        # The decoders turn a list of numbers into an ndarray (server.codec): a list of seeds is one.
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
            return [int(v) for v in value]
        return value


Toggle = bool | Literal["auto"]


class RuntimeIn(_Strict):
    return_timing: bool = Field(True, description="per-stage timings in the reply")
    output_format: Literal["list", "numpy"] | None = Field(
        None, description="list: nested lists; numpy: raw ndarrays in a msgpack reply (a JSON reply is "
                          "always lists). Default: numpy for msgpack replies, list for JSON")
    response_format: Literal["envelope", "raw"] = "envelope"
    prefix_cache: Toggle = Field("auto", description="false: skip the server's prefix cache (lookup and "
                                                     "store) for this request; true/auto: use it if enabled")
    cuda_graph: Toggle = Field("auto", description="false: run this request without CUDA graph replay (the same "
                                                   "math; batched apart); true/auto: use graphs if captured")
    return_noise: bool = Field(False, description="each item's output.noise: the noise its Euler loop started from "
                                                  "[action_horizon, max_action_dim]; sent back as "
                                                  "input.observation.noise it gives the same actions, bit for bit")
    return_trace: bool = Field(False, description="each item's output.trace: x before each Euler step and after the "
                                                  "last [num_inference_steps + 1, action_horizon, max_action_dim], "
                                                  "model space (runs without CUDA graph replay; batched apart)")


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
    """A validated /v1 request: one Request per observation (an ApiError where that observation is
    invalid: a batch answers it in its own item), and how to reply."""

    requests: list  # Request | ApiError
    batched: bool = False  # the batch form: B observations, answered as B items
    return_timing: bool = True
    output_format: str = "list"
    response_format: str = "envelope"
    action_horizon: int | None = None  # leading actions returned; None: all
    return_noise: bool = False  # each answered item's noise and Euler trace in the reply
    return_trace: bool = False


def parse_generation(body, identity: dict, layout: KeyLayout, msgpack_response: bool,
                     shape: dict | None = None) -> Generation:
    """`identity`: the served model's name, checkpoint and default step count; `layout`: the server's key table;
    `shape`: the checkpoint's action_horizon and padded_action_dim (checked when a request names them)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be an object")
    if "input" not in body:
        raise invalid("input", _MISSING_INPUT + (_OPENPI_HINT if any(_is_openpi_key(k) for k in body) else ""))
    try:
        parsed = GenerationRequest.model_validate(body)
    except ValidationError as e:
        raise _schema_error(e.errors()[0]) from None

    if parsed.model is not None and parsed.model not in identity["names"]:
        raise invalid("model", f"this server serves {identity['model']!r}, not {parsed.model!r}: omit `model`, "
                               f"send {identity['model']!r}, or start the server with "
                               f"--served-model-name {parsed.model}")
    inp, obs_in = parsed.input, parsed.input.observation
    if (inp.task is None) == (inp.prompt is None):
        raise invalid("input.task", "give exactly one of input.task and input.prompt")
    params, runtime = parsed.parameters, parsed.runtime
    horizon = _checked_shape(params, shape)
    # A JSON reply is always lists (SGLang's rule); msgpack replies default to ndarrays.
    output_format = (runtime.output_format or "numpy") if msgpack_response else "list"
    task = inp.task if inp.task is not None else inp.prompt
    images = {cam: tensor_field(image, f"input.observation.images.{cam}") for cam, image in obs_in.images.items()}
    state = tensor_field(obs_in.state, "input.observation.state")
    noise = tensor_field(obs_in.noise, "input.observation.noise")
    try:
        canonical = layout.canonical({"images": images})["images"]
    except InvalidInput as e:
        raise api_error(e, in_request_body=True) from None
    size = _batch_size(canonical, state, noise, task)
    rtc = None if parsed.rtc is None else parsed.rtc.model_dump()
    if size is not None and rtc is not None:
        raise invalid("rtc", "RTC guidance is for one observation; send batched observations without it")
    seeds = _seeds(params.seed, size)
    items = [(canonical, state, noise, task, seeds[0])] if size is None else [
        ({cam: image[i] for cam, image in canonical.items()}, state[i], None if noise is None else noise[i],
         task if isinstance(task, str) else task[i], seeds[i])
        for i in range(size)]
    requests = []
    for images_i, state_i, noise_i, task_i, seed_i in items:
        try:
            observation = Observation.create(images_i, state_i, task_i, obs_in.images_normalized)
            requests.append(Request.create(observation, noise_i, seed_i, params.num_inference_steps, rtc,
                                           default_steps=identity["num_inference_steps"],
                                           prefix_cache=runtime.prefix_cache is not False,
                                           cuda_graph=runtime.cuda_graph is not False,
                                           return_noise=runtime.return_noise, return_trace=runtime.return_trace))
        except InvalidInput as e:
            if size is None:
                raise api_error(e, in_request_body=True) from None
            requests.append(api_error(e, in_request_body=True))
    return Generation(requests, size is not None, runtime.return_timing, output_format, runtime.response_format,
                      horizon, runtime.return_noise, runtime.return_trace)


def _seeds(seed: int | list[int] | None, size: int | None) -> list:
    """Each observation's seed (None: unseeded). A list gives one per observation (a lone observation
    may send a list of one); an int on a batch of B seeds item i with seed + i, wrapped into the seeds'
    range. The values' range is checked per observation (Request.create)."""
    n = 1 if size is None else size
    if isinstance(seed, list):
        if len(seed) != n:
            what = f"the batch's {n} observations" if size is not None else "one observation"
            raise invalid("parameters.seed", f"a list of seeds holds one per observation: {len(seed)} given for {what}")
        return seed
    if seed is not None and 0 <= seed <= MAX_SEED:
        return [(seed + i) % (MAX_SEED + 1) for i in range(n)]
    return [seed] * n  # None, or a value every observation refuses alike


def tensor_field(value, field: str):
    """A tensor object as an ndarray (SGLang's JSON form of arrays), also in a list of them (a batch's
    images); anything else unchanged. A malformed one is a 422 naming `field`."""
    try:
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return [tensor_object(v) for v in value]
        return tensor_object(value)
    except DecodeError as e:
        raise invalid(field, str(e)) from None


def _checked_shape(params: ParametersIn, shape: dict | None) -> int | None:
    if shape is None:
        return params.action_horizon
    if params.action_dim is not None and params.action_dim != shape["padded_action_dim"]:
        raise invalid("parameters.action_dim", f"must be {shape['padded_action_dim']}, the model's padded action "
                                               f"dim (replies hold the robot's {shape['action_dim']} dims)")
    h = params.action_horizon
    if h is not None and not 1 <= h <= shape["action_horizon"]:
        raise invalid("parameters.action_horizon", f"must be in [1, {shape['action_horizon']}], the checkpoint's "
                                                   f"action horizon; got {h}")
    return h


def _batch_size(images: dict, state, noise, task) -> int | None:
    """B for the batch form (sgl-project/sglang#36301: every array field gains a leading batch dim,
    one task for all or a list of B), None for one observation. Mixed forms are a 422 naming the field."""
    batched = {}
    if isinstance(task, list):
        batched["input.task"] = len(task)
    if _per_observation(state, 1):
        batched["input.observation.state"] = len(state)
    if _per_observation(noise, 2):
        batched["input.observation.noise"] = len(noise)
    for cam, image in images.items():
        if _per_observation(image, 3) or (isinstance(image, list) and image and all(
                isinstance(i, (bytes, str)) for i in image)):  # PNG / JPEG frames, one per observation
            batched[f"input.observation.images.{cam}"] = len(image)
    if not batched:
        return None
    size = next(iter(batched.values()))
    for field, n in batched.items():
        if n != size:
            raise invalid(field, f"holds {n} observations, {next(iter(batched))} holds {size}")
    if size < 1:
        raise invalid(next(iter(batched)), "a batch needs at least one observation")
    if isinstance(task, list) and not all(isinstance(t, str) for t in task):
        raise invalid("input.task", "a list of tasks holds strings only")
    if state is None:
        raise invalid("input.observation.state", f"missing: a batched request gives each of its {size} observations "
                                                 f"a state, [B, state_dim]")
    unbatched = [f"input.observation.images.{cam}" for cam in images if f"input.observation.images.{cam}" not in batched]
    unbatched += [f for f, v in (("input.observation.state", state), ("input.observation.noise", noise))
                  if v is not None and f not in batched]
    if unbatched:
        raise invalid(unbatched[0], f"a batched request gives every observation its own value: a leading "
                                    f"dimension of {size} (noise [B, H, D], state [B, S], images [B, H, W, 3], "
                                    f"or a list of B images or PNG / JPEG frames)")
    return size


def _per_observation(value, rank: int) -> bool:
    """An array of `rank` + 1 dims, or a list of arrays of `rank` dims (msgpack and ragged JSON: their
    sizes may differ, and an item whose size is wrong fails alone)."""
    if isinstance(value, np.ndarray):
        return value.ndim == rank + 1
    return isinstance(value, list) and bool(value) and all(isinstance(v, np.ndarray) and v.ndim == rank for v in value)


_MISSING_INPUT = ('missing: a /v1 body is {"input": {"task": "...", "observation": {"images": {camera: image}, '
                  '"state": [...]}}} (docs/server.md)')
_OPENPI_HINT = ("; this body holds OpenPI observation keys: send it unchanged over the OpenPI websocket "
                "(openpi-client, ws://HOST:PORT), or put its keys under input.observation")


def _is_openpi_key(key) -> bool:
    return isinstance(key, str) and (key.startswith(("observation/", "observation.")) or key in (
        "prompt", "task", "images", "image", "state", "observation"))


# pydantic's words for a wrong JSON type, in the words of this API's fields.
_EXPECTED = {("input", "task"): "a string, or a list of strings (one per observation of a batch)",
             ("input", "prompt"): "a string, or a list of strings (one per observation of a batch)",
             ("parameters", "seed"): "an integer, or a list of integers (one per observation of a batch)"}


def _schema_error(error: dict) -> ApiError:
    """A 422 naming the field by its path in the body (pydantic appends the member of a union it tried,
    e.g. `input.task.str`: that part is dropped)."""
    loc = tuple(str(p) for p in error["loc"])
    while loc and error["type"] != "missing" and (loc[-1] in ("str", "int", "bool", "float", "none")
                                                  or "[" in loc[-1]):
        loc = loc[:-1]
    field = ".".join(loc) or None
    if error["type"] == "extra_forbidden":
        return invalid(field, "unknown field; the request schema is at GET /openapi.json (docs/server.md)")
    expected = _EXPECTED.get(loc)
    return invalid(field, f"expected {expected}" if expected else error["msg"])
