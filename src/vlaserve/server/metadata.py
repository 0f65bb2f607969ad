"""The metadata a client reads (GET /v1/actions/metadata, and each websocket's first frame)."""

from __future__ import annotations

from ..processing.images import MAX_IMAGE_SIDE
from ..types import MAX_GUIDANCE_WEIGHT, MAX_INFERENCE_STEPS, MAX_NOISE_ABS, MAX_RTC_ABS, MAX_TASK_CHARS
from .codec import MAX_NESTING_DEPTH
from .settings import ROUTES, ServerSettings


def public_metadata(m: dict, settings: ServerSettings, batch_limit: int) -> dict:
    """SGLang's action.metadata structure (input, output, defaults, capabilities: what its clients
    read), with vlaserve's own fields beside it (the flat ones OpenPI clients read, limits, protocols)."""
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
                     "output_format": {"json": "list", "msgpack": "numpy"},
                     "return_noise": False, "return_trace": False},
        "capabilities": {"exact_prefix_cache": cache, "cuda_graph": graphs, "realtime_websocket": True,
                         "openpi_websocket": True, "batch_inputs": True,
                         "max_batch_size": batch_limit, "multiple_candidates": False,
                         "rtc": True, "per_item_seeds": True, "return_noise": True, "return_trace": True,
                         "batch_invariant": m["batch_invariant"]},
        "limits": {"max_inference_steps": MAX_INFERENCE_STEPS, "max_payload_bytes": settings.max_payload_bytes,
                   "max_batch_size": batch_limit, "batch_delay_ms": settings.batch_delay_ms,
                   "max_task_chars": MAX_TASK_CHARS, "max_image_side": MAX_IMAGE_SIDE,
                   "max_nesting_depth": MAX_NESTING_DEPTH, "max_noise_abs": MAX_NOISE_ABS,
                   "max_guidance_weight": MAX_GUIDANCE_WEIGHT, "max_rtc_abs": MAX_RTC_ABS,
                   "body_timeout_s": settings.body_timeout_s},
        "protocols": {
            "http": {"path": ROUTES["http"], "content_types": ["application/json", "application/msgpack"]},
            "realtime": {"path": ROUTES["realtime"], "encoding": "msgpack"},
            "openpi": {"path": ROUTES["openpi"], "also_at": "/", "encoding": "msgpack-numpy"},
        },
        "camera_aliases": settings.camera_aliases,
        # What vlaserve_client reads: RTC on /v1 routes, and in which spaces prev_chunk may come.
        "features": {"rtc": True, "rtc_spaces": ["model"] if m["relative_actions"] else ["model", "action"]},
    }
