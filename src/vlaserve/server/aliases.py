"""Kept for the server's imports: the key-layout table lives in vlaserve.processing.layouts."""

from ..processing.layouts import (  # noqa: F401
    LEROBOT_IMAGE_PREFIX,
    STATE_KEYS,
    TASK_KEYS,
    camera_aliases,
    canonical_observation,
    check_camera_aliases,
    resolve_camera,
)
