"""POST /update_weights_from_disk, SGLang's route and request: its body checked, the policy's refusals as HTTP
errors (Policy.update_weights does the work)."""

from __future__ import annotations

import json

from ..errors import WeightUpdateRefused
from .schema import ApiError, invalid

PATH = "/update_weights_from_disk"

# SGLang's optional fields this server takes, each with the values that describe what it does anyway (another
# value is refused, saying why); SGLang's others (is_async, keep_pause, token_step, ...) are unknown fields here.
OPTIONS = {
    "load_format": ((None, "auto", "safetensors"), "vlaserve reads safetensors checkpoints"),
    "flush_cache": ((True,), "the prefix cache is always emptied: its K/V are the old weights'"),
    "abort_all_requests": ((False,), "no request is aborted: batches already enqueued finish on the old weights"),
    "recapture_cuda_graph": ((False,), "nothing is re-captured: the CUDA graphs read the parameters in place"),
    "weight_version": ((None,), "the server counts versions itself: 0 for the weights it started with, +1 per "
                                "update"),
}
FIELDS = ("model_path", *OPTIONS)

# WeightUpdateRefused.reason -> (HTTP status, error type)
REFUSALS = {"not_found": (404, "checkpoint_not_found"), "mismatch": (422, "checkpoint_mismatch"),
            "unreadable": (422, "invalid_checkpoint"), "busy": (409, "update_in_progress"),
            "unavailable": (409, "update_unavailable")}


def model_path_of(body) -> str:
    """The body's checkpoint (`model_path`), its other fields checked; 422 naming a field that is unknown or
    asks for something this server does not do."""
    if not isinstance(body, dict):
        raise invalid(None, "expected a JSON object with model_path")
    unknown = sorted(str(k) for k in body if k not in FIELDS)
    if unknown:
        raise invalid(unknown[0], f"unknown field; this route takes {', '.join(FIELDS)}")
    path = body.get("model_path")
    if not isinstance(path, str) or not path.strip():
        raise invalid("model_path", "the checkpoint directory (a string) is required")
    for name, (accepted, why) in OPTIONS.items():
        if name in body and not any(_same(body[name], value) for value in accepted):
            raise invalid(name, f"only {' or '.join(map(json.dumps, accepted))} is accepted: {why}")
    return path


def refusal(error: WeightUpdateRefused) -> ApiError:
    status, kind = REFUSALS[error.reason]
    return ApiError(status, kind, error.message, "model_path" if status != 409 else None)


def _same(value, accepted) -> bool:
    """JSON equality: true is not 1."""
    return type(value) is type(accepted) and value == accepted
