"""The one table of observation key layouts: how OpenPI / LeRobot / ALOHA / DROID / LIBERO keys map
onto a checkpoint's cameras, state and task. The server and `Policy.infer` both use it.

Cameras resolve by *role* (base, left wrist, right wrist): a robot's `observation/image` feeds
whichever checkpoint camera plays the base role, be it `base_0_rgb` or LeRobot LIBERO's `image`.
A key is resolved, in this order, by
1. the config's `camera_aliases` (key -> camera; `null` ignores the key),
2. the default ignored keys (ALOHA's `cam_low`, which OpenPI's ALOHA policy drops too),
3. the checkpoint's rename map (LeRobot `observation.*` keys, one simultaneous pass, as the
   reference's rename step; keys of the other layouts are never renamed),
4. the camera's own name, then its role.
An image key that maps to no camera, or any other unknown key, is an error with a "did you mean",
never silently dropped: a policy that quietly runs without its wrist camera looks fine and acts wrong.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

import numpy as np

from ..errors import CheckpointError, InvalidObservation

# Camera (or observation) name -> role. Names of a checkpoint's cameras and of robots' keys alike.
NAME_ROLES: dict[str, str] = {
    "base_0_rgb": "base", "left_wrist_0_rgb": "left_wrist", "right_wrist_0_rgb": "right_wrist",  # OpenPI / LeRobot pi05
    "image": "base", "image2": "left_wrist",  # LeRobot LIBERO datasets
    "wrist_image": "left_wrist",  # OpenPI LIBERO: observation/image, observation/wrist_image
    "cam_high": "base", "cam_left_wrist": "left_wrist", "cam_right_wrist": "right_wrist",  # ALOHA
    "exterior_image_1_left": "base", "wrist_image_left": "left_wrist",  # DROID
}
IGNORED_KEYS = frozenset({"images.cam_low"})  # ALOHA's low camera: OpenPI's ALOHA inputs drop it

STATE_KEYS = ("state", "observation/state", "observation.state")
# DROID sends the state in two parts; OpenPI's DroidInputs concatenates them in this order.
STATE_PARTS = ("observation/joint_position", "observation/gripper_position")
TASK_KEYS = ("task", "prompt")
NOISE_KEYS = ("noise", "observation.noise")  # SGLang's OpenPI socket takes the LeRobot-style name too
PASSED_THROUGH = ("noise", "images_normalized")
LEROBOT_IMAGE_PREFIX = "observation.images."
IMAGE_PREFIXES = ("images.", LEROBOT_IMAGE_PREFIX, "observation/")


def camera_aliases(overrides: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """The config's aliases, checked for type: key -> camera name, or None to ignore the key."""
    aliases = dict(overrides or {})
    for key, camera in aliases.items():
        if camera is not None and not isinstance(camera, str):
            raise ValueError(f"camera_aliases[{key!r}] must be a camera name or null")
    return aliases


def check_camera_aliases(aliases: Mapping[str, str | None], cameras: tuple[str, ...]) -> None:
    """At startup: an alias must point at a camera of the checkpoint (or be null)."""
    wrong = {key: camera for key, camera in aliases.items() if camera is not None and camera not in cameras}
    if wrong:
        raise CheckpointError(f"camera_aliases point at cameras this checkpoint lacks: {wrong} "
                              f"(its cameras: {', '.join(cameras)})")


def _did_you_mean(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, sorted(set(candidates)), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


class KeyLayout:
    """Observation keys of any supported layout -> `{"images": {camera: image}, "state", "task", ...}`."""

    def __init__(self, cameras: tuple[str, ...], aliases: Mapping[str, str | None] | None = None,
                 rename_map: Mapping[str, str] | None = None):
        self.cameras = tuple(cameras)
        self.aliases = dict(aliases or {})
        self.rename_map = dict(rename_map or {})
        by_role: dict[str, list[str]] = {}
        for camera in self.cameras:
            if camera in NAME_ROLES:
                by_role.setdefault(NAME_ROLES[camera], []).append(camera)
        # A role two cameras share is ambiguous: those cameras take their own names only.
        self.role_camera = {role: cams[0] for role, cams in by_role.items() if len(cams) == 1}

    # ---- cameras --------------------------------------------------------------------------
    def camera_for(self, key: str, name: str | None) -> str | None:
        """The camera image key `key` (whose camera part is `name`) feeds; None: the key is ignored."""
        if key in self.aliases:
            camera = self.aliases[key]
            if camera is not None and camera not in self.cameras:
                raise InvalidObservation(key, f"is aliased to {camera!r}, which this checkpoint lacks "
                                              f"({', '.join(self.cameras)})")
            return camera
        if key in IGNORED_KEYS:
            return None
        renamed = self.rename_map.get(key, key)
        if renamed != key and renamed.startswith(LEROBOT_IMAGE_PREFIX):
            name = renamed[len(LEROBOT_IMAGE_PREFIX):]
        if name in self.cameras:
            return name
        camera = self.role_camera.get(NAME_ROLES.get(name or ""))
        if camera is not None:
            return camera
        raise InvalidObservation(key, f"maps to no camera of this checkpoint ({', '.join(self.cameras)}); "
                                      "add it to camera_aliases in the server config (null ignores it)"
                                 + _did_you_mean(key, self._camera_keys(key)))

    def _camera_keys(self, key: str) -> list[str]:
        """Keys in `key`'s style that would resolve to a camera, for "did you mean"."""
        names = set(self.cameras) | {n for n, role in NAME_ROLES.items() if role in self.role_camera}
        prefix = next((p for p in IMAGE_PREFIXES if key.startswith(p)), "")
        return [prefix + n for n in names] + [k for k, c in self.aliases.items() if c is not None]

    # ---- whole observations ---------------------------------------------------------------
    def canonical(self, raw: Mapping) -> dict:
        """Rewrites an observation of any supported layout into the keys Policy.prepare reads.
        Values pass through untouched, except DROID's state parts, which are concatenated."""
        if not isinstance(raw, Mapping):
            raise InvalidObservation("observation", "expected a mapping of observation keys to values")
        images: dict[str, object] = {}
        out: dict[str, object] = {"images": images}
        parts: dict[str, object] = {}

        def add_image(key: str, name: str | None, value) -> None:
            camera = self.camera_for(key, name)
            if camera is None:
                return
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
            if key in self.aliases and self.aliases[key] is None:
                continue  # ignored by the config, whatever the key is
            renamed = self.rename_map.get(key, key) if key.startswith("observation.") else key
            if key == "images":
                if not isinstance(value, Mapping):
                    raise InvalidObservation("images", "must be a map from camera name to image")
                for name, image in value.items():
                    add_image(f"images.{name}", str(name), image)
            elif key in NOISE_KEYS:
                set_once("noise", key, value)
            elif key in PASSED_THROUGH:  # before the image keys: `images_normalized` is no camera
                out[key] = value
            elif renamed in STATE_KEYS:
                set_once("state", key, value)
            elif key in STATE_PARTS:
                parts[key] = value
            elif key in TASK_KEYS:
                set_once("task", key, value)
            elif key.startswith(LEROBOT_IMAGE_PREFIX):
                add_image(key, key[len(LEROBOT_IMAGE_PREFIX):], value)
            elif key in self.aliases or "image" in key.lower():
                add_image(key, key.removeprefix("observation/"), value)
            else:
                known = [*STATE_KEYS, *STATE_PARTS, *TASK_KEYS, *PASSED_THROUGH,
                         *self._camera_keys("observation/"), *self._camera_keys(LEROBOT_IMAGE_PREFIX)]
                raise InvalidObservation(key, "unknown observation key (state is 'state', the task 'prompt' or "
                                              "'task')" + _did_you_mean(key, known))
        if parts:
            set_once("state", next(iter(parts)), _droid_state(parts))
        return out


def _droid_state(parts: dict) -> np.ndarray:
    missing = [k for k in STATE_PARTS if k not in parts]
    if missing:
        raise InvalidObservation(missing[0], f"missing: DROID's state is {' + '.join(STATE_PARTS)}")
    arrays = []
    for key in STATE_PARTS:
        try:
            arrays.append(np.atleast_1d(np.asarray(parts[key], dtype=np.float32)))
        except (TypeError, ValueError):
            raise InvalidObservation(key, "expected numbers") from None
        if arrays[-1].ndim != 1:
            raise InvalidObservation(key, f"expected a vector, got shape {list(arrays[-1].shape)}")
    return np.concatenate(arrays)
