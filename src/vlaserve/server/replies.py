"""The reply to a /v1 request, and the timings every protocol reports."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

import numpy as np

from ..types import Request
from .schema import ApiError, Generation

MODEL_STAGES = ("preprocess_ms", "prefix_ms", "denoise_ms", "device_ms", "postprocess_ms")
# Where the host time around the device goes (OpenPI's policy_timing carries them too): checking and
# preparing the request on a worker thread, waiting in the queue, the batch's whole run on the
# inference thread, and the hand-back of its result to the event loop; and, for a batch launched
# behind a running one, the device's time between the two (runtime/graphs.py EventTimes).
HOST_STAGES = ("prepare_ms", "queue_ms", "run_ms", "handback_ms", "launch_gap_ms")


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def policy_timing(model_timings: Mapping[str, float]) -> dict[str, float]:
    """OpenPI's `policy_timing`: the policy's stages, and the size of the batch the request ran in
    (the device time is that batch's)."""
    timing = {k: float(model_timings[k]) for k in (*MODEL_STAGES, *HOST_STAGES) if k in model_timings}
    if "batch_size" in model_timings:
        timing["batch_size"] = int(model_timings["batch_size"])
    return timing


def failed_status(results: list) -> int:
    """200 when any observation was answered, else the items' status (the highest where they differ)."""
    if any(not isinstance(r, ApiError) for r in results):
        return 200
    return max(r.status for r in results)


def reply_body(generation: Generation, results: list, timings: dict, started: float, identity: Mapping) -> dict:
    """The response body. `encode_ms` covers converting the arrays to their wire form; the final
    serialization of the body follows the timings it contains, so it can't be in them."""
    encode_start = time.perf_counter()
    h = generation.action_horizon
    actions = [None if isinstance(r, ApiError) else r.actions[:h] for r in results]
    arrays = {"actions": actions, **{name: [None if isinstance(r, ApiError) else getattr(r, name) for r in results]
                                     for name in _outputs(generation)}}
    raw = generation.response_format == "raw"
    wire = {name: _raw(values, generation) if raw else
            [None if a is None else _tensor(a, generation.output_format) for a in values]
            for name, values in arrays.items()}
    timings["encode_ms"] = ms_since(encode_start)
    timings["total_ms"] = ms_since(started)
    answered = [r for r in results if not isinstance(r, ApiError)]
    if raw:
        server = {k: timings[k] for k in ("decode_ms", "queue_ms", "encode_ms", "total_ms") if k in timings}
        body = {"server_timing": server}
        if answered:
            body["policy_timing"] = policy_timing(answered[-1].timings)
        body.update(wire)
        if generation.batched and len(answered) < len(results):  # an item failed: its values are null
            body["errors"] = [r.body()["error"] if isinstance(r, ApiError) else None for r in results]
        return body
    data = []
    for i, result in enumerate(results):
        item = {"index": i, "input_index": i, "candidate_index": 0}
        if isinstance(result, ApiError):
            item.update(result.body())
        else:
            item["action"] = {"type": "continuous", **wire["actions"][i]}
            if len(wire) > 1:
                item["output"] = {name: values[i] for name, values in wire.items() if name != "actions"}
        data.append(item)
    shape = next((a.shape for a in actions if a is not None), (0, 0))
    body = {
        "id": f"actgen-{uuid.uuid4().hex}",
        "object": "action.generation",
        "created": int(time.time()),
        "model": identity["model"],
        "data": data,
        "usage": {"batch_size": len(results), "action_horizon": shape[0], "action_dim": shape[1],
                  "denoise_steps": _steps(generation, identity["num_inference_steps"])},
    }
    warnings = sorted({w for r in answered for w in r.warnings})
    if warnings:
        body["warnings"] = warnings
    if generation.return_timing:
        body["timings"] = {k: timings[k] for k in
                           ("decode_ms", "queue_ms", *MODEL_STAGES, "encode_ms", "total_ms")
                           if k in timings}
    return body


def _outputs(generation: Generation) -> tuple[str, ...]:
    """What each answered item carries beside its actions (InferenceResult's field names, the reply's keys)."""
    return tuple(name for name, asked in (("noise", generation.return_noise), ("trace", generation.return_trace))
                 if asked)


def _tensor(array: np.ndarray, output_format: str) -> dict:
    """SGLang's tensor object: the form a request's arrays may take too (server.schema tensor_field), so
    an item's output.noise goes back as input.observation.noise unchanged. Lists hold each float32 value
    exactly (as doubles, which parse back to the same float32)."""
    return {"values": array if output_format == "numpy" else array.tolist(), "shape": list(array.shape),
            "dtype": str(array.dtype)}


def _raw(arrays: list, generation: Generation):
    """One field of a raw reply: the array of a lone observation; a batch's stacked [B, ...], or a list
    with null for each failed item."""
    numpy = generation.output_format == "numpy"
    if not generation.batched:
        return arrays[0] if numpy or arrays[0] is None else arrays[0].tolist()
    if all(a is not None for a in arrays):
        stacked = np.stack(arrays)
        return stacked if numpy else stacked.tolist()
    return [a if a is None or numpy else a.tolist() for a in arrays]


def _steps(generation: Generation, default: int) -> int:
    request = next((r for r in generation.requests if isinstance(r, Request)), None)
    return request.num_steps if request is not None and request.num_steps else default
