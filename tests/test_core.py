"""Unit tests of the core: processing, loading, dtype policy, determinism, batching."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_np
from safetensors.torch import load_file, save_file

from vlaserve import CheckpointError, InvalidObservation, Policy
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError, InvalidInput
from vlaserve.model.gemma import AdaRMSNorm, RMSNorm
from vlaserve.processing.images import prepare_image, resized_shape
from vlaserve.processing.normalize import QuantileNormalizer, load_openpi_normalization
from vlaserve.runtime.transfer import to_device
from vlaserve.processing.prompt import discretize_state


def observation(seed: int, cameras=("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), size=(224, 224)):
    rng = np.random.default_rng(seed)
    return {"images": {c: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for c in cameras},
            "state": rng.normal(size=14).astype(np.float32), "task": f"pick up block {seed}"}


# ---- processing ------------------------------------------------------------------------------
def test_language_embeddings_are_scaled_by_sqrt_width(golden_policy):
    vlm = golden_policy.model.vlm
    ids = torch.tensor([[2, 5, 700]])
    ratio = vlm.embed(ids) / vlm.embed_tokens.weight[ids]
    # width 64: the scale is exactly 8; the product of a float32 and 8 is exact.
    assert torch.equal(ratio, torch.full_like(ratio, 8.0))


def test_resize_shape_uses_the_truncated_float_quotient():
    # ratio = 72/224; 36/ratio = 111.99999999999999 and 72/ratio = 223.99999999999997 in float64,
    # truncated to 111 x 223 by the reference's int(): integer arithmetic would give 112 x 224.
    assert resized_shape(36, 72, 224) == (111, 223)
    assert resized_shape(180, 320, 224) == (126, 224)
    assert resized_shape(480, 640, 224) == (168, 224)


def test_uint8_images_are_rounded_to_the_byte_grid_after_resizing():
    img = np.random.default_rng(0).integers(0, 256, (180, 320, 3), dtype=np.uint8)
    out_u8 = prepare_image(img, 224, "img")
    bytes_u8 = (out_u8 + 1) / 2 * 255
    # Within float32 rounding of (k/255)*2-1 and back (< 1e-3 of a byte), every pixel is an integer.
    assert torch.allclose(bytes_u8, bytes_u8.round(), atol=1e-3)
    out_float = prepare_image(img.astype(np.float32) / 255.0, 224, "img")
    bytes_float = (out_float + 1) / 2 * 255
    # The float path (LeRobot semantics) keeps the interpolated values off the grid.
    assert (bytes_float - bytes_float.round()).abs().max() > 0.1
    # Padding rows (49 above, 49 below for 180x320) are -1 in both.
    assert torch.all(out_u8[:, :49] == -1) and torch.all(out_u8[:, -49:] == -1)


def test_normalized_float_images_are_never_normalized_twice():
    img = np.random.default_rng(1).uniform(-1, 1, (3, 224, 224)).astype(np.float32)
    assert torch.equal(prepare_image(img, 224, "img", normalized=True), torch.from_numpy(img))
    with pytest.raises(InvalidObservation, match="images_normalized"):
        prepare_image(img, 224, "img")  # [-1, 1] values without the flag are refused, not guessed
    small = img[:, :100, :150]
    via_flag = prepare_image(small, 224, "img", normalized=True)
    via_unit = prepare_image((small + 1) / 2, 224, "img")
    # Same resize of the same picture; (x+1)/2 and back differ by float32 rounding only.
    assert torch.allclose(via_flag, via_unit, atol=1e-6)


@pytest.mark.parametrize("shape", [(224, 224), (224, 224, 4), (1, 224, 224), (2, 3, 224, 224)])
def test_images_of_wrong_rank_or_channels_are_rejected(shape):
    with pytest.raises(InvalidObservation, match="img"):
        prepare_image(np.zeros(shape, np.uint8), 224, "img")


def test_state_bins_at_the_edges():
    # Values from the golden README §6.3.
    x = np.array([-1.5, -1.0, 0.0, 0.9921875, 1.0, 3.0], np.float32)
    assert discretize_state(x).tolist() == [-1, 0, 128, 255, 255, 255]


def test_quantile_eps_rules():
    q01, q99 = np.array([0.0, 1.0], np.float32), np.array([2.0, 1.0], np.float32)
    lerobot = QuantileNormalizer(q01, q99)
    # Denominator 2 is used as is; the degenerate one becomes 1e-8 (replaced, never added).
    assert lerobot.normalize(np.array([1.0, 1.0], np.float32)).tolist() == [0.0, -1.0]
    assert lerobot.denom.tolist() == [2.0, np.float32(1e-8)]
    openpi = QuantileNormalizer(q01, q99, eps=1e-6, always_add_eps=True)
    assert openpi.denom[0] == np.float32(2.0) + np.float32(1e-6)
    y = np.array([0.3, -0.2], np.float32)
    # normalize(unnormalize(y)): four float32 roundings on values of size ~1, far below 1e-6.
    assert np.allclose(lerobot.normalize(lerobot.unnormalize(y))[:1], y[:1], atol=1e-6)


def test_openpi_norm_stats(tmp_path):
    path = tmp_path / "norm_stats.json"
    stats = {"q01": [0.0] * 32, "q99": [2.0] * 32, "mean": [0.0] * 32, "std": [1.0] * 32}
    path.write_text(json.dumps({"norm_stats": {"state": stats, "actions": stats}}))
    norm = load_openpi_normalization(path)
    assert norm.source == "openpi" and norm.state.always_add_eps
    # (1 - 0) / (2 + 1e-6) * 2 - 1 = -5e-7 exactly in reals; float32 rounding of 2 + 1e-6 and of the
    # result near 1 costs ~6e-8, so 1e-7 separates it from LeRobot's rule (which would give 0).
    assert norm.state.normalize(np.ones(14, np.float32))[0] == pytest.approx(-5e-7, abs=1e-7)


def test_long_prompts_are_truncated_with_a_warning(golden_policy, caplog):
    obs = observation(3)
    obs["task"] = "move " * 300
    with caplog.at_level(logging.WARNING):
        prepared = golden_policy.prepare(obs)
    assert prepared.truncated and bool(prepared.token_mask.all())
    assert int(prepared.tokens[0]) == golden_policy.preprocessor.tokenizer.bos_id
    assert "truncated" in caplog.text


def test_bad_observations_name_the_field(golden_policy):
    good = observation(4)
    cases = [
        ({**good, "state": np.zeros(13, np.float32)}, "state"),
        ({**good, "state": np.full(14, np.nan, np.float32)}, "state"),
        ({**good, "task": 3}, "task"),
        ({**good, "images": {"top_cam": good["images"]["base_0_rgb"]}}, "images.top_cam"),
        ({**good, "images": {"base_0_rgb": np.zeros((224, 224), np.uint8)}}, "images.base_0_rgb"),
    ]
    for obs, field in cases:
        with pytest.raises(InvalidInput) as info:
            golden_policy.infer(obs, seed=0)
        assert info.value.field == field
    with pytest.raises(InvalidInput) as info:
        golden_policy.infer(good, noise=np.zeros((50, 31), np.float32))
    assert info.value.field == "noise"


# ---- model behaviour -------------------------------------------------------------------------
def test_padding_never_yields_nan(golden_policy):
    # One camera (two masked slots) and a short prompt (most tokens padding): the padded query
    # rows are fully masked, and must softmax to finite values.
    obs = observation(5, cameras=("left_wrist_0_rgb",))
    inputs = golden_policy.preprocessor.collate([golden_policy.request(obs)])[0]
    model = golden_policy.model
    ctx = model.compute_prefix(*model.embed_prefix(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask))
    assert (~ctx.pad_mask).sum() > 400
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in ctx.kv)
    assert np.isfinite(golden_policy.infer(obs, seed=0).actions).all()


def test_same_noise_gives_bit_identical_actions(golden_policy):
    obs, noise = observation(6), np.random.default_rng(6).normal(size=(50, 32)).astype(np.float32)
    a, b = golden_policy.infer(obs, noise=noise), golden_policy.infer(obs, noise=noise)
    assert np.array_equal(a.actions, b.actions) and np.array_equal(a.model_actions, b.model_actions)


def test_same_seed_gives_same_actions(golden_policy):
    obs = observation(7)
    a, b = golden_policy.infer(obs, seed=11), golden_policy.infer(obs, seed=11)
    c = golden_policy.infer(obs, seed=12)
    assert np.array_equal(a.actions, b.actions)
    assert not np.allclose(a.actions, c.actions)


def test_infer_batch_equals_infer_per_item(golden_policy):
    obs = [observation(8), observation(9, cameras=("base_0_rgb",), size=(120, 160)), observation(10)]
    obs[2]["task"] = "a much longer task description that changes the prompt length " * 2
    noise = [np.random.default_rng(i).normal(size=(50, 32)).astype(np.float32) for i in range(3)]
    batched = golden_policy.infer_batch(obs, noise=noise)
    for o, z, r in zip(obs, noise, batched):
        single = golden_policy.infer(o, noise=z)
        # Batching changes only GEMM blocking on the CPU: float32 reassociation, < 1e-5.
        assert np.abs(single.actions - r.actions).max() < 1e-5


def test_rtc_accepts_action_space_left_overs(golden_policy):
    obs, noise = observation(12), np.random.default_rng(12).normal(size=(50, 32)).astype(np.float32)
    prev = golden_policy.infer(obs, seed=99)
    left_model, left_action = prev.model_actions[20:, :14], prev.actions[20:]
    opts = {"inference_delay": 2, "execution_horizon": 8}
    a = golden_policy.infer(obs, noise=noise, rtc={"prev_chunk": left_model, **opts})
    b = golden_policy.infer(obs, noise=noise, rtc={"prev_chunk": left_action, "space": "action", **opts})
    plain = golden_policy.infer(obs, noise=noise)
    # normalize(unnormalize(x)) round-trips to float32 rounding (~1e-7), so both guide alike.
    assert np.abs(a.actions - b.actions).max() < 1e-5
    # Guidance changes the start of the chunk.
    assert np.abs(a.actions[:3] - plain.actions[:3]).max() > 1e-3


# ---- loading ---------------------------------------------------------------------------------
def _copy_checkpoint(golden, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(golden / "checkpoint", dst)
    return dst


def test_strict_loading_names_missing_unexpected_and_misshapen_keys(golden, tmp_path):
    ckpt = _copy_checkpoint(golden, tmp_path)
    state = load_file(str(ckpt / "model.safetensors"))
    q = "model.paligemma_with_expert.gemma_expert.model.layers.1.self_attn.q_proj.weight"

    broken = {k: v for k, v in state.items() if k != q}
    save_file(broken, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors: .*layers.1.self_attn.q_proj.weight"):
        Policy.from_pretrained(ckpt, device="cpu", dtype="float32", progress=False)

    save_file({**state, "model.some_new_head.weight": torch.zeros(3)}, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensors: model.some_new_head.weight"):
        Policy.from_pretrained(ckpt, device="cpu", dtype="float32", progress=False)

    save_file({**state, q: torch.zeros(3, 3)}, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.weight: checkpoint \[3, 3\]"):
        Policy.from_pretrained(ckpt, device="cpu", dtype="float32", progress=False)


def test_sharded_unprefixed_lm_head_only_checkpoint_loads_identically(golden, golden_policy, tmp_path):
    ckpt = _copy_checkpoint(golden, tmp_path)
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    # OpenPI-converted naming (no "model." root), the tied table only as lm_head, two shards.
    renamed = {k.removeprefix("model."): v for k, v in state.items() if k != embed}
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: renamed[k] for k in part}, str(ckpt / name))
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: n for n, part in shards.items() for k in part}}))
    policy = Policy.from_pretrained(ckpt, device="cpu", dtype="float32", progress=False)
    obs, noise = observation(13), np.zeros((50, 32), np.float32) + 0.5
    assert np.array_equal(policy.infer(obs, noise=noise).actions, golden_policy.infer(obs, noise=noise).actions)


def test_bfloat16_policy_keeps_exactly_the_fp32_set(golden):
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="bfloat16", progress=False)
    model = policy.model
    expected = {"vision.patch_embedding.weight", "vision.patch_embedding.bias", "vision.position_embedding.weight"}
    for prefix, module in model.named_modules():
        if isinstance(module, (RMSNorm, AdaRMSNorm)):  # SigLIP LayerNorms are bf16, as in OpenPI's set
            expected |= {f"{prefix}.{n}" for n, _ in module.named_parameters()}
    for proj in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        expected |= {f"{proj}.weight", f"{proj}.bias"}
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    others = {p.dtype for n, p in model.named_parameters() if n not in fp32}
    assert fp32 == expected
    assert others == {torch.bfloat16}
    counts = policy.metadata["parameter_counts"]
    assert counts["float32"] + counts["bfloat16"] == sum(p.numel() for p in model.parameters())
    # bf16 actions stay close to fp32 ones on the golden case (bf16 has ~3 significant digits).
    case = golden / "cases" / "three_cams_224"
    t = load_np(str(case / "tensors.safetensors"))
    meta = json.loads((case / "case.json").read_text())
    obs = {"images": {c: t[f"input.image_uint8.{c}"][0] for c in meta["cameras_present"][0]},
           "state": t["input.state"][0], "task": meta["tasks"][0]}
    out = policy.infer(obs, noise=t["input.noise"][0])
    assert np.isfinite(out.actions).all()
    assert np.abs(out.model_actions - t["expected.actions_model"][0]).max() < 0.1


def test_missing_checkpoint_and_hub_ids_fail_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        Policy.from_pretrained(tmp_path / "nope", device="cpu")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        Policy.from_pretrained(tmp_path, device="cpu")


# ---- speed options (exact by construction; the eager path proves it on the CPU) ---------------
def test_prefix_cache_hit_equals_miss_bit_for_bit(golden):
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    prefix_cache=2)
    obs, noise = observation(20), np.random.default_rng(20).normal(size=(50, 32)).astype(np.float32)
    miss = policy.infer(obs, noise=noise)
    assert policy.runtime.prefix_cache.stats()["misses"] == 1 and len(policy.runtime.prefix_cache) == 1
    hit = policy.infer(obs, noise=noise)
    assert policy.runtime.prefix_cache.stats()["hits"] == 1
    assert np.array_equal(miss.actions, hit.actions) and np.array_equal(miss.model_actions, hit.model_actions)
    # A different state changes the prompt, hence the key: no false hit.
    other = {**obs, "state": obs["state"] + 0.5}
    assert not np.array_equal(policy.infer(other, noise=noise).actions, hit.actions)
    assert policy.runtime.prefix_cache.stats()["hits"] == 1
    # LRU bound: a third distinct prefix evicts the oldest.
    policy.infer(observation(21), noise=noise)
    assert len(policy.runtime.prefix_cache) == 2


def test_prompt_buckets_shrink_the_prefix_and_keep_the_actions(golden):
    plain = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)
    bucketed = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                      prompt_buckets=(48, 96))
    obs, noise = observation(22), np.random.default_rng(22).normal(size=(50, 32)).astype(np.float32)
    assert int(bucketed.prepare(obs).token_mask.sum()) <= 48  # a short task + 14 state bins fits the first bucket
    assert bucketed.preprocessor.collate([bucketed.request(obs)])[0].tokens.shape[1] == 48
    # Padding tokens are masked out of attention and do not advance positions, so only the
    # float32 summation order of the shorter softmax differs: ~1e-7, well below 1e-5.
    assert np.abs(plain.infer(obs, noise=noise).actions - bucketed.infer(obs, noise=noise).actions).max() < 1e-5
    assert bucketed.metadata["prompt_buckets"] == [48, 96, 200]
    # The default ("auto") keeps the reference's prompt length on a CPU.
    assert plain.metadata["prompt_buckets"] is None
    assert plain.preprocessor.collate([plain.request(obs)])[0].tokens.shape[1] == 200


@pytest.mark.parametrize("given,max_len,device,fast_path,expected", [
    ("auto", 200, "cuda", True, (96,)),  # half of LeRobot's 200-token default, a multiple of 16
    ("auto", 48, "cuda", True, (16,)),  # Pi0's 48
    ("auto", 20, "cuda", True, ()),  # half would be under 16 tokens: no bucket
    ("auto", 200, "cpu", True, ()),  # a CPU keeps the reference's shapes
    ("auto", 200, "cuda", False, ()),  # and so does the eager model on CUDA
    ("none", 200, "cuda", True, ()),
    ("", 200, "cuda", True, ()),
    ("96,48", 200, "cpu", True, (48, 96)),  # given lengths hold on every device
    ((64,), 200, "cuda", False, (64,)),
])
def test_prompt_buckets_option_resolves_per_device(given, max_len, device, fast_path, expected):
    settings = RuntimeConfig(prompt_buckets=given, fast_path=fast_path)
    assert settings.resolved_prompt_buckets(max_len, device) == expected


def test_prompt_buckets_option_is_validated():
    assert RuntimeConfig().prompt_buckets == "auto" and RuntimeConfig(prompt_buckets="AUTO").prompt_buckets == "auto"
    for bad in ("4x", "auto,48", "0"):
        with pytest.raises(ConfigError, match="prompt_buckets"):
            RuntimeConfig(prompt_buckets=bad)


def test_auto_dtype_is_float32_on_the_cpu(golden):
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="auto", progress=False)
    assert policy.metadata["dtype"] == "float32"
    with pytest.raises(ConfigError, match="float16"):
        Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float16", progress=False)


def test_uint8_images_travel_as_bytes_and_convert_bit_identically(golden_policy):
    obs = observation(30, cameras=("base_0_rgb", "right_wrist_0_rgb"))
    request = golden_policy.request(obs)
    prepared = golden_policy.prepare(request)
    assert prepared.images.dtype == torch.uint8  # 4x less host work and transfer than float32
    on_device = to_device(golden_policy.preprocessor.collate([request])[0], "cpu").images[0]
    for slot, cam in enumerate(prepared.slot_cameras):
        expected = prepare_image(obs["images"][cam], 224, cam) if cam in obs["images"] else torch.full((3, 224, 224), -1.0)
        assert torch.equal(on_device[slot], expected)


def test_read_only_arrays_are_accepted_without_warnings(golden_policy):
    # Arrays decoded from msgpack are read-only; torch warns when handed one without a copy.
    obs = observation(31)
    for image in obs["images"].values():
        image.flags.writeable = False
    obs["images"]["base_0_rgb"] = obs["images"]["base_0_rgb"].astype(np.float32) / 255.0
    obs["images"]["base_0_rgb"].flags.writeable = False
    obs["state"].flags.writeable = False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isfinite(golden_policy.infer(obs, seed=0).actions).all()


@pytest.mark.parametrize("through", ["vlaserve", "torch"])
def test_the_first_read_only_frame_of_a_process_warns_nowhere(through):
    """Torch warns once per process when handed a read-only array; a fresh process shows that the frames'
    path takes that first warning (warnings are errors there), and that without it torch would warn."""
    import subprocess
    import sys

    call = "to_chw_tensor(a, 'f')" if through == "vlaserve" else "torch.from_numpy(a)"
    code = ("import warnings, numpy as np, torch\n"
            "from vlaserve.processing.images import to_chw_tensor\n"
            "warnings.simplefilter('error')\n"
            "a = np.zeros((4, 4, 3), np.uint8); a.flags.writeable = False\n"
            f"for _ in range(2): {call}\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if through == "vlaserve":
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode != 0 and "not writable" in run.stderr


def test_per_request_prefix_cache_and_graph_flags_reach_the_runtime(golden):
    """runtime.prefix_cache false: that item is neither looked up nor stored, the others are;
    runtime.cuda_graph false reaches the runner as graphs=False (the eager runner has none to skip)."""
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    prefix_cache=4)
    cache, runner = policy.runtime.prefix_cache, policy.runtime.runner
    seen = []
    dispatch = runner.dispatch
    runner.dispatch = lambda *args, **kwargs: seen.append(kwargs["graphs"]) or dispatch(*args, **kwargs)
    obs = [observation(30 + i, size=(32, 32)) for i in range(2)]

    def run(graphs: bool):
        requests = [policy.request(o, noise=np.zeros((50, 32), np.float32)) for o in obs]
        requests[1].prefix_cache = False
        for r in requests:
            r.cuda_graph = graphs
        return policy.run(requests)

    first = run(graphs=False)
    assert cache.stats() == {"entries": 1, "max_entries": 4, "hits": 0, "misses": 1}  # item 1: no lookup, no store
    second = run(graphs=True)
    assert cache.stats() == {"entries": 1, "max_entries": 4, "hits": 1, "misses": 1}
    assert seen == [False, True]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.actions, b.actions)
