"""How OpenPI / LeRobot / ALOHA observation keys map onto a checkpoint's cameras.

The one table of camera aliases. A key is looked up exactly as it appears in the observation, with
nested `images` dicts written as `images.<name>`. Cameras named exactly as in the checkpoint
(`images.base_0_rgb`, `observation.images.base_0_rgb`) need no alias. The config file's
`camera_aliases` is merged over the defaults; an alias set to null removes it.

An image key that maps to no camera is an error, never silently dropped: a policy that quietly
runs without its wrist camera looks fine and acts wrong.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import InvalidObservation

DEFAULT_CAMERA_ALIASES: dict[str, str] = {
    # OpenPI single-arm examples (LIBERO-style flat keys).
    "observation/image": "base_0_rgb",
    "observation/wrist_image": "left_wrist_0_rgb",
    # OpenPI ALOHA: {"images": {"cam_high": ..., "cam_left_wrist": ..., "cam_right_wrist": ...}}.
    "images.cam_high": "base_0_rgb",
    "images.cam_left_wrist": "left_wrist_0_rgb",
    "images.cam_right_wrist": "right_wrist_0_rgb",
}

STATE_KEYS = ("state", "observation/state", "observation.state")
TASK_KEYS = ("task", "prompt")
LEROBOT_IMAGE_PREFIX = "observation.images."


def camera_aliases(overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    merged: dict[str, str | None] = {**DEFAULT_CAMERA_ALIASES, **(overrides or {})}
    for key, camera in merged.items():
        if camera is not None and not isinstance(camera, str):
            raise ValueError(f"camera_aliases[{key!r}] must be a camera name or null")
    return {key: camera for key, camera in merged.items() if camera is not None}


def resolve_camera(key: str, name: str | None, cameras: tuple[str, ...], aliases: Mapping[str, str]) -> str:
    """The checkpoint camera that observation key `key` (whose last part is `name`) feeds."""
    if name in cameras:
        return name
    camera = aliases.get(key)
    if camera in cameras:
        return camera
    known = ", ".join(cameras)
    if camera is None:
        raise InvalidObservation(key, f"maps to no camera of this checkpoint ({known}); "
                                      "add it to camera_aliases in the server config")
    raise InvalidObservation(key, f"is aliased to {camera!r}, which this checkpoint lacks ({known})")


def canonical_observation(raw: Mapping, cameras: tuple[str, ...], aliases: Mapping[str, str]) -> dict:
    """Rewrites an OpenPI/LeRobot/ALOHA-style observation dict into the keys Policy expects:
    {"images": {camera: array}, "state", "task", optional "noise" and "images_normalized"}.
    Values are passed through untouched; the schema converts and checks them."""
    images: dict[str, object] = {}
    out: dict[str, object] = {"images": images}

    def add_image(key: str, name: str | None, value) -> None:
        camera = resolve_camera(key, name, cameras, aliases)
        if camera in images:
            raise InvalidObservation(key, f"a second image for camera {camera!r}")
        images[camera] = value

    def set_once(target: str, key: str, value) -> None:
        if target in out:
            raise InvalidObservation(key, f"{target} given twice")
        out[target] = value

    for key, value in raw.items():
        if not isinstance(key, str):
            raise InvalidObservation(repr(key), "observation keys must be strings")
        if key == "images":
            if not isinstance(value, Mapping):
                raise InvalidObservation("images", "must be a map from camera name to image")
            for name, image in value.items():
                add_image(f"images.{name}", name, image)
        elif key.startswith(LEROBOT_IMAGE_PREFIX):
            add_image(key, key[len(LEROBOT_IMAGE_PREFIX):], value)
        elif key in aliases or "image" in key.lower():
            add_image(key, None, value)  # an unaliased image key fails here, with the alias hint
        elif key in STATE_KEYS:
            set_once("state", key, value)
        elif key in TASK_KEYS:
            set_once("task", key, value)
        elif key in ("noise", "images_normalized"):
            out[key] = value
        else:
            raise InvalidObservation(key, "unknown observation key (state is 'state', the task 'prompt' or 'task')")
    return out
