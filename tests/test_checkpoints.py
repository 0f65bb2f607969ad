"""Checkpoints as LeRobot 0.6.1 saves them: relative actions, rename maps, strict processor steps,
every normalization mode, the empty camera, OpenPI's fp32 set."""

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import fixture_dir
from vlaserve import Policy
from vlaserve.config import ModelConfig
from vlaserve.family import load_policy_config
from vlaserve.errors import CheckpointError
from vlaserve.golden import FLOAT_TOLERANCE, GoldenCase, case_dirs
from vlaserve.processing.normalize import Normalizer
from vlaserve.processing.pipeline import ProcessorPipeline, RelativeActions
from vlaserve.checkpoint.weights import param_dtype
from vlaserve.demo import build_model

VARIANTS = fixture_dir("pi05_golden_variants")
CASES = [d for v in ("relative", "renamed") for d in case_dirs(VARIANTS / v)]


@pytest.fixture(scope="module")
def variant_policies():
    return {v: Policy.from_pretrained(VARIANTS / v / "checkpoint", device="cpu", dtype="float32", progress=False)
            for v in ("relative", "renamed")}


def lerobot_observations(case: GoldenCase) -> list[dict]:
    """The case's inputs under LeRobot's keys, as lerobot was fed them: float32 CHW uint8 / 255."""
    t, m = case.tensors, case.meta
    return [{**{f"observation.images.{cam}": t[f"input.image_uint8.{cam}"][b].transpose(2, 0, 1).astype(np.float32)
                / np.float32(255.0) for cam in m["cameras_present"][b]},
             "observation.state": t["input.state"][b], "task": m["tasks"][b]} for b in range(m["batch_size"])]


@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_variant_cases_through_the_python_api_with_lerobot_keys(variant_policies, case_dir):
    policy = variant_policies[case_dir.parent.parent.name]
    case = GoldenCase.load(case_dir)
    t, m = case.tensors, case.meta
    obs = lerobot_observations(case)
    prepared = [policy.prepare(o) for o in obs]
    assert [p.prompt for p in prepared] == m["prompts"]
    # Which picture lands in which slot is what the rename map decides: exact.
    order = [s["camera"] for s in m["model_image_order"]]
    assert all(p.slot_cameras == order for p in prepared)
    for cam in m["cameras_config_order"]:
        mask = np.array([bool(p.image_mask[p.slot_cameras.index(cam)]) for p in prepared])
        assert (mask == t[f"expected.image_mask.{cam}"]).all(), cam
    results = policy.infer_batch(obs, noise=list(t["input.noise"]), num_steps=m["num_steps"])
    actions = np.stack([r.actions for r in results])
    model_actions = np.stack([r.model_actions for r in results])
    # FLOAT_TOLERANCE (1e-5), as the golden cases: bugs move these by >= 1e-2 here (variants README §9).
    assert np.abs(model_actions - t["expected.actions_model"]).max() <= FLOAT_TOLERANCE
    assert np.abs(actions - t["expected.actions"]).max() <= FLOAT_TOLERANCE


@pytest.mark.parametrize("case_dir", case_dirs(VARIANTS / "relative"), ids=lambda d: d.name)
def test_relative_actions_mask_and_offset_are_the_references(case_dir):
    case = GoldenCase.load(case_dir)
    t, rel = case.tensors, case.meta["relative_actions"]
    pipeline = ProcessorPipeline.load(VARIANTS / "relative" / "checkpoint", relative_config())
    assert pipeline.relative_actions.mask.tolist() == rel["mask"] == t["expected.relative_mask"].tolist()
    # One float32 addition per value: bit for bit (README §7), raw unclipped state, same for every step.
    absolute = pipeline.to_absolute(t["expected.actions_relative"], t["input.state"])
    assert np.array_equal(absolute, t["expected.actions"])


def test_relative_mask_rules():
    names = ["a_gripper", "b", "C_Wrist"]
    assert RelativeActions.build_mask(4, ["GRIPPER", "wrist"], names).tolist() == [False, True, False, True]
    assert RelativeActions.build_mask(2, ["gripper"], None).tolist() == [True, True]  # no names: all relative
    assert RelativeActions.build_mask(2, ["", None], ["gripper", "x"]).tolist() == [True, True]


def test_rename_map_is_one_simultaneous_pass(variant_policies):
    policy = variant_policies["renamed"]
    a, b = (np.full((224, 224, 3), v, np.uint8) for v in (10, 200))
    prepared = policy.prepare({"observation.images.front": a, "observation.images.image": b,
                               "observation.state": np.zeros(8, np.float32), "task": "x"})
    images = dict(zip(prepared.slot_cameras, prepared.images))
    # front -> image, the user's image -> image2; front does not travel on to image2.
    assert int(images["image"].flatten()[0]) == 10 and int(images["image2"].flatten()[0]) == 200


def test_empty_camera_saved_in_input_features_is_counted_once():
    config = load_policy_config(VARIANTS / "renamed" / "checkpoint")
    assert config.cameras == ("image", "image2", "empty_camera_0")


# ---- strict processor steps ---------------------------------------------------------------------
def relative_config():
    return load_policy_config(VARIANTS / "relative" / "checkpoint")


def edited_checkpoint(tmp_path, edit_pre=None, edit_post=None):
    """A copy of the relative checkpoint with its processor JSONs edited."""
    target = tmp_path / "ckpt"
    shutil.copytree(VARIANTS / "relative" / "checkpoint", target)
    for name, edit in (("policy_preprocessor.json", edit_pre), ("policy_postprocessor.json", edit_post)):
        if edit is not None:
            data = json.loads((target / name).read_text())
            edit(data["steps"])
            (target / name).write_text(json.dumps(data))
    return target


def _step(steps, name):
    return next(s for s in steps if s["registry_name"] == name)


REFUSED = {
    "unknown step": (lambda s: s.insert(2, {"registry_name": "delta_actions_processor", "config": {}}), None,
                     "delta_actions_processor"),
    "cast to bf16": (lambda s: _step(s, "device_processor")["config"].update(float_dtype="bfloat16"), None,
                     "float_dtype"),
    "relative after normalizer": (lambda s: s.insert(3, s.pop(2)), None, "out of the reference's order"),
    "left padding": (lambda s: _step(s, "tokenizer_processor")["config"].update(padding_side="left"), None,
                     "padding_side"),
    "unknown setting": (lambda s: _step(s, "normalizer_processor")["config"].update(clip=True), None, "clip"),
    "unknown mode": (lambda s: _step(s, "normalizer_processor")["config"]["norm_map"].update(STATE="LOG"), None,
                     "LOG"),
    "max_length vs config": (lambda s: _step(s, "tokenizer_processor")["config"].update(max_length=49), None,
                             "max_length 49"),
    "state dropped from prompt": (lambda s: _step(s, "pi05_prepare_state_tokenizer_processor_step")["config"]
                                  .update(include_state_in_prompt=False), None, "include_state_in_prompt"),
    "absolute without relative": (lambda s: _step(s, "relative_actions_processor")["config"].update(enabled=False),
                                  None, "absolute_actions_processor"),
    "relative without absolute": (None, lambda s: _step(s, "absolute_actions_processor")["config"]
                                  .update(enabled=False), "offsets"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_unimplemented_steps_and_settings_are_refused_by_name(tmp_path, name):
    edit_pre, edit_post, named = REFUSED[name]
    with pytest.raises(CheckpointError, match=named):
        ProcessorPipeline.load(edited_checkpoint(tmp_path, edit_pre, edit_post), relative_config())


def test_a_pipeline_without_relative_steps_loads_with_relative_actions_off(tmp_path):
    def drop(name):
        return lambda steps: steps.remove(_step(steps, name))
    path = edited_checkpoint(tmp_path, drop("relative_actions_processor"), drop("absolute_actions_processor"))
    assert ProcessorPipeline.load(path, relative_config()).relative_actions is None


# ---- normalization modes, against the reference's torch formulas ---------------------------------
def reference_normalize(mode, x, s, eps, inverse):
    """LeRobot 0.6.1 normalize_processor._apply_transform, transcribed in torch float32."""
    x = torch.from_numpy(x)
    s = {k: torch.from_numpy(v) for k, v in s.items()}
    if mode == "MEAN_STD":
        return (x * s["std"] + s["mean"]) if inverse else (x - s["mean"]) / (s["std"] + eps)
    lo, hi = {"QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "MIN_MAX": ("min", "max")}[mode]
    denom = s[hi] - s[lo]
    denom = torch.where(denom == 0, torch.tensor(eps, dtype=torch.float32), denom)
    if inverse:
        return (x + 1) / 2 * denom + s[lo] if mode == "MIN_MAX" else (x + 1.0) * denom / 2.0 + s[lo]
    return 2.0 * (x - s[lo]) / denom - 1.0


@pytest.mark.parametrize("mode", ["QUANTILES", "QUANTILE10", "MIN_MAX", "MEAN_STD"])
def test_normalization_modes_match_the_reference_bit_for_bit(mode):
    rng = np.random.default_rng(3)
    low = rng.normal(size=6).astype(np.float32)
    high = (low + rng.uniform(0.1, 3, 6)).astype(np.float32)
    high[2] = low[2]  # the eps rule: eps replaces the span only where it is 0
    stats = {"q01": low, "q99": high, "q10": low, "q90": high, "min": low, "max": high,
             "mean": low, "std": np.abs(high - low).astype(np.float32)}
    x = rng.normal(size=(5, 6)).astype(np.float32) * 3
    norm = Normalizer(mode, stats, eps=1e-8)
    for inverse, ours in ((False, norm.normalize(x)), (True, norm.unnormalize(x))):
        assert np.array_equal(ours, reference_normalize(mode, x, stats, 1e-8, inverse).numpy()), inverse
    assert np.array_equal(Normalizer().normalize(x), x)


def test_missing_statistic_for_a_mode_is_refused():
    with pytest.raises(CheckpointError, match="mean"):
        Normalizer("MEAN_STD", {"std": np.ones(3, np.float32)})


def test_openpi_converted_checkpoint_gets_its_quantiles_and_nothing_else(tmp_path):
    stats = {"norm_stats": {"state": {"q01": [0.0, 1.0], "q99": [1.0, 3.0]},
                            "actions": {"q01": [-1.0], "q99": [1.0]}}}
    (tmp_path / "assets" / "robot").mkdir(parents=True)
    (tmp_path / "assets" / "robot" / "norm_stats.json").write_text(json.dumps(stats))
    pipeline = ProcessorPipeline.load(tmp_path, relative_config())  # (an OpenPI directory: no config.json of its own)
    assert pipeline.rename_map == {} and pipeline.relative_actions is None and pipeline.tokenizer_name is None
    assert pipeline.normalization.source == "openpi" and pipeline.state_normalizer.always_add_eps


# ---- dtype policy ----------------------------------------------------------------------------------
def test_fp32_set_is_openpis_at_full_size():
    model = build_model(ModelConfig.full_size())  # meta device: shapes only, nothing allocated
    fp32 = {n: p.numel() for n, p in model.named_parameters() if param_dtype(n, torch.bfloat16) == torch.float32}
    assert sum(fp32.values()) == 119_720_608  # OpenPI / SGLang's published count
    assert not any("layer_norm" in n or "post_layernorm" in n for n in fp32)  # SigLIP LayerNorms are bf16
    assert param_dtype("vision.patch_embedding.weight", torch.bfloat16) == torch.float32
    assert param_dtype("expert.layers.0.input_layernorm.dense.weight", torch.bfloat16) == torch.float32


# ---- LeRobot's main branch (issue 79 row 13) -------------------------------------------------------------
def _config_with(tmp_path, **settings):
    """A copy of the golden checkpoint's config.json (and architecture.json) with `settings` added."""
    target, source = tmp_path / "ckpt", fixture_dir("pi05_golden") / "checkpoint"
    target.mkdir()
    shutil.copy(source / "architecture.json", target)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **settings}))
    return target


@pytest.mark.parametrize("settings, named", [
    ({"use_visual_memory": True, "memory_frames": 6, "memory_stride": 10}, "use_visual_memory"),
    ({"use_proprioceptive_memory": True, "memory_frames": 6}, "use_proprioceptive_memory"),
    ({"rtc_training_max_delay": 4}, "rtc_training_max_delay"),
])
def test_checkpoints_using_lerobot_main_only_features_are_refused_by_name(tmp_path, settings, named):
    with pytest.raises(CheckpointError, match=named) as refused:
        load_policy_config(_config_with(tmp_path, **settings))
    assert "in no LeRobot release" in str(refused.value) and "does not support" in str(refused.value)


def test_those_features_switched_off_load_as_the_plain_model(tmp_path):
    """LeRobot's main branch writes the new settings into every pi05 config; off, the model is the released one."""
    off = load_policy_config(_config_with(tmp_path, use_visual_memory=False, use_proprioceptive_memory=False,
                                          memory_frames=None, memory_stride=None, rtc_training_max_delay=0))
    assert off == load_policy_config(fixture_dir("pi05_golden") / "checkpoint")


def test_the_recorded_hub_id_is_read_from_repo_id_or_the_hub_cache_folder(tmp_path):
    assert load_policy_config(_config_with(tmp_path, repo_id="lerobot/pi05_base")).hub_id == "lerobot/pi05_base"
    cached = tmp_path / "hub" / "models--lerobot--pi05_libero" / "snapshots" / "0123abc"
    (tmp_path / "x").mkdir()
    shutil.copytree(_config_with(tmp_path / "x"), cached)
    assert load_policy_config(cached).hub_id == "lerobot/pi05_libero"
    assert load_policy_config(fixture_dir("pi05_golden") / "checkpoint").hub_id is None  # repo_id null, no cache
