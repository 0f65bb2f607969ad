"""Pi0 against the values LeRobot 0.6.1 produced (tests/data/pi0_golden), plus its key mapping and processing."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fixture_dir
from vlaserve.checkpoint import weights
from vlaserve.errors import CheckpointError
from vlaserve.golden import FLOAT_TOLERANCE, GoldenCase, case_dirs
from vlaserve.model.pi0 import Pi0Model
from vlaserve.model.pi0_keys import PI0_LAYOUT, PI05_LAYOUT, load_checkpoint, map_state_dict
from vlaserve.pi0_golden import Pi0Parts, compare_case
from vlaserve.processing.normalize import Normalizer
from vlaserve.processing.pi0 import build_pi0_prompt, load_lerobot_mean_std

GOLDEN = fixture_dir("pi0_golden")
CASES = case_dirs(GOLDEN)


@pytest.fixture(scope="module")
def parts():
    return Pi0Parts.load(GOLDEN / "checkpoint")


def test_all_public_cases_are_present():
    assert {c.name for c in CASES} == {"three_cams_224", "resize_and_missing_cam", "batch2", "five_steps", "rtc"}


@pytest.mark.parametrize("case_dir", CASES, ids=[c.name for c in CASES])
def test_pi0_golden_case(parts, case_dir):
    exact, deltas = compare_case(parts, GoldenCase.load(case_dir))
    # Prompts, token ids, masks (the suffix's 2-D attention mask included), positions, slot order: identical.
    assert all(exact.values()), {k: v for k, v in exact.items() if not v}
    assert {"prompts", "tokens", "token_mask", "prefix_position_ids", "suffix_att_2d_mask",
            "suffix_position_ids"} <= exact.keys()
    # FLOAT_TOLERANCE (1e-5): independent float32 implementations agree to ~1e-6, while the smallest bug
    # in the golden README §3 (the state token also seeing the actions) moves v_t1 by 6e-4 and the
    # state-path bugs by >= 2.6e-3. The tightest is the RTC-guided velocity (~9e-6): v − g·w·(prev − x + t·v)
    # multiplies v's ~1e-6 by up to 1 + g = 11 at t = 1.
    too_far = {k: d for k, d in deltas.items() if not d <= FLOAT_TOLERANCE}
    assert not too_far, too_far
    recorded = {"state_normalized", "state_model", "prefix_embs", "prefix_kv.1.value", "state_emb", "v_t1",
                "trace.x_t", "trace.v_t", "trace.time_emb", "trace.action_time_emb", "actions_model",
                "sample.actions"}
    assert recorded <= deltas.keys()
    if case_dir.name == "rtc":
        assert {"trace.v_guided", "rtc.prefix_weights", "rtc.guidance_weight"} <= deltas.keys()
    # LeRobot's formula, float32 for float32: the normalized state is bit-exact (std + 1e-8 included).
    assert deltas["state_normalized"] == 0.0


# ---- checkpoint keys -------------------------------------------------------------------------


def _meta_pi0(parts) -> Pi0Model:
    with torch.device("meta"):
        return Pi0Model(parts.model.config, max_state_dim=parts.model.max_state_dim)


def test_every_pi0_checkpoint_tensor_is_used_except_the_unused_heads(parts):
    tensors = load_file(str(GOLDEN / "checkpoint" / "model.safetensors"))
    mapped = map_state_dict(PI0_LAYOUT, _meta_pi0(parts), tensors, "pi0")
    unused = {k for k in tensors if PI0_LAYOUT.to_ours(k) is None}
    assert unused == {"model.paligemma_with_expert.paligemma.lm_head.weight",
                      "model.paligemma_with_expert.gemma_expert.lm_head.weight"}
    assert len(mapped) == len(tensors) - 2 == 88
    assert {"state_proj.weight", "action_time_mlp_in.weight", "action_time_mlp_out.bias",
            "expert.layers.0.input_layernorm.weight", "expert.norm.weight"} <= mapped.keys()
    # Plain RMSNorm weights [W], not AdaRMS dense layers.
    assert mapped["expert.norm.weight"].shape == (32,)
    for name in mapped:
        assert PI0_LAYOUT.to_ours(PI0_LAYOUT.to_lerobot(name)) == name


def test_loading_is_strict_and_names_the_keys(parts):
    tensors = load_file(str(GOLDEN / "checkpoint" / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if not k.startswith("model.state_proj.")}
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.state_proj\.bias, model\.state_proj\.weight"):
        map_state_dict(PI0_LAYOUT, _meta_pi0(parts), missing, "ckpt")
    extra = {**tensors, "model.time_mlp_in.weight": torch.zeros(32, 32)}  # "model." keys are not renamed
    with pytest.raises(CheckpointError, match=r"unexpected tensors: time_mlp_in\.weight"):
        map_state_dict(PI0_LAYOUT, _meta_pi0(parts), extra, "ckpt")
    short = {**tensors, "model.state_proj.weight": torch.zeros(32, 14)}
    with pytest.raises(CheckpointError, match=r"model\.state_proj\.weight: checkpoint \[32, 14\] vs model \[32, 32\]"):
        map_state_dict(PI0_LAYOUT, _meta_pi0(parts), short, "ckpt")


def test_unprefixed_pi05_spelling_of_the_time_mlp_is_renamed_like_lerobot():
    assert PI0_LAYOUT.to_ours("time_mlp_in.weight") == "action_time_mlp_in.weight"
    assert PI0_LAYOUT.to_ours("model.time_mlp_in.weight") == "?time_mlp_in.weight"


def test_a_pi05_checkpoint_is_refused_by_the_pi0_layout(parts):
    with pytest.raises(CheckpointError, match=r"pi0 architecture; missing tensors: .*state_proj"):
        load_checkpoint(PI0_LAYOUT, _meta_pi0(parts), fixture_dir("pi05_golden") / "checkpoint")


def test_the_pi05_layout_reproduces_weights_py():
    # The data-driven layout is weights.py's mapping, so the two can merge without changing Pi0.5.
    tensors = load_file(str(fixture_dir("pi05_golden") / "checkpoint" / "model.safetensors"))
    keys = list(tensors) + ["action_time_mlp_in.weight", "paligemma_with_expert.paligemma.language_model.model.x"]
    for key in keys:
        assert PI05_LAYOUT.to_ours(key) == weights.to_our_name(key), key


def test_fp32_set_keeps_pi0s_small_projections_and_plain_norms(parts):
    model = load_checkpoint(PI0_LAYOUT, _meta_pi0(parts), GOLDEN / "checkpoint", dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    for name in ("state_proj.weight", "action_time_mlp_in.weight", "action_out_proj.bias",
                 "expert.layers.1.post_attention_layernorm.weight", "expert.norm.weight", "vlm.norm.weight"):
        assert dtypes[name] == torch.float32, name
    assert dtypes["expert.layers.0.mlp.up_proj.weight"] == torch.bfloat16


def test_head_only_tied_embedding_is_accepted(parts, tmp_path):
    tensors = load_file(str(GOLDEN / "checkpoint" / "model.safetensors"))
    tensors.pop("model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_checkpoint(PI0_LAYOUT, _meta_pi0(parts), tmp_path)
    assert torch.equal(model.vlm.embed_tokens.weight, parts.model.vlm.embed_tokens.weight)


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


def test_pi0_checkpoint_statistics_and_pi05_refusal():
    norm = load_lerobot_mean_std(GOLDEN / "checkpoint")
    assert norm.state.eps == norm.action.eps == 1e-8 and norm.state.stats["mean"].shape == (14,)
    with pytest.raises(CheckpointError, match="QUANTILES"):
        load_lerobot_mean_std(fixture_dir("pi05_golden") / "checkpoint")
