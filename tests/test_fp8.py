"""FP8 (e4m3) serving: the quantization math against float references with stated bounds, the
accuracy gate's arithmetic on hand-made arrays, and the gate on the golden checkpoint (passing,
and refusing a broken scale file, other weights' scales, reused calibration frames and a threshold
tighter than what fp8 measures)."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from fixtures import fixture_dir, tiny_interpreted_model
from test_bench_smoke import BF16_BOUND, run
from torch import nn

from vlaserve.cli import main
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError
from vlaserve.golden import GoldenCase, case_dirs
from vlaserve.model.fp8 import (E4M3, E4M3_MAX, Fp8Linear, QuantizedRows, convert_to_fp8, dequantize, fp8_targets,
                                linear_fp8, quantize, quantize_rows, quantize_weight)
from vlaserve.policy import Policy
from vlaserve.precision import (GateThresholds, PrecisionGateError, apply_precision, compare_actions, cosines,
                                gate_failures, read_scales, save_observation, synthetic_observations)
from vlaserve.runtime.fast.model import FastPi05
from vlaserve.runtime.fast.weights import Fp8Weight
from vlaserve.server.metrics import Metrics

# e4m3: 3 mantissa bits, so rounding to nearest is off by at most half a step, 2^-4 of the value,
# for normal numbers (|q| >= 2^-6); below that the steps are 2^-9 apart (subnormals), an absolute
# error of at most 2^-10 in quantized units, i.e. 2^-10 * scale in real units.
REL = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def element_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return REL * x.abs() + SUBNORMAL_ABS * scale


# ---- quantization math ------------------------------------------------------------------------
def test_weight_scales_are_per_output_channel_and_zero_safe():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1e-3, -896.0]])
    q, scale = quantize_weight(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([2.0 / 448, 1.0, 896.0 / 448]), rtol=0, atol=0)
    # Each row's largest magnitude lands on the largest e4m3 value (448 is representable exactly).
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    deq = dequantize(q, scale[:, None])
    assert torch.isfinite(deq).all()
    assert (deq - w).abs().le(element_bound(w, scale[:, None])).all()


def test_weight_rounding_error_within_the_e4m3_bound_on_random_weights():
    torch.manual_seed(0)
    w = torch.randn(256, 512) * torch.logspace(-3, 1, 256)[:, None]  # channels of very different ranges
    q, scale = quantize_weight(w)
    err = (dequantize(q, scale[:, None]) - w).abs()
    assert err.le(element_bound(w, scale[:, None])).all()
    # Per-channel scales keep a small channel's precision: its relative error is no worse than a large one's.
    rel = (err.sum(1) / w.abs().sum(1))
    assert rel.max() < 0.04, rel.max()  # uniform rounding over a binade averages well under 2^-4


def test_per_token_scales_are_per_row_and_independent():
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    x[2] *= 1000.0  # an outlier token
    q, scale = quantize_rows(x)
    assert scale.shape == (4, 1)
    torch.testing.assert_close(scale[:, 0], x.abs().amax(1) / E4M3_MAX, rtol=0, atol=0)
    assert q.float().abs().amax(1).tolist() == [448.0] * 4
    # The outlier does not coarsen the other tokens: quantizing them without it gives the same bits.
    q_alone, _ = quantize_rows(x[[0, 1, 3]])
    assert torch.equal(q_alone.view(torch.uint8), q[[0, 1, 3]].view(torch.uint8))
    assert (dequantize(q, scale) - x).abs().le(element_bound(x, scale)).all()


def test_saturation_at_448_instead_of_nan():
    x = torch.tensor([[1e6, -1e6, 500.0, 0.25, 0.0]])
    q = quantize(x, torch.tensor(1.0))
    assert q.float().tolist() == [[448.0, -448.0, 448.0, 0.25, 0.0]]
    # A static scale 1000x too small clips every large activation at +-448 * scale: finite, wrong.
    static = torch.tensor(x.abs().max().item() / 448 / 1000)
    q, s = quantize_rows(x, static)
    assert torch.isfinite(dequantize(q, s)).all() and dequantize(q, s).abs().max() <= 448 * static * (1 + 1e-6)


def test_zero_activation_rows_stay_zero():
    q, scale = quantize_rows(torch.zeros(3, 16))
    assert scale.eq(1.0).all() and q.float().eq(0).all()


def test_fp8_gemm_within_the_worst_case_bound_of_a_float64_reference():
    """|sum_k x_k w_k (1 + d_k)(1 + e_k) - sum_k x_k w_k| <= sum_k (a_k |w_k| + |x_k| c_k + a_k c_k), with
    a_k, c_k the per-element bounds above; fp32 accumulation adds ~K * 2^-24 relative, covered by 1e-5."""
    torch.manual_seed(2)
    m, k, n = 32, 1024, 96
    x, w, bias = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(n)
    qw, sw = quantize_weight(w)
    out = linear_fp8(x, qw, sw, bias).double()
    ref = x.double() @ w.double().t() + bias.double()
    sx = x.abs().amax(1, keepdim=True) / E4M3_MAX
    a, c = element_bound(x, sx).double(), element_bound(w, sw[:, None]).double()
    bound = a @ w.abs().double().t() + x.abs().double() @ c.t() + a @ c.t()
    scale_of_sum = x.abs().double() @ w.abs().double().t()
    assert ((out - ref).abs() <= bound + 1e-5 * scale_of_sum).all()
    # The typical error is far below the worst case: rounding errors of random sign add like a random
    # walk, sqrt(sum (x_k w_k)^2) * ~2^-4 * sqrt(2/3) at most (two operands, uniform within +-2^-4).
    walk = ((x.double()[:, None, :] * w.double()[None]) ** 2).sum(-1).sqrt()
    ratio = ((out - ref) / walk).pow(2).mean().sqrt().item()
    assert ratio < REL * math.sqrt(2 / 3), ratio
    assert ((out - ref).abs() / bound).mean() < 0.1  # and far from the worst case


def test_emulation_matches_torchs_own_scaled_mm():
    """torch._scaled_mm's CPU kernel computes the same scaled product; they differ by fp32 summation order."""
    torch.manual_seed(3)
    x, w, bias = torch.randn(7, 128), torch.randn(48, 128), torch.randn(48)
    qw, sw = quantize_weight(w)
    qx, sx = quantize_rows(x)
    try:
        theirs = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, -1), bias=bias, out_dtype=torch.float32)
    except RuntimeError as e:  # torch 2.11's CPU kernel takes per-tensor scales only (2.13's takes rows)
        if "per-tensor scaling for CPU" in str(e):
            pytest.skip(f"this torch's CPU _scaled_mm has no row-wise scales ({torch.__version__})")
        raise
    torch.testing.assert_close(linear_fp8(x, qw, sw, bias), theirs, rtol=1e-5, atol=1e-5)


def test_rows_quantized_ahead_give_the_same_product():
    """What a producer kernel hands linear_fp8 (QuantizedRows: quantize_rows' rows and scales, and the dtype they
    had) gives the product of the unquantized input, bit for bit: the same operands reach the same GEMM. A layer
    with a static input scale takes no per-token rows."""
    torch.manual_seed(5)
    x, w, bias = torch.randn(2, 3, 64), torch.randn(32, 64), torch.randn(32)
    qw, sw = quantize_weight(w)
    ahead = QuantizedRows(*quantize_rows(x.reshape(-1, 64)), x.dtype)
    out = linear_fp8(ahead, qw, sw, bias)
    assert out.shape == (6, 32) and out.dtype == x.dtype
    assert torch.equal(out, linear_fp8(x, qw, sw, bias).reshape(6, 32))
    with pytest.raises(ValueError, match="static input scale"):
        linear_fp8(ahead, qw, sw, bias, input_scale=torch.tensor(0.01))


def test_fp8_linear_is_a_drop_in_for_nn_linear_at_half_the_weight_bytes():
    torch.manual_seed(4)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    out = fp8(x)
    assert out.shape == (2, 5, 32) and out.dtype == torch.bfloat16
    ref = linear(x).float()
    assert ((out.float() - ref).abs() / ref.abs().mean()).mean() < 0.05
    assert fp8.weight.element_size() * 2 == linear.weight.element_size()
    static = Fp8Linear.from_linear(linear, input_scale=x.abs().max().item() / 448)
    assert static.input_scale is not None and torch.isfinite(static(x)).all()


# ---- the gate's arithmetic --------------------------------------------------------------------
def test_cosines_on_hand_made_samples():
    a = np.array([[1.0, 0.0], [1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]])
    b = np.array([[0.0, 1.0], [-1.0, -2.0], [0.0, 0.0], [1.0, 0.0], [6.0, 8.0]])
    np.testing.assert_allclose(cosines(a, b), [0.0, -1.0, 1.0, 0.0, 1.0], rtol=0, atol=1e-15)  # float64 rounding


def test_compare_actions_figures_on_hand_made_actions():
    ref = np.ones((2, 3, 4))
    ref[..., 3] = [[1.0, -1.0, 0.5], [0.2, 0.3, -0.4]]  # dim 3: a gripper, sign = open/close
    cand = ref.copy()
    cand[0, 1, 0] += 0.25
    cand[1, 2, 2] -= 0.5
    cand[0, 2, 3] = -0.1  # one gripper sign flip
    cand[1, 0, 3] = -0.2  # and another
    r = compare_actions(ref, cand, gripper_dims=(3,), groups=(("pos", (0, 1, 2)),))
    assert r["max_abs_delta"] == [0.25, 0.0, 0.5, 0.6]
    assert r["gripper_sign_flips"] == 2
    expected = cosines(ref, cand)
    assert r["worst_cosine"] == expected.min() and r["mean_cosine"] == pytest.approx(expected.mean())
    assert r["groups"]["pos"]["worst_cosine"] == pytest.approx(cosines(ref[..., :3], cand[..., :3]).min())
    failures = gate_failures(r)
    assert any("gripper sign flips 2 > 0" in f for f in failures)
    with pytest.raises(PrecisionGateError, match="outside the 4 actions"):
        compare_actions(ref, cand, gripper_dims=(4,))


def test_a_group_fails_the_gate_while_the_overall_cosine_passes():
    """FlashRT's case: an overall cosine of 0.9997 hid a group at 0.96."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(8, 10, 14)) + 5.0
    ref[..., 3:6] = rng.normal(size=(8, 10, 3)) * 0.2  # small "rotation" dims
    cand = ref.copy()
    cand[..., 3:6] += rng.normal(size=(8, 10, 3)) * 0.07
    r = compare_actions(ref, cand, groups=(("rotation", (3, 4, 5)),))
    assert r["mean_cosine"] > 0.999 and r["worst_cosine"] > 0.995
    assert r["groups"]["rotation"]["mean_cosine"] < 0.99
    assert [f for f in gate_failures(r) if f.startswith("group rotation: mean cosine")]
    assert not [f for f in gate_failures(r) if not f.startswith("group rotation")]


def test_nan_actions_fail_the_gate():
    ref = np.ones((2, 3, 4))
    cand = ref.copy()
    cand[0, 0, 0] = np.nan
    assert gate_failures(compare_actions(ref, cand))


def test_gate_options_parse():
    r = RuntimeConfig(gripper_dims="6,13", action_groups="left=0-6;right=7-13")
    assert r.gripper_dims == (6, 13)
    assert r.action_groups == (("left", tuple(range(7))), ("right", tuple(range(7, 14))))
    assert RuntimeConfig(action_groups={"arm": [0, 1]}).action_groups == (("arm", (0, 1)),)
    for bad in (dict(precision="fp4"), dict(precision_gate="maybe"), dict(gripper_dims="six"),
                dict(action_groups="0-5"), dict(precision="fp8", memory_profile="offload"),
                dict(precision="fp8", gemm_library="quack")):
        with pytest.raises(ConfigError):
            RuntimeConfig(**bad)


# ---- the gate on the golden checkpoint --------------------------------------------------------
@pytest.fixture(scope="module")
def reference_policy(golden):
    """The golden checkpoint in float32 on the CPU, not converted (each test converts a fresh copy)."""
    return Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)


def gate(golden, k=3, thresholds=GateThresholds(), **settings):
    """apply_precision on a fresh load of the golden checkpoint (it converts the model in place)."""
    fresh = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)
    config = replace(fresh.runtime.settings, precision="fp8", **settings)
    report = apply_precision(fresh.model, golden / "checkpoint", fresh.config, fresh.preprocessor, fresh.layout,
                             fresh.runtime.device, config, k=k, thresholds=thresholds)
    return report, fresh


def test_fp8_policy_passes_the_gate_and_serves(golden):
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    precision="fp8", gripper_dims="6,13")
    report = policy.metadata["precision"]
    assert report["passed"] and report["samples"] == 8 and report["activation_scales"] == "per-token"
    # Measured on this tiny random checkpoint: 1 - cosine ~5e-7, max |delta| <= ~0.006 in action units.
    assert report["mean_cosine"] > 0.99999 and report["fp8_layers"] == len(fp8_targets(policy.model))
    assert policy.parameter_counts["float8_e4m3fn"] > 0
    obs = synthetic_observations(policy.config, 1)[0].observation
    assert np.isfinite(policy.infer(obs, seed=0).actions).all()


def test_fp8_actions_follow_the_reference(reference_policy, golden):
    """The converted model's actions are the reference's within fp8's error (figures as the gate reports)."""
    obs = synthetic_observations(reference_policy.config, 1, seed=7)[0].observation
    ref = reference_policy.infer(obs, seed=3).actions
    _, fp8 = gate(golden, k=1)
    out = fp8.infer(obs, seed=3).actions
    assert cosines(ref[None], out[None])[0] > 0.9999
    assert not np.array_equal(ref, out)  # the fp8 layers did run


def test_gate_refuses_a_threshold_tighter_than_measured(golden):
    report, _ = gate(golden, precision_gate="warn")
    measured = report["worst_cosine"]
    assert report["passed"] and measured < 1.0
    tight = GateThresholds(min_worst_cosine=(1.0 + measured) / 2)  # halfway between the measurement and 1
    with pytest.raises(PrecisionGateError, match="worst cosine .* < "):
        gate(golden, thresholds=tight)
    warned, fresh = gate(golden, thresholds=tight, precision_gate="warn")
    assert not warned["passed"] and warned["failures"][0].startswith("worst cosine")
    assert any(isinstance(m, Fp8Linear) for m in fresh.model.modules())  # warn: converted and serving


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, reference_policy, golden):
    """Calibration and gate observations as .npz files, and a scales file from the calibration ones."""
    root = tmp_path_factory.mktemp("frames")
    for i, o in enumerate(synthetic_observations(reference_policy.config, 6, seed=100)):
        (root / ("calibration" if i < 3 else "gate")).mkdir(exist_ok=True)
        save_observation(root / ("calibration" if i < 3 else "gate") / f"frame{i}.npz", o.observation)
    scales = root / "scales.json"
    assert main(["calibrate", str(golden / "checkpoint"), "--device", "cpu", "--observations",
                 str(root / "calibration"), "--out", str(scales)]) == 0
    return root, scales


def test_calibrated_scales_pass_the_gate(recorded, capsys, golden):
    root, scales = recorded
    doc = json.loads(scales.read_text())
    assert len(doc["observations_sha256"]) == 3
    ran = [v for v in doc["layers"].values() if v["scale"] is not None]
    assert all(v["scale"] == pytest.approx(v["amax"] / 448) for v in ran)
    assert main(["check-precision", str(golden / "checkpoint"), "--device", "cpu", "--observations",
                 str(root / "gate"), "--scales", str(scales)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["activation_scales"] == "static" and report["samples"] == 3


def test_scales_one_thousand_times_too_small_fail_the_gate(recorded, tmp_path, golden):
    """On this tiny random checkpoint the prefix barely steers the actions: calibrated fp8 measures
    1 - mean cosine ~5e-7, scales 1000x too small (every activation clipped to 1/1000 of its range)
    ~7.6e-4, still inside the default 0.999 (and so does zeroing the prefix: random weights say
    little). A gate at 1 - 1e-4 separates them with 200x and 7x margins."""
    root, scales = recorded
    doc = json.loads(scales.read_text())
    for entry in doc["layers"].values():
        if entry["scale"] is not None:
            entry["scale"] /= 1000
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    strict = GateThresholds(min_mean_cosine=0.9999)
    good, _ = gate(golden, thresholds=strict, precision_scales=str(scales), precision_observations=str(root / "gate"))
    assert good["passed"] and 1 - good["mean_cosine"] < 1e-6
    with pytest.raises(PrecisionGateError, match="mean cosine .* < 0.9999"):
        gate(golden, thresholds=strict, precision_scales=str(broken), precision_observations=str(root / "gate"))


def test_scales_for_other_weights_are_refused(recorded, tmp_path, golden):
    _, scales = recorded
    doc = json.loads(scales.read_text())
    doc["weights_sha256"] = "0" * 64
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="calibrated for other weights"):
        gate(golden, precision_scales=str(other))
    doc = json.loads(scales.read_text())
    del doc["layers"]["vlm.layers.0.mlp.down_proj"]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="lack 1 layers"):
        gate(golden, precision_scales=str(partial))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"layers": {}}))
    with pytest.raises(ConfigError, match="not a vlaserve-fp8-scales/1 file"):
        read_scales(unknown, "0")


def test_calibration_frames_are_never_gate_frames(recorded, golden):
    root, scales = recorded
    with pytest.raises(PrecisionGateError, match="calibrated the activation scales"):
        gate(golden, precision_scales=str(scales), precision_observations=str(root / "calibration"))


def test_check_precision_exit_code(golden, capsys):
    assert main(["check-precision", str(golden / "checkpoint"), "--device", "cpu", "--k", "2",
                 "--gripper-dims", "6", "--action-groups", "left=0-6;right=7-13"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and set(report["groups"]) == {"left", "right"}
    assert main(["check-precision", str(golden / "checkpoint"), "--device", "cpu", "--gripper-dims", "99"]) == 2
    # A threshold tighter than fp8 measures here (1 - cosine ~5e-7): the report says so and the exit code is 1.
    assert main(["check-precision", str(golden / "checkpoint"), "--device", "cpu", "--k", "2",
                 "--min-mean-cosine", "0.99999999"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["passed"] and report["failures"][0].startswith("mean cosine")


def test_fast_path_math_takes_the_fp8_gemms(golden):
    """The fast path's math (stock kernels on the CPU: fused q/k/v and gate/up weights and scales)
    on the fp8 model computes what the eager fp8 model does: the same quantization, other summation
    orders. Where an activation lies on an e4m3 rounding boundary the two round it apart (one step,
    2^-4 relative, on one element), so they differ by more than the fp32 path's 1e-5, but far less
    than fp8's own error (measured on batch2: 6.7e-5 against 4.9e-3)."""
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                    precision="fp8")
    fast = FastPi05(policy.model, use_triton=False)
    assert isinstance(fast.w.vlm[0].qkv, Fp8Weight) and isinstance(fast.w.vision_qkv[0][0], Fp8Weight)
    case = GoldenCase.load(next(c for c in case_dirs(golden) if c.name == "batch2"))
    inputs, _, _ = policy.preprocessor.collate([policy.request(o) for o in case.observations()])
    b, n = inputs.image_masks.shape
    plen = n * policy.model.vision.dims.num_patches + inputs.tokens.shape[1]
    k = torch.zeros(len(policy.model.vlm.layers), b, -(-(plen + 50) // 64) * 64, policy.model.vlm.dims.head_dim)
    v = torch.zeros_like(k)
    noise = torch.from_numpy(case.tensors["input.noise"])
    with torch.no_grad():
        pad = fast.prefix(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask, k, v,
                          inputs.vision_slots())
        fast_actions = fast.denoise(pad, noise, fast.schedule(10), k, v, None)
        embs, pad_mask = policy.model.embed_prefix(inputs.images, inputs.image_masks, inputs.tokens,
                                                   inputs.token_mask)
        eager_actions = policy.model.denoise(policy.model.compute_prefix(embs, pad_mask), noise, 10, None)
    fp8_error = (eager_actions - torch.from_numpy(case.tensors["expected.actions_model"])).abs().max()
    assert fp8_error > 1e-4  # fp8 did run
    assert (fast_actions - eager_actions).abs().max() < 0.1 * fp8_error


def test_fp8_with_the_expert_on_pi0():
    policy = Policy.from_pretrained(fixture_dir("pi0_golden") / "checkpoint", device="cpu", dtype="float32",
                                    progress=False, precision="fp8+expert")
    report = policy.metadata["precision"]
    assert report["passed"] and any(name.startswith("expert.") for name in fp8_targets(policy.model, expert=True))
    assert all(isinstance(m, Fp8Linear) for m in (policy.model.expert.layers[0].mlp.down_proj,
                                                   policy.model.vlm.layers[0].self_attn.q_proj))
    with pytest.raises(ConfigError, match="eager model"):
        FastPi05(policy.model, use_triton=False)


def test_bench_gpu_smoke_with_fp8(tmp_path):
    """bench_gpu.py --precision fp8 on the CPU at the tiny sizes: its fp8 section runs and reports."""
    run("bench_gpu", tmp_path, "--precision", "fp8")
    r = json.loads((tmp_path / "bench_gpu.json").read_text())["fp8"]
    assert r["fp8_layers"] > 0 and r["weight_bytes"]["fp8"] < r["weight_bytes"]["bf16"]
    row = r["per_batch"]["1"]
    assert row["fp8"]["p50_ms"] > 0 and row["cosine_to_bf16"]["worst"] > 0.999
    assert 0 < row["error_vs_fp32"]["fp8"]["max"] < BF16_BOUND


def test_gate_figures_are_metrics():
    metrics = Metrics(max_batch_size=1)
    metrics.record_precision({"precision": "fp8", "mean_cosine": 0.9995, "worst_cosine": 0.998,
                              "gripper_sign_flips": 0, "passed": True})
    text = metrics.render().decode()
    assert "vlaserve_fp8_gate_mean_cosine 0.9995" in text and "vlaserve_fp8_gate_passed 1.0" in text
    bf16 = Metrics(max_batch_size=1)
    bf16.record_precision({"precision": "bf16"})
    assert "fp8_gate" not in bf16.render().decode()


def test_a_fast_path_never_runs_weights_fused_before_conversion(golden):
    """Fused weights are cached on the model: converting it afterwards must not leave a fast path on the bf16 copy."""
    policy = Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)
    FastPi05(policy.model, use_triton=False)
    convert_to_fp8(policy.model)
    with pytest.raises(ValueError, match="changed precision after their weights were fused"):
        FastPi05(policy.model, use_triton=False)


QUANTIZER_SCRIPT = r'''
import json, torch
from vlaserve.model.fp8 import E4M3_MAX, quantize_rows
from vlaserve.runtime.fast import fp8_kernels
torch.manual_seed(0)
x = (torch.randn(6, 300) * torch.logspace(-3, 3, 6)[:, None]).half()
x[3] = 0  # an all-zero row (scale 1)
x[4, :8] = torch.tensor([-0.0, 1e-4, -1e-4, 200.0, 208.0, 216.0, 232.0, 448.0])  # -0, subnormals, ties
Config = fp8_kernels.QuantizerConfig
configs = {"default": None, "one pass, 4 rows (2 left over)": Config(4, 512, True, 4),
           "two passes of 128 columns": Config(1, 128, False, 4), "two passes, 8 rows": Config(8, 128, False, 2)}
out = {}
for name, static in (("dynamic", None), ("static", torch.tensor(x.abs().max().item() / E4M3_MAX / 10))):
    for dtype in (torch.float16, torch.float32):
        q_ref, s_ref = quantize_rows(x.to(dtype), static)
        for label, config in configs.items():
            q, s = fp8_kernels.quantize_rows(x.to(dtype), static, config)
            out[f"{name}_{dtype}_{label}"] = {"bits_equal": torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)),
                                              "scales_equal": torch.equal(s, s_ref)}
print(json.dumps(out))
'''


def test_triton_quantizer_is_torchs_bit_for_bit_in_the_interpreter():
    """The fast path's one-kernel quantization (runtime/fast/fp8_kernels.py) against quantize_rows in
    Triton's interpreter: the same e4m3 bits and scales, -0, subnormals, ties to even and saturation
    included (the kernel rounds in fp32 arithmetic, so its cast is exact on the GPU and here alike), in
    each way the kernel splits the rows: one pass or two, several rows a program, rows left over."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", QUANTIZER_SCRIPT], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert len(out) == 16 and all(v["bits_equal"] and v["scales_equal"] for v in out.values()), out


PRODUCERS_SCRIPT = r'''
import json, torch
from vlaserve.runtime.fast import fp8_kernels, kernels
torch.manual_seed(0)
out = {}
def same(a, b):
    return torch.equal(a.q.view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a.scale, b[1])
for rows, width in ((5, 256), (3, 64)):  # the prefix's RMSNorm (powers of two)
    h = torch.randn(rows, width).half()
    delta = (torch.randn(rows, width) * 4).half()
    delta[1] = -h[1]  # h becomes all zero: scale 1
    w = (torch.rand(width) + 0.5).half()
    for name, kwargs in (("norm", {}), ("residual + norm", {"delta": delta})):
        h_plain, h_fused = h.clone(), h.clone()
        plain = kernels.residual_norm(h_plain, w, eps=1e-6, **kwargs)
        fused = kernels.residual_norm(h_fused, w, eps=1e-6, quantize=True, **kwargs)
        out[f"rms {name} {rows}x{width}"] = same(fused, fp8_kernels.quantize_rows(plain)) and torch.equal(h_plain, h_fused)
for rows, width in ((4, 72), (3, 1152)):  # SigLIP's LayerNorm: rows of one block, partly masked
    h = (torch.randn(rows, width) + 0.3).half()
    delta = (torch.randn(rows, width) * 4).half()
    delta[1] = -h[1]  # h becomes all zero: y is the bias
    w, bias = torch.rand(width) + 0.5, torch.randn(width) * 0.1
    if rows == 4:
        bias.zero_()  # then that row's output is all zero too (scale 1)
    for name, kwargs in (("norm", {}), ("residual + norm", {"delta": delta})):
        h_plain, h_fused = h.clone(), h.clone()
        plain = kernels.residual_layer_norm(h_plain, w, bias, 1e-6, **kwargs)
        fused = kernels.residual_layer_norm(h_fused, w, bias, 1e-6, quantize=True, **kwargs)
        out[f"layer {name} {rows}x{width}"] = same(fused, fp8_kernels.quantize_rows(plain)) and torch.equal(h_plain, h_fused)
for rows, width in ((3, 300), (2, 1100)):  # rows of one block, partly masked
    x = (torch.randn(rows, 2 * width) * 2).half()
    x[0, :width] = 0  # gate 0: an all-zero GeGLU row (scale 1)
    x[1, :4] = torch.tensor([30.0, -30.0, 1e-5, -0.0])  # GELU's saturated ends, a tiny value, -0
    out[f"geglu {rows}x{width}"] = same(fp8_kernels.geglu_quantized(x), fp8_kernels.quantize_rows(kernels.geglu(x)))
print(json.dumps(out))
'''


def test_a_kernel_that_quantizes_its_output_gives_the_quantizers_bits():
    """The prefix's RMSNorm and SigLIP's LayerNorm kernels with quantize=True (their output goes to an fp8
    GEMM) and the one-pass GeGLU quantizer, against kernels.residual_norm's / residual_layer_norm's /
    kernels.geglu's output quantized by fp8_kernels.quantize_rows, in Triton's interpreter (float16
    there): the same e4m3 bits and scales, all-zero rows included, and the same residual stream. Exact
    equality is the claim: each rounds the same fp32 values at the same points, in the same order (on the
    GPU: runs 254-255, 05f44b8:bench/probes/fp8_producers.py, and run 260 for the LayerNorm; on the GPU the
    order also rests on the kernels' layouts, which test_gpu_targets checks)."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", PRODUCERS_SCRIPT], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert len(out) == 10 and all(out.values()), out


def test_the_one_pass_geglu_quantizer_refuses_what_it_cannot_hold():
    from vlaserve.runtime.fast import fp8_kernels

    if fp8_kernels.triton is None:
        pytest.skip("no Triton")
    with pytest.raises(ValueError, match="rows up to 16384 wide, not 16400"):
        fp8_kernels.geglu_quantized(torch.zeros(1, 2 * (fp8_kernels.GEGLU_MAX_WIDTH + 16)))
    with pytest.raises(ValueError, match="contiguous rows, not strided"):
        fp8_kernels.geglu_quantized(torch.zeros(4, 64)[:, :32])


FUSED_CALL_SCRIPT = tiny_interpreted_model(depth=2, cameras=2, steps=2) + r'''
from vlaserve.model.fp8 import convert_to_fp8
from vlaserve.runtime.fast import fp8_kernels

masks = torch.ones(b, cams, dtype=torch.bool)
tok = torch.randint(1, 64, (b, tokens))
tmask = torch.ones(b, tokens, dtype=torch.bool)
tmask[:, 6:] = False
noise = torch.randn(b, horizon, 32)
model = random_model(cfg, torch.float16, "cpu", seed=1, std=0.05)
convert_to_fp8(model)

quantizer, calls = fp8_kernels.quantize_rows, []

def counted(*args, **kwargs):
    calls.append(1)
    return quantizer(*args, **kwargs)

fp8_kernels.quantize_rows = counted  # the fast path looks it up at each call

def run(producers_quantize):
    calls.clear()
    fast = FastPi05(model, use_triton=True)
    if not producers_quantize:  # a quantizer kernel before every fp8 GEMM instead
        fast.gemm.quantizes = lambda w: False
    plen = cams * 4 + tokens
    cache = -(-(plen + horizon) // 64) * 64
    k = torch.zeros(2, b, cache, 128, dtype=torch.float16)
    v = torch.zeros_like(k)
    with torch.no_grad():
        pad = fast.prefix(images, masks, tok, tmask, k, v, cams)
        out = fast.denoise(pad, noise, fast.schedule(steps), k, v, None)
    return out, k, len(calls)

a, ka, separate = run(False)
c, kc, left = run(True)
print(json.dumps({"quantizer_calls": {"apart": separate, "served": left},
                  "same": bool(torch.equal(a, c)) and bool(torch.equal(ka, kc))}))
'''


@pytest.mark.slow
def test_kernels_that_quantize_their_outputs_compute_the_same_call():
    """A small fp8 model (2 SigLIP layers, 2 Gemma layers) through FastPi05 in Triton's interpreter, as
    served (the prefix's RMSNorms and GeGLU and SigLIP's LayerNorms quantize their outputs for the fp8
    GEMMs after them) and with a quantizer kernel before every fp8 GEMM instead: the same actions and K/V
    cache bit for bit. Quantizer kernels: every fp8 GEMM's input apart = SigLIP's 4 a layer (8), Gemma's
    first layer's 4 and its last's q/k/v (k and v only) = 13; as served, Gemma's q/k/v (both layers),
    gate/up and down and SigLIP's q/k/v and fc1 (2 a layer) are quantized by their producers: 5 left."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", FUSED_CALL_SCRIPT], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out == {"quantizer_calls": {"apart": 13, "served": 5}, "same": True}, out
