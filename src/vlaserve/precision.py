"""FP8 serving and its accuracy gate.

`apply_precision` turns a loaded model's SigLIP and Gemma-prefix linear layers into fp8 (model/fp8.py)
and, before anything serves, runs K held-out observations through the model as loaded and as fp8
with the same noise, compares the actions in the robot's units (un-normalized, absolute) and refuses
(PrecisionGateError) when a figure misses its threshold, unless the gate is set to warn.

Observations for the gate and for calibration are .npz files, one observation each, whose arrays are
an observation's keys in any layout the server takes (LeRobot's `observation.images.<camera>` as
uint8 HWC, `observation.state`, and `task` as a 0-d string array; or OpenPI's keys). Without a
directory the gate builds K synthetic observations from the checkpoint's config (seeded).

Static activation scales (`calibrate`) are a JSON file keyed on the checkpoint's weights (sha256 of
its safetensors files) and listing the sha256 of every observation file they were computed from: a
file for other weights is refused, and so is a gate observation that was a calibration one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint.files import checkpoint_files
from .config import PolicyConfig, RuntimeConfig
from .errors import ConfigError
from .model.fp8 import convert_to_fp8, fp8_targets, scales_for
from .processing.layouts import KeyLayout
from .processing.prepare import Preprocessor
from .runtime.runner import EagerRunner
from .runtime.transfer import to_device
from .types import Observation, Request

log = logging.getLogger(__name__)

GATE_SAMPLES = 8  # held-out observations the startup gate runs (FlashRT's published gates use 8)
SCALES_FORMAT = "vlaserve-fp8-scales/1"
SYNTHETIC_TASK = "pick up the cube"  # short: a checkpoint with a short prompt length still fits it


class PrecisionGateError(ConfigError):
    """fp8's actions differ from the serving dtype's beyond a gate threshold (or the gate's inputs are invalid)."""


@dataclass(frozen=True)
class GateThresholds:
    """FlashRT's published gates for a precision tier."""

    min_mean_cosine: float = 0.999
    min_worst_cosine: float = 0.995
    max_gripper_flips: int = 0


@dataclass(frozen=True)
class GateObservation:
    name: str
    observation: dict
    sha256: str | None  # of the file it came from; None for a synthetic one


# ---- the gate's arithmetic --------------------------------------------------------------------
def cosines(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per-sample cosine of [K, ...] arrays, each sample flattened (float64). Two zero samples agree
    (1); a zero sample against a non-zero one does not (0)."""
    a = reference.reshape(len(reference), -1).astype(np.float64)
    b = candidate.reshape(len(candidate), -1).astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    dots = (a * b).sum(axis=1)
    return np.where(both_zero, 1.0, np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0))


def compare_actions(reference: np.ndarray, candidate: np.ndarray, gripper_dims: tuple[int, ...] = (),
                    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> dict:
    """reference, candidate: actions [K, H, A] in the robot's units. -> per-sample cosine (mean,
    worst), max |Δ| per action dimension, sign disagreements on the gripper dimensions (the sign
    about 0, per chunk step) and the cosine per named group of dimensions."""
    if reference.shape != candidate.shape or reference.ndim != 3:
        raise ValueError(f"expected two [K, H, A] arrays of one shape, got {reference.shape} and {candidate.shape}")
    action_dim = reference.shape[2]
    for name, dims in (("gripper_dims", gripper_dims), *((f"action group {g}", d) for g, d in groups)):
        if any(not 0 <= d < action_dim for d in dims):
            raise PrecisionGateError(f"{name} {list(dims)} names a dimension outside the {action_dim} actions")
    cos = cosines(reference, candidate)
    grip = list(gripper_dims)
    flips = int((np.sign(reference[..., grip]) != np.sign(candidate[..., grip])).sum()) if grip else 0
    report = {
        "samples": len(reference),
        "mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min()),
        "cosines": [float(c) for c in cos],
        "max_abs_delta": [float(d) for d in np.abs(reference - candidate).max(axis=(0, 1))],
        "gripper_dims": grip, "gripper_sign_flips": flips,
        "groups": {},
    }
    for name, dims in groups:
        group_cos = cosines(reference[..., list(dims)], candidate[..., list(dims)])
        report["groups"][name] = {"dims": list(dims), "mean_cosine": float(group_cos.mean()),
                                  "worst_cosine": float(group_cos.min())}
    return report


def gate_failures(report: dict, thresholds: GateThresholds = GateThresholds()) -> list[str]:
    """Each figure that misses its threshold, named, with both numbers."""
    out = []
    figures = [("", report)] + [(f"group {name}: ", g) for name, g in report["groups"].items()]
    for prefix, fig in figures:
        if not fig["mean_cosine"] >= thresholds.min_mean_cosine:  # `not >=`: a NaN fails too
            out.append(f"{prefix}mean cosine {fig['mean_cosine']:.7g} < {thresholds.min_mean_cosine}")
        if not fig["worst_cosine"] >= thresholds.min_worst_cosine:
            out.append(f"{prefix}worst cosine {fig['worst_cosine']:.7g} < {thresholds.min_worst_cosine}")
    if report["gripper_sign_flips"] > thresholds.max_gripper_flips:
        out.append(f"gripper sign flips {report['gripper_sign_flips']} > {thresholds.max_gripper_flips} "
                   f"(dims {report['gripper_dims']})")
    return out


# ---- observations -----------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def save_observation(path: str | Path, observation: dict) -> None:
    """Writes one observation as the .npz the gate and `vlaserve calibrate` read: its keys as given
    (any layout the server takes), a nested {"images": {camera: frame}} as observation.images.<camera>."""
    flat = {f"observation.images.{cam}": frame for cam, frame in observation.get("images", {}).items()}
    flat.update({k: v for k, v in observation.items() if k != "images"})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in flat.items()})


def load_observations(directory: str | Path, limit: int | None = None) -> list[GateObservation]:
    """The .npz observations of `directory`, in name order (the first `limit`)."""
    root = Path(directory).expanduser()
    files = sorted(root.glob("*.npz")) if root.is_dir() else []
    if not files:
        raise ConfigError(f"{root} holds no .npz observations (one observation per file: docs/gpu.md, Precision)")
    out = []
    for path in files[:limit]:
        try:
            with np.load(path, allow_pickle=False) as arrays:
                obs = {k: (str(v[()]) if v.dtype.kind in "US" else v) for k, v in arrays.items()}
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} is not a readable .npz observation: {e}") from None
        out.append(GateObservation(path.name, obs, file_sha256(path)))
    return out


def synthetic_observations(config: PolicyConfig, k: int, seed: int = 0) -> list[GateObservation]:
    """K observations built from the checkpoint's config: random frames for every camera at the
    checkpoint's resolution, a random state, one task. They exercise every layer; only recorded
    frames say how fp8 does on the robot's own inputs."""
    rng = np.random.default_rng(seed)
    height, width = config.image_resolution
    out = []
    for i in range(k):
        images = {cam: rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for cam in config.cameras}
        state = rng.standard_normal(config.state_dim).astype(np.float32)
        out.append(GateObservation(f"synthetic-{i}", {"images": images, "state": state, "task": SYNTHETIC_TASK}, None))
    return out


# ---- running the model ------------------------------------------------------------------------
def actions_of(model, preprocessor: Preprocessor, layout: KeyLayout, config: PolicyConfig, device: torch.device,
               observations: list[GateObservation], seed: int = 0) -> np.ndarray:
    """The eager model's actions [K, H, action_dim] in the robot's units, one observation at a time,
    observation i with the noise of seed + i (so two runs see the same noise)."""
    runner, out = EagerRunner(model, device), []
    for i, gate_obs in enumerate(observations):
        canonical = layout.canonical(gate_obs.observation)
        observation = Observation.create(canonical["images"], canonical.get("state"), canonical.get("task"),
                                         canonical.get("images_normalized", False))
        noise = np.random.default_rng(seed + i).standard_normal(
            (config.action_horizon, config.model.max_action_dim)).astype(np.float32)
        requests = [Request.create(observation, noise, default_steps=config.num_inference_steps)]
        inputs, noise_t, _ = preprocessor.collate(requests)
        actions, _ = runner.dispatch(to_device(inputs, device), noise_t.to(device), config.num_inference_steps)
        out.append(preprocessor.postprocess(actions.float().cpu().numpy(), requests)[0])
    return np.stack(out)


# ---- static scales ----------------------------------------------------------------------------
def weights_sha256(checkpoint_dir: Path) -> str:
    """The checkpoint's weights, identified by the sha256 of its safetensors files (in order)."""
    digest = hashlib.sha256()
    for path in checkpoint_files(checkpoint_dir):
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def calibrate(model, preprocessor: Preprocessor, layout: KeyLayout, config: PolicyConfig, device: torch.device,
              observations: list[GateObservation], percentile: float = 99.99,
              expert: bool = False) -> dict[str, float | None]:
    """Per fp8 layer: the `percentile` of its input's amax over every call the observations make
    (one per observation in the prefix; one per denoising step in the expert); None for a layer
    that never runs (the last prefix layer's attention output and MLP feed nothing)."""
    targets = fp8_targets(model, expert)
    amaxes: dict[str, list[torch.Tensor]] = {name: [] for name in targets}
    hooks = []
    for name, (parent, attr) in targets.items():
        record = amaxes[name]
        hooks.append(getattr(parent, attr).register_forward_pre_hook(
            lambda _module, args, record=record: record.append(args[0].detach().abs().amax().float())))
    try:
        actions_of(model, preprocessor, layout, config, device, observations)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: float(np.percentile(torch.stack(values).cpu().numpy(), percentile)) if values else None
            for name, values in amaxes.items()}


def write_scales(path: str | Path, amax: dict[str, float | None], weights_hash: str,
                 observations: list[GateObservation], percentile: float) -> dict:
    """The scales file: scale = amax / 448 per layer (null for a layer that never ran: it keeps
    per-token scales), the weights' and the observations' sha256."""
    doc = {"format": SCALES_FORMAT, "weights_sha256": weights_hash, "percentile": percentile,
           "observations_sha256": sorted({o.sha256 for o in observations if o.sha256}),
           "layers": {name: {"amax": a, "scale": None if a is None else scales_for(torch.tensor(a)).item()}
                      for name, a in sorted(amax.items())}}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def read_scales(path: str | Path, weights_hash: str) -> tuple[dict[str, float | None], set[str]]:
    """-> (static scale per layer, sha256 of the calibration observations). Refuses a file of another
    format, for other weights, or with a scale that is not a positive finite number."""
    try:
        doc = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"precision_scales {path}: cannot read it ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != SCALES_FORMAT:
        raise ConfigError(f"precision_scales {path}: not a {SCALES_FORMAT} file (made by `vlaserve calibrate`)")
    if doc.get("weights_sha256") != weights_hash:
        raise ConfigError(f"precision_scales {path} was calibrated for other weights (sha256 "
                          f"{str(doc.get('weights_sha256'))[:12]}..., this checkpoint's is {weights_hash[:12]}...): "
                          "run `vlaserve calibrate` on this checkpoint")
    scales = {}
    for name, entry in doc.get("layers", {}).items():
        if not isinstance(entry, dict) or "scale" not in entry:
            raise ConfigError(f"precision_scales {path}: layer {name} has no scale")
        scale = entry["scale"]
        if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
            raise ConfigError(f"precision_scales {path}: layer {name}'s scale {scale!r} is not a positive number")
        scales[name] = None if scale is None else float(scale)
    return scales, set(doc.get("observations_sha256", []))


# ---- serving in fp8 ---------------------------------------------------------------------------
def gate_observations(config: PolicyConfig, directory: str | None, k: int,
                      calibration_hashes: set[str]) -> list[GateObservation]:
    """The gate's held-out observations: the first K files of `directory`, else K synthetic ones.
    An observation file that calibrated the scales is refused: it would grade fp8 on its own data."""
    observations = synthetic_observations(config, k) if directory is None else load_observations(directory, k)
    reused = [o.name for o in observations if o.sha256 in calibration_hashes]
    if reused:
        raise PrecisionGateError(f"{len(reused)} of the gate's observations ({', '.join(reused[:3])}...) calibrated "
                                 "the activation scales: gate on observations held out from calibration")
    return observations


def apply_precision(model, checkpoint_dir: Path, config: PolicyConfig, preprocessor: Preprocessor,
                    layout: KeyLayout, device: torch.device, settings: RuntimeConfig, k: int = GATE_SAMPLES,
                    thresholds: GateThresholds = GateThresholds()) -> dict:
    """Converts `model` to settings.precision in place and returns the gate's report (for "bf16",
    nothing to do: {"precision": "bf16"}). Raises PrecisionGateError when the gate fails and
    settings.precision_gate is "enforce"."""
    if settings.precision == "bf16":
        return {"precision": "bf16"}
    if settings.precision == "fp8+expert" and settings.runs_fast_path(device.type):
        raise ConfigError("precision 'fp8+expert' runs on the eager model (fast_path=False): the fast path's "
                          "expert kernels take bfloat16 weights; precision 'fp8' runs on the fast path")
    scales, calibration_hashes = None, set()
    if settings.precision_scales:
        scales, calibration_hashes = read_scales(settings.precision_scales, weights_sha256(checkpoint_dir))
    observations = gate_observations(config, settings.precision_observations, k, calibration_hashes)
    reference = actions_of(model, preprocessor, layout, config, device, observations)
    try:
        converted = convert_to_fp8(model, expert=settings.precision == "fp8+expert", input_scales=scales)
    except ValueError as e:
        raise ConfigError(f"precision_scales {settings.precision_scales}: {e}") from None
    candidate = actions_of(model, preprocessor, layout, config, device, observations)
    report = {"precision": settings.precision, "fp8_layers": len(converted),
              "activation_scales": "static" if scales else "per-token",
              "observations": settings.precision_observations or "synthetic",
              **compare_actions(reference, candidate, settings.gripper_dims, settings.action_groups),
              "thresholds": vars(thresholds)}
    failures = gate_failures(report, thresholds)
    report.update(passed=not failures, failures=failures)
    summary = (f"fp8 gate over {report['samples']} observations ({report['observations']}): mean cosine "
               f"{report['mean_cosine']:.7g}, worst {report['worst_cosine']:.7g}, gripper sign flips "
               f"{report['gripper_sign_flips']}")
    if not failures:
        log.info("%s: passed", summary)
    elif settings.precision_gate == "warn":
        log.warning("%s: FAILED (%s); serving anyway (precision_gate warn)", summary, "; ".join(failures))
    else:
        raise PrecisionGateError(f"{summary}: FAILED ({'; '.join(failures)}). fp8 changes this checkpoint's "
                                 "actions too much: serve in bf16, calibrate on recorded frames, or pass "
                                 "--precision-gate warn to serve anyway")
    return report
