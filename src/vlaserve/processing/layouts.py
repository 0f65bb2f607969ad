"""The one table of observation key layouts: how OpenPI / LeRobot / ALOHA / DROID / LIBERO keys map
onto a checkpoint's cameras, state and task. The server and `Policy.infer` both use it.

Cameras resolve by *role* (base, left wrist, right wrist): a robot's `observation/image` feeds
whichever checkpoint camera plays the base role, be it `base_0_rgb` or LeRobot LIBERO's `image`.
A key is resolved, in this order, by
1. the config's `camera_aliases` (key -> camera; `null` ignores the key): an alias names the whole
   key (`observation.images.top`, `images.front`) or just its camera part (`top`, `front`), which
   is what a user writing a nested `images` dict sees; the whole key wins,
2. the default ignored keys (ALOHA's `cam_low`, which OpenPI's ALOHA policy drops too),
3. the checkpoint's rename map (LeRobot `observation.*` keys, one simultaneous pass, as the
   reference's rename step; keys of the other layouts are never renamed),
4. the camera's own name, then its role.
An image key that maps to no camera, or any other unknown key, is an error with a "did you mean",
never silently dropped: a policy that quietly runs without its wrist camera looks fine and acts wrong.
A suggestion is close in its camera part and feeds a camera the observation has not filled yet: a
key the request already sent is never suggested.
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
PASSED_THROUGH = ("images_normalized",)
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
    """At startup: an alias must point at a camera of the checkpoint (or be null), and its key must be
    one an image can arrive under (a state or task key never reaches the camera lookup)."""
    wrong = {key: camera for key, camera in aliases.items() if camera is not None and camera not in cameras}
    if wrong:
        raise CheckpointError(f"camera_aliases point at cameras this checkpoint lacks: {wrong} "
                              f"(its cameras: {', '.join(cameras)})")
    not_images = [key for key, camera in aliases.items()
                  if camera is not None and (not key or key in (*STATE_KEYS, *STATE_PARTS, *TASK_KEYS, *PASSED_THROUGH))]
    if not_images:
        raise CheckpointError(f"camera_aliases: {not_images[0]!r} is no image key; alias the key (or just the "
                              "camera name) a robot sends its image under")


def camera_part(key: str) -> str:
    """The camera name inside an image key: `front` of `images.front`, `observation.images.front` and
    `observation/front`."""
    prefix = next((p for p in IMAGE_PREFIXES if key.startswith(p)), "")
    return key[len(prefix):]


def _did_you_mean(word: str, candidates: Mapping[str, str]) -> str:
    """`candidates`: what `word` is compared with -> what is suggested for it."""
    close = difflib.get_close_matches(word, sorted(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(candidates[c]) for c in close)}?" if close else ""


class KeyLayout:
    """Observation keys of any supported layout -> `{"images": {camera: image}, "state", "task", ...}`."""

    def __init__(self, cameras: tuple[str, ...], aliases: Mapping[str, str | None] | None = None,
                 rename_map: Mapping[str, str] | None = None):
        self.cameras = tuple(cameras)
        self.aliases = dict(aliases or {})
        check_camera_aliases(self.aliases, self.cameras)
        self.rename_map = dict(rename_map or {})
        by_role: dict[str, list[str]] = {}
        for camera in self.cameras:
            if camera in NAME_ROLES:
                by_role.setdefault(NAME_ROLES[camera], []).append(camera)
        # A role two cameras share is ambiguous: those cameras take their own names only.
        self.role_camera = {role: cams[0] for role, cams in by_role.items() if len(cams) == 1}

    # ---- cameras --------------------------------------------------------------------------
    def alias_of(self, key: str) -> tuple[bool, str | None]:
        """(aliased, camera): the config's alias of the whole key, else of its camera part."""
        for spelling in (key, camera_part(key)):
            if spelling in self.aliases:
                return True, self.aliases[spelling]
        return False, None

    def _resolve(self, key: str) -> tuple[bool, str | None]:
        """(found, camera); found with camera None: the key is ignored."""
        aliased, camera = self.alias_of(key)
        if aliased:
            return True, camera
        if key in IGNORED_KEYS:
            return True, None
        renamed = self.rename_map.get(key, key)
        name = camera_part(renamed if renamed.startswith(LEROBOT_IMAGE_PREFIX) else key)
        if name in self.cameras:
            return True, name
        camera = self.role_camera.get(NAME_ROLES.get(name, ""))
        return camera is not None, camera

    def _no_camera(self, key: str, sent, taken) -> InvalidObservation:
        free = [c for c in self.cameras if c not in taken]
        name = camera_part(key)
        cameras = f"its cameras: {', '.join(self.cameras)}" + (
            f"; without an image so far: {', '.join(free)}" if len(free) < len(self.cameras) else "")
        return InvalidObservation(key, f"maps to no camera of this checkpoint ({cameras}); send it under one of "
                                       f"those names, or map it in the server's --config file: camera_aliases "
                                       f"{{{name!r}: CAMERA}}, or {{{name!r}: null}} to ignore it"
                                  + _did_you_mean(name, self._camera_keys(key, sent, free)))

    def _camera_keys(self, key: str, sent, free) -> dict[str, str]:
        """Camera part -> key in `key`'s style, for each key that would feed a camera still `free` and
        that the observation has not `sent` (for "did you mean")."""
        prefix = key[:len(key) - len(camera_part(key))]
        names = set(self.cameras) | set(NAME_ROLES) | {camera_part(k) for k in self.aliases}
        keys = {name: prefix + name for name in names}
        return {name: k for name, k in keys.items() if k not in sent and self._resolve(k)[1] in free}

    # ---- whole observations ---------------------------------------------------------------
    def canonical(self, raw: Mapping) -> dict:
        """Rewrites an observation of any supported layout into the keys Policy.prepare reads.
        Values pass through untouched, except DROID's state parts, which are concatenated."""
        if not isinstance(raw, Mapping):
            raise InvalidObservation("observation", "expected a mapping of observation keys to values")
        images: dict[str, object] = {}
        out: dict[str, object] = {"images": images}
        parts: dict[str, object] = {}
        sent: list[str] = []
        unknown: list[str] = []  # reported once every key is known, so suggestions skip what was sent

        def add_image(key: str, value) -> None:
            found, camera = self._resolve(key)
            if not found:
                unknown.append(key)
            elif camera is not None:
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
            sent.append(key)
            if key in self.aliases and self.aliases[key] is None:
                continue  # ignored by the config, whatever the key is
            renamed = self.rename_map.get(key, key) if key.startswith("observation.") else key
            if key == "images":
                if not isinstance(value, Mapping):
                    raise InvalidObservation("images", "must be a map from camera name to image")
                for name, image in value.items():
                    sent.append(f"images.{name}")
                    add_image(f"images.{name}", image)
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
            elif self._is_image_key(key):
                add_image(key, value)
            else:
                unknown.append(key)
        if unknown:
            raise self._unknown(unknown[0], sent, images)
        if parts:
            set_once("state", next(iter(parts)), _droid_state(parts))
        return out

    def _is_image_key(self, key: str) -> bool:
        return "image" in key.lower() or self.alias_of(key)[0]

    def _unknown(self, key: str, sent: list[str], images: dict) -> InvalidObservation:
        if self._is_image_key(key):
            return self._no_camera(key, sent, images)
        free = [c for c in self.cameras if c not in images]
        known = [*STATE_KEYS, *STATE_PARTS, *TASK_KEYS, *PASSED_THROUGH,
                 *self._camera_keys("observation/", sent, free).values(),
                 *self._camera_keys(LEROBOT_IMAGE_PREFIX, sent, free).values()]
        return InvalidObservation(key, "unknown observation key (state is 'state', the task 'prompt' or 'task')"
                                  + _did_you_mean(key, {k: k for k in known if k not in sent}))


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
