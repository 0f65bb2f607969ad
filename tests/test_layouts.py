"""The key-layout table: each robot layout a user has, through the same table the server uses."""

import numpy as np
import pytest

from conftest import fixture_dir
from vlaserve import Policy
from vlaserve.errors import CheckpointError, InvalidObservation
from vlaserve.processing.layouts import KeyLayout, check_camera_aliases

GOLDEN_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
LIBERO_CAMERAS = ("image", "image2", "empty_camera_0")
RENAME = {"observation.images.front": "observation.images.image",
          "observation.images.image": "observation.images.image2"}


def image(value: int, chw: bool = False) -> np.ndarray:
    img = np.random.default_rng(value).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return np.ascontiguousarray(img.transpose(2, 0, 1)) if chw else img


@pytest.fixture(scope="module")
def libero_policy():
    """A LeRobot LIBERO-style checkpoint: cameras image, image2 (+ empty), state 8, a rename map."""
    return Policy.from_pretrained(fixture_dir("pi05_golden_variants") / "renamed" / "checkpoint", device="cpu",
                                  dtype="float32", progress=False)


def cameras_of(layout: KeyLayout, raw: dict) -> dict:
    return {cam: int(np.asarray(img).flatten()[0]) for cam, img in layout.canonical(raw)["images"].items()}


def test_openpi_libero_keys_resolve_by_role_on_both_camera_namings():
    raw = {"observation/image": image(1), "observation/wrist_image": image(2),
           "observation/state": np.zeros(8), "prompt": "x"}
    first = {"base": int(image(1).flatten()[0]), "wrist": int(image(2).flatten()[0])}
    assert cameras_of(KeyLayout(GOLDEN_CAMERAS), raw) == {"base_0_rgb": first["base"],
                                                           "left_wrist_0_rgb": first["wrist"]}
    # LeRobot's LIBERO checkpoints call the same roles image and image2; OpenPI keys are never renamed.
    assert cameras_of(KeyLayout(LIBERO_CAMERAS, rename_map=RENAME), raw) == {"image": first["base"],
                                                                             "image2": first["wrist"]}


def test_aloha_with_cam_low_and_chw_uint8_equals_the_native_call(golden_policy):
    images = {cam: image(i, chw=True) for i, cam in enumerate(GOLDEN_CAMERAS)}
    state = np.linspace(-1, 1, 14).astype(np.float32)
    noise = np.random.default_rng(0).standard_normal((50, 32)).astype(np.float32)
    aloha = {"images": {"cam_high": images["base_0_rgb"], "cam_left_wrist": images["left_wrist_0_rgb"],
                        "cam_right_wrist": images["right_wrist_0_rgb"], "cam_low": image(9, chw=True)},
             "state": state, "prompt": "fold the towel"}
    native = {"images": images, "state": state, "task": "fold the towel"}
    ours = golden_policy.infer(aloha, noise=noise).actions
    assert np.array_equal(ours, golden_policy.infer(native, noise=noise).actions)  # same inputs: same bits


def test_droid_joint_and_gripper_become_the_state_and_the_missing_wrist_is_masked(libero_policy):
    joints = np.linspace(-0.5, 0.5, 7)
    droid = {"observation/exterior_image_1_left": image(1), "observation/wrist_image_left": image(2),
             "observation/joint_position": joints, "observation/gripper_position": np.array([0.25]),
             "prompt": "pick"}
    canonical = KeyLayout(GOLDEN_CAMERAS).canonical(droid)
    assert canonical["state"].tolist() == [*np.float32(joints).tolist(), 0.25]
    assert set(canonical["images"]) == {"base_0_rgb", "left_wrist_0_rgb"}
    prepared = KeyLayout(GOLDEN_CAMERAS).canonical({**droid, "observation/gripper_position": 0.25})
    assert prepared["state"].shape == (8,)  # a scalar gripper too
    p = libero_policy.prepare(droid)  # state 8 = 7 joints + gripper
    assert dict(zip(p.slot_cameras, p.image_mask.tolist())) == {"image": True, "image2": True,
                                                                 "empty_camera_0": False}
    with pytest.raises(InvalidObservation, match="gripper_position"):
        KeyLayout(GOLDEN_CAMERAS).canonical({k: v for k, v in droid.items() if "gripper" not in k})


def test_images_normalized_is_no_camera():
    raw = {"observation/image": image(1).astype(np.float32) / 127.5 - 1, "images_normalized": True,
           "observation/state": np.zeros(14), "prompt": "x"}
    out = KeyLayout(GOLDEN_CAMERAS).canonical(raw)
    assert out["images_normalized"] is True and list(out["images"]) == ["base_0_rgb"]


def test_rename_map_applies_to_lerobot_keys_only():
    layout = KeyLayout(LIBERO_CAMERAS, rename_map=RENAME)
    lerobot = {"observation.images.front": image(1), "observation.images.image": image(2)}
    assert cameras_of(layout, lerobot) == {"image": int(image(1).flatten()[0]), "image2": int(image(2).flatten()[0])}
    # Native names are the checkpoint's own (post-rename) names.
    assert cameras_of(layout, {"images": {"image": image(3)}}) == {"image": int(image(3).flatten()[0])}


def test_config_aliases_and_null_ignore_keys():
    layout = KeyLayout(GOLDEN_CAMERAS, aliases={"observation.images.top": "base_0_rgb", "extra_sensor": None})
    out = layout.canonical({"observation.images.top": image(1), "extra_sensor": [1, 2], "state": [0], "task": "x"})
    assert list(out["images"]) == ["base_0_rgb"] and "extra_sensor" not in out


def test_unknown_keys_get_a_did_you_mean():
    layout = KeyLayout(GOLDEN_CAMERAS)
    with pytest.raises(InvalidObservation, match="did you mean 'observation/wrist_image'"):
        layout.canonical({"observation/wrist_imag": image(1)})
    with pytest.raises(InvalidObservation, match="did you mean 'observation/state'"):
        layout.canonical({"observation/stat": [0.0]})
    with pytest.raises(InvalidObservation, match="observation/left_image: maps to no camera"):
        layout.canonical({"observation/left_image": image(1)})


def test_aliases_to_unknown_cameras_are_refused_at_startup():
    check_camera_aliases({"observation.images.top": "base_0_rgb", "images.cam_low": None}, GOLDEN_CAMERAS)
    with pytest.raises(CheckpointError, match="top_cam"):
        check_camera_aliases({"observation.images.top": "top_cam"}, GOLDEN_CAMERAS)


def test_two_keys_for_one_camera_are_refused():
    with pytest.raises(InvalidObservation, match="second image"):
        KeyLayout(GOLDEN_CAMERAS).canonical({"images": {"cam_high": image(1), "base_0_rgb": image(2)}})


def test_policy_infer_takes_lerobot_and_openpi_keys(golden_policy):
    state = np.zeros(14, np.float32)
    noise = np.zeros((50, 32), np.float32)
    native = golden_policy.infer({"images": {"base_0_rgb": image(1)}, "state": state, "task": "x"}, noise=noise)
    for raw in ({"observation.images.base_0_rgb": image(1), "observation.state": state, "task": "x"},
                {"observation/image": image(1), "observation/state": state, "prompt": "x"}):
        assert np.array_equal(golden_policy.infer(raw, noise=noise).actions, native.actions)


def test_a_bare_alias_covers_every_spelling_of_its_camera_part_and_the_whole_key_wins():
    layout = KeyLayout(GOLDEN_CAMERAS, aliases={"front": "base_0_rgb", "images.front": "right_wrist_0_rgb",
                                                "cam_low": None})
    for key in ("observation/front", "observation.images.front", "front"):
        assert cameras_of(layout, {key: image(1)}) == {"base_0_rgb": int(image(1).flatten()[0])}
    assert list(layout.canonical({"images": {"front": image(1), "cam_low": image(2)}})["images"]) == ["right_wrist_0_rgb"]


def test_aliases_of_state_or_task_keys_are_refused_at_startup():
    with pytest.raises(CheckpointError, match="'prompt' is no image key"):
        check_camera_aliases({"prompt": "base_0_rgb"}, GOLDEN_CAMERAS)
    with pytest.raises(CheckpointError, match="lacks"):
        KeyLayout(GOLDEN_CAMERAS, aliases={"front": "top_cam"})  # checked when the layout is built, not per request
