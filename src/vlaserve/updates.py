"""Weight updates in place (Policy.update_weights): what a checkpoint must share with the served one, checked
before anything changes, and whether this policy can swap at all.

A checkpoint may replace the served weights when it is of the same family and architecture (config.json as
read by vlaserve.family, the hub id aside), its processors do the same things (renames, relative actions,
tokenizer, prompt length: only the normalization may differ, its modes and statistics, and it swaps with the
weights), and
its tensors have the served names, shapes and stored dtypes (checkpoint/update.py)."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import numpy as np

from .checkpoint.update import check_update
from .config import PolicyConfig
from .demo import find_checkpoint
from .errors import CheckpointError, WeightUpdateRefused
from .family import load_policy_config
from .processing.pipeline import ProcessorPipeline


def refuse_unless_swappable(policy) -> None:
    """Refuses ("unavailable") where the served parameters cannot take new weights in place: while the engine
    is still starting or after it failed, with fp8 layers (their scales would need the fp8 conversion and its
    accuracy gate again) and with the offload profile (streamed layers live in host buffers and device slots)."""
    runtime = policy.runtime
    if runtime.state != "ready":
        raise WeightUpdateRefused("unavailable", f"the engine is {runtime.state!r}: weights can be updated once it "
                                                 "is 'ready' (every CUDA graph captured)")
    if policy.precision.get("precision", "bf16") != "bf16":
        raise WeightUpdateRefused("unavailable", f"precision {policy.precision['precision']!r} serves converted "
                                                 "weights: restart the server with the new checkpoint")
    if runtime.offload is not None:
        raise WeightUpdateRefused("unavailable", "memory profile 'offload' streams the weights from host buffers: "
                                                 "restart the server with the new checkpoint")


def find_update(path_or_id: str) -> Path:
    """The checkpoint directory a weight update names (as `vlaserve serve` takes one: a local directory, a hub
    id, a demo id); "not_found" when there is none."""
    if not isinstance(path_or_id, str) or not path_or_id.strip():
        raise WeightUpdateRefused("not_found", "model_path must name a checkpoint directory")
    try:
        directory = find_checkpoint(path_or_id)
    except CheckpointError as e:
        raise WeightUpdateRefused("not_found", str(e)) from None
    if not (directory / "config.json").is_file():
        raise WeightUpdateRefused("not_found", f"{directory}/config.json is missing")
    return directory


def check_compatible(policy, directory: Path) -> tuple[ProcessorPipeline, dict[str, tuple[Path, str]]]:
    """The checkpoint at `directory` checked against the served one -> its processor pipeline and its tensors'
    sources (checkpoint.update.check_update), or WeightUpdateRefused naming the first difference."""
    try:
        config = load_policy_config(directory)
    except CheckpointError as e:
        raise WeightUpdateRefused("mismatch", str(e)) from None
    served = policy.config
    if config.policy_type != served.policy_type:
        raise WeightUpdateRefused("mismatch", f"{directory} is a {config.policy_type} checkpoint; this server serves "
                                              f"{served.policy_type}")
    differences = _config_differences(served, config)
    if differences:
        raise WeightUpdateRefused("mismatch", f"{directory} has another architecture than the served checkpoint: "
                                              + "; ".join(differences))
    try:
        pipeline = ProcessorPipeline.load(directory, config)
    except CheckpointError as e:
        raise WeightUpdateRefused("mismatch", str(e)) from None
    differences = _pipeline_differences(policy.preprocessor.pipeline, pipeline)
    if differences:
        raise WeightUpdateRefused("mismatch", f"{directory}'s processors differ from the served ones (only the "
                                              f"normalization may): {'; '.join(differences)}")
    family = policy.preprocessor.family
    return pipeline, check_update(policy.model, directory, family.weights, policy.stored_dtypes)


def _config_differences(served: PolicyConfig, new: PolicyConfig) -> list[str]:
    """config.json's settings that differ (its hub id may: a fine-tuned copy records another)."""
    new = replace(new, hub_id=served.hub_id)
    return [f"{f.name}: {getattr(new, f.name)!r} (served: {getattr(served, f.name)!r})"
            for f in fields(PolicyConfig) if getattr(new, f.name) != getattr(served, f.name)]


def _pipeline_differences(served: ProcessorPipeline, new: ProcessorPipeline) -> list[str]:
    out = [f"{name}: {getattr(new, name)!r} (served: {getattr(served, name)!r})"
           for name in ("rename_map", "tokenizer_name", "max_token_len") if getattr(new, name) != getattr(served, name)]
    masks = [None if p.relative_actions is None else p.relative_actions.mask for p in (served, new)]
    if (masks[0] is None) != (masks[1] is None) or (masks[0] is not None and not np.array_equal(*masks)):
        out.append(f"relative actions: {masks[1]} (served: {masks[0]})")
    return out
