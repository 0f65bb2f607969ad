"""`vlaserve check-precision` (the fp8 gate's report for a checkpoint, as JSON; exit 1 when it fails)
and `vlaserve calibrate` (static fp8 activation scales from recorded observations). torch is
imported when they run, not when the command line is parsed."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from .config import DTYPE_NAMES, PRECISIONS
from .demo import DEMO_NAMES
from .errors import VlaserveError
from .options import DEMO_HELP, UsageError, checkpoint_or_demo

log = logging.getLogger("vlaserve")


def _common(parser) -> None:
    parser.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                        help="local directory or Hugging Face hub id (owner/name); none: the built-in DEMO")
    parser.add_argument("--demo", choices=tuple(DEMO_NAMES), help=DEMO_HELP)
    parser.add_argument("--device", default="auto", metavar="DEVICE", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                        help="the reference's dtype (default: auto, as serve: bfloat16 on CUDA, float32 on a CPU)")
    parser.add_argument("--precision", default="fp8", choices=[p for p in PRECISIONS if p != "bf16"],
                        help="which layers are fp8 (default: fp8, SigLIP and the Gemma prefix)")


def add_parsers(commands) -> None:
    check = commands.add_parser(
        "check-precision", help="compare fp8's actions with the serving dtype's (JSON; exit 1 when the gate fails)",
        description="Runs K held-out observations through the checkpoint as loaded and in fp8 with the same noise "
                    "and prints the gate's figures in the robot's units: per-sample cosine (mean, worst), max "
                    "|delta| per action dimension, gripper sign flips, per-group cosines. Exit 1 when one misses "
                    "its threshold (mean cosine >= 0.999, worst >= 0.995, no gripper sign flip).")
    _common(check)
    check.add_argument("--observations", metavar="DIR", help="held-out .npz observations, one per file (default: "
                                                             "synthetic ones from the checkpoint's config)")
    check.add_argument("--k", type=int, default=8, metavar="N", help="observations to run (default: 8)")
    check.add_argument("--scales", metavar="FILE", help="static activation scales from `vlaserve calibrate`")
    check.add_argument("--gripper-dims", default="", metavar="I,J", help="action dimensions that are grippers")
    check.add_argument("--action-groups", default="", metavar="NAME=I-J;...", help="groups checked one by one")
    check.add_argument("--min-mean-cosine", type=float, default=0.999, metavar="C",
                       help="the gate's mean cosine threshold (default: 0.999)")
    check.add_argument("--min-worst-cosine", type=float, default=0.995, metavar="C",
                       help="the gate's worst-sample cosine threshold (default: 0.995)")
    check.set_defaults(run=check_precision_command)

    cal = commands.add_parser(
        "calibrate", help="static fp8 activation scales from recorded observations",
        description="Runs recorded observations through the checkpoint, takes a percentile of each fp8 layer's "
                    "input amax and writes the scales as JSON, keyed on the checkpoint's weights. Keep the gate's "
                    "observations apart: a gate observation that calibrated the scales is refused.")
    _common(cal)
    cal.add_argument("--observations", required=True, metavar="DIR", help="recorded .npz observations, one per file")
    cal.add_argument("--out", required=True, metavar="FILE", help="the scales file to write")
    cal.add_argument("--percentile", type=float, default=99.99, metavar="P",
                     help="percentile of the per-call amax taken as each layer's range (default: 99.99)")
    cal.set_defaults(run=calibrate_command)


def _load(cli: dict):
    from .policy import Policy

    # The reference: the eager model in the serving dtype (the gate converts it after its first pass).
    return Policy.from_pretrained(checkpoint_or_demo(cli.get("checkpoint"), cli.get("demo")), device=cli["device"],
                                  dtype=cli["dtype"], fast_path=False, progress=False)


def check_precision_command(cli: dict) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .precision import GateThresholds, apply_precision
    from .runtime.device import resolve_device
    from .runtime.fast.targets import require_fp8

    try:
        if cli["k"] < 1:
            raise UsageError("--k must be at least 1")
        require_fp8(resolve_device(cli["device"]), cli["precision"])  # before the reference loads
        policy = _load(cli)
        settings = replace(policy.runtime.settings, precision=cli["precision"], precision_gate="warn",
                           precision_scales=cli["scales"], precision_observations=cli["observations"],
                           gripper_dims=cli["gripper_dims"], action_groups=cli["action_groups"])
        report = apply_precision(policy.model, Path(policy.checkpoint), policy.config, policy.preprocessor,
                                 policy.layout, policy.runtime.device, settings, k=cli["k"],
                                 thresholds=GateThresholds(cli["min_mean_cosine"], cli["min_worst_cosine"]))
    except (VlaserveError, UsageError, OSError) as e:
        log.error("%s", e)
        return 2
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0 if report["passed"] else 1


def calibrate_command(cli: dict) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .precision import calibrate, load_observations, weights_sha256, write_scales

    try:
        if not 0 < cli["percentile"] <= 100:
            raise UsageError("--percentile must be in (0, 100]")
        policy = _load(cli)
        observations = load_observations(cli["observations"])
        amax = calibrate(policy.model, policy.preprocessor, policy.layout, policy.config, policy.runtime.device,
                         observations, cli["percentile"], expert=cli["precision"] == "fp8+expert")
        write_scales(cli["out"], amax, weights_sha256(Path(policy.checkpoint)), observations, cli["percentile"])
    except (VlaserveError, UsageError, OSError) as e:
        log.error("%s", e)
        return 2
    log.info("wrote %d layers' scales from %d observations to %s", len(amax), len(observations), cli["out"])
    return 0
