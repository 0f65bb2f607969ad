"""Checkpoint key layouts as data, and Pi0's: LeRobot names -> our parameter names, strict loading.

A `KeyLayout` holds what weights.py keeps in module-level tables for Pi0.5 (root prefixes, alternative
spellings, ignored tensors, the fp32 set). `PI05_LAYOUT` is built from those very tables, so the
functions here reproduce weights.py's mapping for Pi0.5 (a test checks it) and weights.py can take a
layout argument when the two families are merged. `PI0_LAYOUT` swaps Pi0.5's time MLP for Pi0's state
projection and action-time MLP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..checkpoint import weights
from ..errors import CheckpointError
from ..checkpoint.files import checkpoint_files


@dataclass(frozen=True)
class KeyLayout:
    family: str
    prefixes: tuple[tuple[str, str], ...]  # (LeRobot name prefix, our name prefix), most specific first
    aliases: tuple[tuple[str, str], ...]  # other spellings of a root, applied after "model." is stripped
    unprefixed_renames: tuple[tuple[str, str], ...]  # applied only to keys without "model." (LeRobot's loader)
    ignored: re.Pattern  # stored in real checkpoints, used by no computation
    fp32: re.Pattern  # our parameters kept in float32 whatever the serving dtype

    def canonical(self, key: str) -> str:
        if key.startswith("model."):
            key = key[len("model."):]
        else:
            key = _rename(key, self.unprefixed_renames)
        return _rename(key, self.aliases)

    def to_ours(self, key: str) -> str | None:
        """A checkpoint key -> our parameter name; None for tensors the family does not use, "?key" for
        unknown ones (reported as unexpected)."""
        key = self.canonical(key)
        if self.ignored.match(key) or key == weights.LM_HEAD:
            return None
        for theirs, ours in self.prefixes:
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        return "?" + key

    def to_lerobot(self, our_name: str) -> str:
        for theirs, ours in self.prefixes:
            if our_name.startswith(ours):
                return "model." + theirs + our_name[len(ours):]
        raise KeyError(our_name)


def _rename(key: str, renames) -> str:
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


_TIME_MLP = ("time_mlp_in.", "time_mlp_out.")
_ACTION_TIME_MLP = ("action_time_mlp_in.", "action_time_mlp_out.")

PI05_LAYOUT = KeyLayout(
    family="pi05", prefixes=tuple(weights.PREFIXES), aliases=tuple(weights._LAYOUT_ALIASES),
    unprefixed_renames=(), ignored=weights.IGNORED, fp32=weights.FP32_PATTERN)

PI0_LAYOUT = KeyLayout(
    family="pi0",
    prefixes=tuple(p for p in weights.PREFIXES if p[1] not in _TIME_MLP)
    + (("state_proj.", "state_proj."),) + tuple((p, p) for p in _ACTION_TIME_MLP),
    # The PaliGemma root spellings of older layouts; not Pi0.5's action_time_mlp -> time_mlp rename.
    aliases=tuple(a for a in weights._LAYOUT_ALIASES if a[0] not in _ACTION_TIME_MLP),
    # LeRobot's pi0 loader gives Pi0.5-spelled time MLP keys Pi0's names, in un-prefixed keys only.
    unprefixed_renames=tuple(zip(_TIME_MLP, _ACTION_TIME_MLP)),
    ignored=re.compile(r"^paligemma_with_expert\.gemma_expert\.lm_head\."),
    # As for Pi0.5: vision embeddings, every norm (the expert's plain ones included), the small projections.
    fp32=re.compile(r"^vision\.(patch_embedding|position_embedding)\.|layer_?norm|\.norm\.|"
                    r"^(state_proj|action_in_proj|action_out_proj|action_time_mlp_in|action_time_mlp_out)\."),
)


def map_state_dict(layout: KeyLayout, model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                   where: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> `model`'s state dict, strictly: missing, unexpected and wrong-shaped tensors
    are named (in the checkpoint's spelling) in one CheckpointError."""
    mapped: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, tensor in tensors.items():
        if layout.canonical(key) == weights.LM_HEAD:
            lm_head = tensor
        ours = layout.to_ours(key)
        if ours is not None:
            mapped[ours] = tensor
    if weights.EMBED not in mapped and lm_head is not None:
        mapped[weights.EMBED] = lm_head  # tied weights: some checkpoints store only the head
    expected = dict(model.named_parameters())
    missing = [layout.to_lerobot(n) for n in expected if n not in mapped]
    unexpected = [n.removeprefix("?") for n in mapped if n not in expected]
    problems = []
    if missing:
        problems.append(f"missing tensors: {weights._format_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {weights._format_keys(unexpected)}")
    wrong = [f"{layout.to_lerobot(n)}: checkpoint {list(t.shape)} vs model {list(expected[n].shape)}"
             for n, t in mapped.items() if n in expected and t.shape != expected[n].shape]
    if wrong:
        problems.append("tensors of the wrong shape: " + "; ".join(wrong[:12]))
    if problems:
        raise CheckpointError(f"{where} does not match the {layout.family} architecture; " + "; ".join(problems))
    return mapped


def load_checkpoint(layout: KeyLayout, model: torch.nn.Module, checkpoint_dir: Path,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Fills `model` (built on the meta device, or anywhere) from the checkpoint's safetensors, strictly;
    parameters in `layout.fp32` stay float32, the others are cast to `dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(checkpoint_dir)):
        tensors.update(load_file(str(path)))
    mapped = map_state_dict(layout, model, tensors, str(checkpoint_dir))
    state = {n: t.to(device=device, dtype=torch.float32 if layout.fp32.search(n) else dtype)
             for n, t in mapped.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model
