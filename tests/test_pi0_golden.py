"""Pi0 against the values LeRobot 0.6.1 produced (tests/data/pi0_golden), through the public Policy
API, plus its checkpoint keys and processing."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fixture_dir
from vlaserve import Policy
from vlaserve.checkpoint import weights
from vlaserve.checkpoint.weights import PI0_LAYOUT, PI05_LAYOUT, load_weights
from vlaserve.errors import CheckpointError
from vlaserve.family import PI0
from vlaserve.golden import FLOAT_TOLERANCE, GoldenCase, beyond_tolerance, case_dirs, compare_case
from vlaserve.processing.normalize import Normalizer
from vlaserve.processing.pipeline import ProcessorPipeline
from vlaserve.processing.prompt import build_pi0_prompt

GOLDEN = fixture_dir("pi0_golden")
CASES = case_dirs(GOLDEN)


@pytest.fixture(scope="module")
def policy():
    return Policy.from_pretrained(GOLDEN / "checkpoint", device="cpu", dtype="float32", progress=False)


def test_all_public_cases_are_present():
    assert {c.name for c in CASES} == {"three_cams_224", "resize_and_missing_cam", "batch2", "five_steps", "rtc"}


def test_the_checkpoint_loads_as_pi0(policy):
    m = policy.metadata
    assert (m["policy_type"], m["max_token_len"], m["normalization"]) == ("pi0", 48, "lerobot")
    assert type(policy.model).__name__ == "Pi0Model" and policy.config.max_state_dim == 32


@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_pi0_golden_case(policy, case_dir):
    case = GoldenCase.load(case_dir)
    exact, deltas = compare_case(policy, case)
    # Prompts, token ids, masks (the suffix's 2-D attention mask included), positions, slot order: identical.
    assert all(exact.values()), {k: v for k, v in exact.items() if not v}
    assert {"prompts", "tokens", "token_mask", "prefix_position_ids", "suffix_att_2d_mask",
            "suffix_position_ids"} <= exact.keys()
    # golden.tolerance: FLOAT_TOLERANCE (1e-5), as independent float32 implementations agree to ~1e-6,
    # while the smallest bug in the golden README §3 (the state token also seeing the actions) moves v_t1
    # by 6e-4 and the state-path bugs by >= 2.6e-3. RTC's guided velocity v − g·w·(prev − x + t·v)
    # scales those ~1e-6 by up to 1 + 2g = 21 (measured 1.14e-5 here on an AMD EPYC): twice that, 4.2e-5.
    too_far = beyond_tolerance(case, deltas)
    assert not too_far, too_far
    recorded = {"state_normalized", "state_model", "prefix_embs", "prefix_kv.1.value", "state_emb", "v_t1",
                "trace.x_t", "trace.v_t", "trace.time_emb", "trace.action_time_emb", "actions_model",
                "api.actions_model", "api.actions_normalized", "api.actions"}
    assert recorded <= deltas.keys()
    if case_dir.name == "rtc":
        assert {"trace.v_guided", "rtc.prefix_weights", "rtc.guidance_weight"} <= deltas.keys()
    # LeRobot's formula, float32 for float32: the normalized state is bit-exact (std + 1e-8 included).
    assert deltas["state_normalized"] == 0.0 and deltas["state_model"] == 0.0


def test_prefix_cache_keeps_the_vlm_kv_and_adds_the_state_each_call(tmp_path):
    # Same images and prompt, other states: a cache hit must still use each call's own state token.
    cached = Policy.from_pretrained(GOLDEN / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    prefix_cache=4)
    case = GoldenCase.load(GOLDEN / "cases" / "three_cams_224")
    obs = case.observations()[0]
    noise = case.tensors["input.noise"][0]
    first = cached.infer(obs, noise=noise).actions
    moved = cached.infer({**obs, "state": obs["state"] + 0.5}, noise=noise).actions
    again = cached.infer(obs, noise=noise).actions
    assert cached.metadata["prefix_cache"]["hits"] == 2
    np.testing.assert_array_equal(first, again)
    assert np.abs(moved - first).max() > 1e-3  # the state reaches the actions (README §3: ~3e-3 and up)
    assert np.abs(first - case.tensors["expected.actions"][0]).max() <= FLOAT_TOLERANCE


# ---- checkpoint keys -------------------------------------------------------------------------


def _meta_pi0(policy):
    return PI0.build_model(policy.config)


def _load(policy, directory, dtype=torch.float32):
    return load_weights(_meta_pi0(policy), directory, dtype, torch.device("cpu"), progress=False, layout=PI0_LAYOUT)


def _saved(directory, tensors):
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_every_pi0_checkpoint_tensor_is_used_except_the_unused_heads(policy):
    tensors = load_file(str(GOLDEN / "checkpoint" / "model.safetensors"))
    mapped = weights.checkpoint_shapes(GOLDEN / "checkpoint", PI0_LAYOUT)
    unused = {k for k in tensors if PI0_LAYOUT.to_ours(k) is None}
    assert unused == {"model.paligemma_with_expert.paligemma.lm_head.weight",
                      "model.paligemma_with_expert.gemma_expert.lm_head.weight"}
    assert len(mapped) == len(tensors) - 2 == 88
    assert mapped.keys() == dict(_meta_pi0(policy).named_parameters()).keys()
    assert {"state_proj.weight", "action_time_mlp_in.weight", "action_time_mlp_out.bias",
            "expert.layers.0.input_layernorm.weight", "expert.norm.weight"} <= mapped.keys()
    # Plain RMSNorm weights [W], not AdaRMS dense layers.
    assert mapped["expert.norm.weight"] == (32,)
    for name in mapped:
        assert PI0_LAYOUT.to_ours(PI0_LAYOUT.to_lerobot(name)) == name


def test_loading_is_strict_and_names_the_keys(policy, tmp_path):
    tensors = load_file(str(GOLDEN / "checkpoint" / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if not k.startswith("model.state_proj.")}
    with pytest.raises(CheckpointError, match=r"Pi0 architecture; missing tensors: model\.state_proj\.bias, "
                                              r"model\.state_proj\.weight"):
        _load(policy, _saved(tmp_path / "a", missing))
    extra = {**tensors, "model.time_mlp_in.weight": torch.zeros(32, 32)}  # "model." keys are not renamed
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.time_mlp_in\.weight"):
        _load(policy, _saved(tmp_path / "b", extra))
    short = {**tensors, "model.state_proj.weight": torch.zeros(32, 14)}
    with pytest.raises(CheckpointError, match=r"model\.state_proj\.weight: checkpoint \[32, 14\] vs model \[32, 32\]"):
        _load(policy, _saved(tmp_path / "c", short))


def test_unprefixed_pi05_spelling_of_the_time_mlp_is_renamed_like_lerobot():
    assert PI0_LAYOUT.to_ours("time_mlp_in.weight") == "action_time_mlp_in.weight"
    assert PI0_LAYOUT.to_ours("model.time_mlp_in.weight") == "?time_mlp_in.weight"


def test_a_pi05_checkpoint_is_refused_by_the_pi0_layout_and_named(policy):
    with pytest.raises(CheckpointError, match=r"Pi0 architecture; missing tensors: .*state_proj.*"
                                              r"The weights are a Pi0\.5 checkpoint"):
        _load(policy, fixture_dir("pi05_golden") / "checkpoint")


def test_the_pi05_layout_maps_every_pi05_tensor_and_ignores_a_state_projection():
    tensors = load_file(str(fixture_dir("pi05_golden") / "checkpoint" / "model.safetensors"))
    assert PI05_LAYOUT.to_ours("model.state_proj.weight") is None
    assert PI05_LAYOUT.to_ours("action_time_mlp_in.weight") == "time_mlp_in.weight"  # LeRobot's pi05 rename
    assert all(not PI05_LAYOUT.to_ours(k).startswith("?") for k in tensors if PI05_LAYOUT.to_ours(k))


def test_fp32_set_keeps_pi0s_small_projections_and_plain_norms(policy):
    model = _load(policy, GOLDEN / "checkpoint", dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    for name in ("state_proj.weight", "action_time_mlp_in.weight", "action_out_proj.bias",
                 "expert.layers.1.post_attention_layernorm.weight", "expert.norm.weight", "vlm.norm.weight",
                 "vision.patch_embedding.weight"):
        assert dtypes[name] == torch.float32, name
    # The SigLIP LayerNorms are in the serving dtype, as for Pi0.5 (OpenPI's fp32 set).
    for name in ("expert.layers.0.mlp.up_proj.weight", "vision.layers.0.layer_norm1.weight",
                 "vision.post_layernorm.weight"):
        assert dtypes[name] == torch.bfloat16, name


def test_head_only_tied_embedding_is_accepted(policy, tmp_path):
    tensors = load_file(str(GOLDEN / "checkpoint" / "model.safetensors"))
    tensors.pop("model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight")
    model = _load(policy, _saved(tmp_path / "head_only", tensors))
    assert torch.equal(model.vlm.embed_tokens.weight, policy.model.vlm.embed_tokens.weight)


# ---- processing ----------------------------------------------------------------------------


def test_pi0_prompt_is_the_raw_task_with_one_final_newline():
    assert build_pi0_prompt("fold_the towel\nneatly") == "fold_the towel\nneatly\n"
    assert build_pi0_prompt("  pick up  ") == "  pick up  \n"
    assert build_pi0_prompt("done\n") == "done\n"


def test_mean_std_adds_eps_going_in_only():
    std = np.float32(0.2)
    norm = Normalizer("MEAN_STD", {"mean": np.float32([0.0, 1.0]), "std": np.float32([std, 0.5])})
    # float32(0.2) + 1e-8 rounds to the next float32, so 0.2 does not normalize to 1: the eps counts.
    assert std + np.float32(1e-8) != std
    assert norm.normalize(np.float32([std, 1.0]))[0] == std / (std + np.float32(1e-8)) < 1.0
    # No clipping: ten std away is (about) ten.
    assert norm.normalize(np.float32([0.0, 6.0]))[1] == pytest.approx(10.0, rel=1e-6)
    # Un-normalization: y·std + mean, without the eps; the first dims only for a shorter vector.
    assert list(norm.unnormalize(np.float32([1.0, 2.0]))) == [std, np.float32(2.0)]
    assert list(norm.unnormalize(np.float32([1.0]))) == [std]


def test_pi0_pipeline_reads_mean_std_from_the_processor_steps(policy):
    pipeline = ProcessorPipeline.load(GOLDEN / "checkpoint", policy.config)
    norm = pipeline.normalization
    assert norm.state.mode == norm.action.mode == "MEAN_STD"
    assert norm.state.eps == norm.action.eps == 1e-8 and norm.state.stats["mean"].shape == (14,)
    assert pipeline.max_token_len == 48 and pipeline.relative_actions is None


def _edited_processor(tmp_path, edit):
    import json
    import shutil

    directory = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "checkpoint", directory)
    path = directory / "policy_preprocessor.json"
    data = json.loads(path.read_text())
    edit(data["steps"])
    path.write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize("edit, message", [
    (lambda steps: steps.pop(2), r"lacks the step\(s\) \['pi0_new_line_processor'\] every pi0 checkpoint has"),
    (lambda steps: steps.insert(2, steps.pop(6)), "out of the reference's order"),  # normalizer before newline
    (lambda steps: steps.insert(2, {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}),
     "unknown step for a pi0 checkpoint"),
    (lambda steps: steps[2].update(config={"task_key": "task"}), "unsupported settings"),
])
def test_pi0_processor_steps_are_strict(policy, tmp_path, edit, message):
    directory = _edited_processor(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        ProcessorPipeline.load(directory, policy.config)


# ---- runtime -------------------------------------------------------------------------------


def test_pi0_serves_in_bfloat16_with_its_fp32_set():
    # CUDA serves bfloat16 by default. bfloat16 keeps 8 mantissa bits (relative rounding 4e-3), so over
    # ~10 layers and 10 steps the actions move by a few 1e-3 here (measured 4.9e-3); 5e-2 only catches
    # a wrong dtype path (a crash, NaN, an unconverted state token), not the float32 bugs above.
    bf16 = Policy.from_pretrained(GOLDEN / "checkpoint", device="cpu", dtype="bfloat16", progress=False)
    case = GoldenCase.load(GOLDEN / "cases" / "three_cams_224")
    actions = bf16.infer(case.observations()[0], noise=case.tensors["input.noise"][0]).actions
    assert np.abs(actions - case.tensors["expected.actions"][0]).max() < 5e-2
    assert bf16.model.state_proj.weight.dtype == torch.float32
