"""Checkpoint layouts -> our parameter names, the dtype policy, strict loading.

Our module tree mirrors the LeRobot one below a few renamed roots, so one prefix table maps
names both ways. Loading is strict: a missing, unexpected or wrong-shaped tensor is an error
that names the keys; a partially random model is never served.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..errors import CheckpointError
from .files import check_weight_loader, checkpoint_files
from ..model.pi05 import Pi05Model

_PG = "paligemma_with_expert.paligemma.model."
_VIS = _PG + "vision_tower.vision_model."
# (LeRobot name prefix, our name prefix), most specific first.
PREFIXES = [
    (_VIS + "embeddings.patch_embedding.", "vision.patch_embedding."),
    (_VIS + "embeddings.position_embedding.", "vision.position_embedding."),
    (_VIS + "encoder.layers.", "vision.layers."),
    (_VIS + "post_layernorm.", "vision.post_layernorm."),
    (_PG + "multi_modal_projector.linear.", "projector."),
    (_PG + "language_model.", "vlm."),
    ("paligemma_with_expert.gemma_expert.model.", "expert."),
    ("action_in_proj.", "action_in_proj."),
    ("action_out_proj.", "action_out_proj."),
    ("time_mlp_in.", "time_mlp_in."),
    ("time_mlp_out.", "time_mlp_out."),
]
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"  # tied to embed_tokens in PaliGemma
# Present in real checkpoints, used by no Pi0.5 computation.
IGNORED = re.compile(r"^(paligemma_with_expert\.gemma_expert\.lm_head\.|state_proj\.)")

# Older transformers / OpenPI-converted layouts spell some roots differently.
_LAYOUT_ALIASES = [
    ("paligemma_with_expert.paligemma.language_model.model.", _PG + "language_model."),
    ("paligemma_with_expert.paligemma.language_model.", _PG + "language_model."),
    ("paligemma_with_expert.paligemma.vision_tower.", _PG + "vision_tower."),
    ("paligemma_with_expert.paligemma.multi_modal_projector.", _PG + "multi_modal_projector."),
    ("action_time_mlp_in.", "time_mlp_in."),
    ("action_time_mlp_out.", "time_mlp_out."),
]

# The fp32 set of OpenPI (`gemma_pytorch.py` `to_bfloat16_for_selected_params`) and SGLang's pi05
# runtime: the vision patch/position embeddings, the Gemma norms (`input_layernorm`,
# `post_attention_layernorm`, `model.norm`; in the expert these are the AdaRMS dense layers), and the
# small action/time projections (their published count, 119,720,608 fp32 parameters at full size,
# includes them). The SigLIP LayerNorms are bf16 there, and so here. (LeRobot keeps the
# whole vision tower and the projector in fp32 instead.) Everything else is in the serving dtype.
FP32_PATTERN = re.compile(
    r"^vision\.(patch_embedding|position_embedding)\.|^(vlm|expert)\.(layers\.\d+\.(input_layernorm|"
    r"post_attention_layernorm)|norm)\.|^(action_in_proj|action_out_proj|time_mlp_in|time_mlp_out)\."
)


def canonical_lerobot_name(key: str) -> str:
    if key.startswith("model."):
        key = key[len("model."):]
    for old, new in _LAYOUT_ALIASES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def to_our_name(lerobot_key: str) -> str | None:
    """A checkpoint key -> our parameter name; None for tensors Pi0.5 does not use."""
    key = canonical_lerobot_name(lerobot_key)
    if IGNORED.match(key) or key == LM_HEAD:
        return None
    for theirs, ours in PREFIXES:
        if key.startswith(theirs):
            return ours + key[len(theirs):]
    return "?" + key  # unknown: reported as unexpected


def to_lerobot_name(our_name: str) -> str:
    for theirs, ours in PREFIXES:
        if our_name.startswith(ours):
            return "model." + theirs + our_name[len(ours):]
    raise KeyError(our_name)


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if FP32_PATTERN.search(name) else dtype


def apply_dtype_policy(model: Pi05Model, dtype: torch.dtype) -> Pi05Model:
    for name, p in model.named_parameters():
        p.data = p.data.to(param_dtype(name, dtype))
    return model


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    counts: Counter = Counter()
    for p in model.parameters():
        counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    return dict(counts)


EMBED = "vlm.embed_tokens.weight"


def _scan_headers(checkpoint_dir: Path) -> tuple[dict[str, tuple[Path, str]], dict[tuple[Path, str], tuple[int, ...]]]:
    """From the safetensors headers only (no data read): our name -> (file, key) of every tensor the
    checkpoint maps to one (unknown ones as "?key"; a head-only tied embedding as the embedding), and
    each (file, key)'s shape."""
    sources: dict[str, tuple[Path, str]] = {}
    shapes: dict[tuple[Path, str], tuple[int, ...]] = {}
    lm_head = None
    for path in checkpoint_files(checkpoint_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes[path, key] = tuple(f.get_slice(key).get_shape())
                if canonical_lerobot_name(key) == LM_HEAD:
                    lm_head = (path, key)
                ours = to_our_name(key)
                if ours is not None:
                    sources[ours] = (path, key)
    if EMBED not in sources and lm_head is not None:
        sources[EMBED] = lm_head  # tied weights: some checkpoints store only the head
    return sources, shapes


def checkpoint_shapes(checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape for every tensor Pi0.5 uses, from the safetensors headers only."""
    sources, shapes = _scan_headers(checkpoint_dir)
    return {ours: shapes[source] for ours, source in sources.items() if not ours.startswith("?")}


def _format_keys(keys, limit: int = 12) -> str:
    keys = sorted(keys)
    more = f" … and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _read_safetensors(by_file: dict[Path, list[str]]):
    """(checkpoint key, tensor) for the wanted keys, one tensor at a time through mmap."""
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                yield key, f.get_tensor(key)


def _read_runai(by_file: dict[Path, list[str]]):
    """(checkpoint key, tensor) through runai-model-streamer: many parallel reads into host buffers."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        wanted = {key for keys in by_file.values() for key in keys}
        streamer.stream_files([str(p) for p in by_file], device="cpu", tensor_names=wanted)
        yield from streamer.get_tensors()


def load_weights(model: Pi05Model, checkpoint_dir: Path, dtype: torch.dtype, device: torch.device,
                 progress: bool = True, loader: str = "safetensors") -> Pi05Model:
    """Fills `model` (built on the meta device) from safetensors, strictly.

    Every name and shape is checked against the headers before any data is read. Tensors then
    arrive one at a time (safetensors mmap, or runai-model-streamer's parallel reads), are cast
    and moved, so no full-precision copy of the model ever sits in host memory.
    """
    expected = {n: p for n, p in model.named_parameters()}
    sources, shapes = _scan_headers(checkpoint_dir)
    unexpected = [key for ours, (_, key) in sources.items() if ours not in expected]
    missing = [n for n in expected if n not in sources]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_format_keys(to_lerobot_name(n) for n in missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_format_keys(unexpected)}")
        raise CheckpointError(f"{checkpoint_dir} does not match the Pi0.5 architecture; " + "; ".join(parts))
    wrong_shape = [f"{source[1]}: checkpoint {list(shapes[source])} vs model {list(expected[ours].shape)}"
                   for ours, source in sources.items() if shapes[source] != tuple(expected[ours].shape)]
    if wrong_shape:
        raise CheckpointError(f"{checkpoint_dir}: tensors of the wrong shape: " + "; ".join(wrong_shape[:12]))

    by_file: dict[Path, list[str]] = {}
    ours_of: dict[str, str] = {}
    for ours, (path, key) in sources.items():
        by_file.setdefault(path, []).append(key)
        ours_of[key] = ours
    read = {"safetensors": _read_safetensors, "runai-streamer": _read_runai}[check_weight_loader(loader)]
    loaded: dict[str, torch.Tensor] = {}
    with tqdm(total=len(sources), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for key, tensor in read(by_file):
            ours = ours_of[key]
            loaded[ours] = tensor.to(device=device, dtype=param_dtype(ours, dtype))
            bar.update()
    model.load_state_dict(loaded, strict=True, assign=True)
    return model


def build_model(config: ModelConfig) -> Pi05Model:
    """The module tree without storage; weights arrive through `load_weights`."""
    with torch.device("meta"):
        return Pi05Model(config)


def random_lerobot_state_dict(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random float32 weights in the LeRobot layout (demo and benchmark checkpoints).

    Gemma RMSNorm offsets and SigLIP LayerNorm scales are drawn around their identity values.
    """
    gen = torch.Generator().manual_seed(seed)
    model = Pi05Model(config)
    out = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * std
        if name.endswith("layernorm.weight") and name.startswith("vision."):
            value = 1.0 + noise
        else:
            value = noise
        out[to_lerobot_name(name)] = value.contiguous()
    embed = out["model." + _PG + "language_model.embed_tokens.weight"]
    out["model." + LM_HEAD] = embed.clone()
    return out


def random_model(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0, std: float = 0.02) -> Pi05Model:
    """A random model built directly on `device` (for speed and memory work at full size)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Pi05Model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std, generator=gen)
            if name.startswith("vision.") and name.endswith("layernorm.weight"):
                p.add_(1.0)
    return apply_dtype_policy(model, dtype).eval().requires_grad_(False)
