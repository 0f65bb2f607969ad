"""Checkpoint layouts -> our parameter names, the dtype policy, strict loading.

Our module tree mirrors the LeRobot one below a few renamed roots, so one prefix table per policy
family (a `WeightLayout`: Pi0.5's, Pi0's) maps names both ways. Loading is strict: a missing, unexpected or wrong-shaped tensor is an error
that names the keys; a partially random model is never served.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError
from .files import check_weight_loader, checkpoint_files

_PG = "paligemma_with_expert.paligemma.model."
_VIS = _PG + "vision_tower.vision_model."
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"  # tied to embed_tokens in PaliGemma
EMBED = "vlm.embed_tokens.weight"


@dataclass(frozen=True)
class WeightLayout:
    """One policy family's checkpoint keys: how LeRobot names map to ours (both ways), what is
    stored but unused, and which of our parameters stay float32 whatever the serving dtype."""

    family: str  # "pi05", "pi0": config.json's type
    display: str  # "Pi0.5", "Pi0": for messages
    prefixes: tuple[tuple[str, str], ...]  # (LeRobot name prefix, our name prefix), most specific first
    aliases: tuple[tuple[str, str], ...]  # other spellings of a root, applied after "model." is stripped
    unprefixed_renames: tuple[tuple[str, str], ...]  # only for keys without "model." (LeRobot's loader does so)
    ignored: re.Pattern  # stored in real checkpoints, used by no computation of the family
    fp32: re.Pattern
    signature: re.Pattern  # a (canonical) key only this family's checkpoints hold: its expert's final norm

    def canonical(self, key: str) -> str:
        if key.startswith("model."):
            key = key[len("model."):]
        else:
            key = _rename(key, self.unprefixed_renames)
        return _rename(key, self.aliases)

    def to_ours(self, key: str) -> str | None:
        """A checkpoint key -> our parameter name; None for tensors the family does not use, "?key"
        for unknown ones (reported as unexpected)."""
        key = self.canonical(key)
        if self.ignored.match(key) or key == LM_HEAD:
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

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.fp32.search(name) else dtype


def _rename(key: str, renames) -> str:
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


# The roots both families share, (LeRobot name prefix, our name prefix), most specific first.
_SHARED_PREFIXES = (
    (_VIS + "embeddings.patch_embedding.", "vision.patch_embedding."),
    (_VIS + "embeddings.position_embedding.", "vision.position_embedding."),
    (_VIS + "encoder.layers.", "vision.layers."),
    (_VIS + "post_layernorm.", "vision.post_layernorm."),
    (_PG + "multi_modal_projector.linear.", "projector."),
    (_PG + "language_model.", "vlm."),
    ("paligemma_with_expert.gemma_expert.model.", "expert."),
    ("action_in_proj.", "action_in_proj."),
    ("action_out_proj.", "action_out_proj."),
)
# Older transformers / OpenPI-converted layouts spell the PaliGemma roots differently.
_ROOT_ALIASES = (
    ("paligemma_with_expert.paligemma.language_model.model.", _PG + "language_model."),
    ("paligemma_with_expert.paligemma.language_model.", _PG + "language_model."),
    ("paligemma_with_expert.paligemma.vision_tower.", _PG + "vision_tower."),
    ("paligemma_with_expert.paligemma.multi_modal_projector.", _PG + "multi_modal_projector."),
)
_EXPERT_HEAD = r"paligemma_with_expert\.gemma_expert\.lm_head\."


def _fp32_pattern(projections: tuple[str, ...]) -> re.Pattern:
    """The fp32 set of OpenPI (`gemma_pytorch.py` `to_bfloat16_for_selected_params`) and SGLang's
    pi05 runtime: the vision patch/position embeddings, the Gemma norms (`input_layernorm`,
    `post_attention_layernorm`, `model.norm`; in Pi0.5's expert these are the AdaRMS dense layers),
    and the family's small action/time/state projections (the published count, 119,720,608 fp32
    parameters for Pi0.5 at full size, includes them). The SigLIP LayerNorms are bf16 there, and so
    here. (LeRobot keeps the whole vision tower and the projector in fp32 instead.)"""
    return re.compile(r"^vision\.(patch_embedding|position_embedding)\.|^(vlm|expert)\.(layers\.\d+\.("
                      r"input_layernorm|post_attention_layernorm)|norm)\.|^(" + "|".join(projections) + r")\.")


_PI05_PROJECTIONS = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
PI05_LAYOUT = WeightLayout(
    family="pi05", display="Pi0.5",
    prefixes=_SHARED_PREFIXES + (("time_mlp_in.", "time_mlp_in."), ("time_mlp_out.", "time_mlp_out.")),
    # LeRobot's pi05 loader reads Pi0's action-time MLP names as its time MLP.
    aliases=_ROOT_ALIASES + (("action_time_mlp_in.", "time_mlp_in."), ("action_time_mlp_out.", "time_mlp_out.")),
    unprefixed_renames=(),
    ignored=re.compile(rf"^({_EXPERT_HEAD}|state_proj\.)"),  # Pi0.5 has no state projection
    fp32=_fp32_pattern(_PI05_PROJECTIONS),
    signature=re.compile(r"^paligemma_with_expert\.gemma_expert\.model\.norm\.dense\."),  # AdaRMS
)

_PI0_PROJECTIONS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
PI0_LAYOUT = WeightLayout(
    family="pi0", display="Pi0",
    prefixes=_SHARED_PREFIXES + tuple((f"{p}.", f"{p}.") for p in ("state_proj", "action_time_mlp_in",
                                                                    "action_time_mlp_out")),
    aliases=_ROOT_ALIASES,
    # LeRobot's pi0 loader gives Pi0.5-spelled time MLP keys Pi0's names, in un-prefixed keys only.
    unprefixed_renames=(("time_mlp_in.", "action_time_mlp_in."), ("time_mlp_out.", "action_time_mlp_out.")),
    ignored=re.compile(rf"^{_EXPERT_HEAD}"),
    fp32=_fp32_pattern(_PI0_PROJECTIONS),
    signature=re.compile(r"^paligemma_with_expert\.gemma_expert\.model\.norm\.weight$"),  # a plain RMSNorm
)

WEIGHT_LAYOUTS = {layout.family: layout for layout in (PI05_LAYOUT, PI0_LAYOUT)}


def layout_for(policy_type: str) -> WeightLayout:
    """The layout of config.json's policy type (PolicyConfig.policy_type, already checked)."""
    return WEIGHT_LAYOUTS[policy_type]


# Pi0.5's mapping as plain functions (benchmarks and older callers).
to_our_name = PI05_LAYOUT.to_ours
to_lerobot_name = PI05_LAYOUT.to_lerobot


def param_dtype(name: str, dtype: torch.dtype, layout: WeightLayout = PI05_LAYOUT) -> torch.dtype:
    return layout.param_dtype(name, dtype)


def apply_dtype_policy(model: nn.Module, dtype: torch.dtype, layout: WeightLayout = PI05_LAYOUT) -> nn.Module:
    for name, p in model.named_parameters():
        p.data = p.data.to(layout.param_dtype(name, dtype))
    return model


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    counts: Counter = Counter()
    for p in model.parameters():
        counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    return dict(counts)


# safetensors' dtype names (its format's specification) -> torch dtypes.
_STORED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in its safetensors file: [begin, end) counted from the file's start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """A safetensors file's index, from its header alone (an 8-byte little-endian length, then JSON), checked
    against the file's size: a truncated or foreign file is a CheckpointError that names it."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        start = 8 + length
        index = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in _STORED_DTYPES:
                raise ValueError(f"{key}: dtype {entry['dtype']} is not supported")
            dtype, shape = _STORED_DTYPES[entry["dtype"]], tuple(int(n) for n in entry["shape"])
            begin, end = (start + int(o) for o in entry["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize or not start <= begin <= end <= size:
                raise ValueError(f"{key}: bytes [{begin}, {end}) do not hold {entry['dtype']} {list(shape)} "
                                 f"in a file of {size} bytes")
            index[key] = StoredTensor(dtype, shape, begin, end)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return index


def _scan_headers(checkpoint_dir: Path, layout: WeightLayout) -> tuple[dict[str, tuple[Path, str]], dict[tuple[Path, str], tuple[int, ...]]]:
    """From the safetensors headers only (no data read): our name -> (file, key) of every tensor the
    checkpoint maps to one (unknown ones as "?key"; a head-only tied embedding as the embedding), and
    each (file, key)'s shape."""
    sources: dict[str, tuple[Path, str]] = {}
    shapes: dict[tuple[Path, str], tuple[int, ...]] = {}
    lm_head = None
    for path in checkpoint_files(checkpoint_dir):
        for key, stored in read_header(path).items():
            shapes[path, key] = stored.shape
            if layout.canonical(key) == LM_HEAD:
                lm_head = (path, key)
            ours = layout.to_ours(key)
            if ours is not None:
                sources[ours] = (path, key)
    if EMBED not in sources and lm_head is not None:
        sources[EMBED] = lm_head  # tied weights: some checkpoints store only the head
    return sources, shapes


def checkpoint_shapes(checkpoint_dir: Path, layout: WeightLayout = PI05_LAYOUT) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape for every tensor the family uses, from the safetensors headers only."""
    sources, shapes = _scan_headers(checkpoint_dir, layout)
    return {ours: shapes[source] for ours, source in sources.items() if not ours.startswith("?")}


def _format_keys(keys, limit: int = 12) -> str:
    keys = sorted(keys)
    more = f" … and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _other_family_hint(layout: WeightLayout, keys: list[str]) -> str:
    """Names the family the weights belong to when it is another one than config.json's type says."""
    for other in WEIGHT_LAYOUTS.values():
        found = next((k for k in keys if other is not layout and other.signature.match(other.canonical(k))), None)
        if found is not None:
            return (f". The weights are a {other.display} checkpoint ({found}), but config.json's type is "
                    f"{layout.family!r}: the config and the weights come from different policies")
    return ""


def _mapped(path: Path) -> torch.Tensor:
    """The file's bytes as a uint8 tensor over a private mapping: pages are read when a copy touches them (from the
    page cache where `ReadAhead` got there first). The mapping is never closed explicitly: it lives as long as any
    tensor viewing it (closing it under a live view would leave the view on unmapped memory)."""
    with open(path, "rb") as f:
        return torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)


def _read_mapped(by_file: dict[Path, list[str]]):
    """(checkpoint key, tensor) for the wanted keys, one at a time, each a copy of its bytes in the file's mapping:
    memory of the process's own, which a checkpoint file replaced or truncated on disk while the server runs
    cannot pull away (a view of the mapping would fault)."""
    for path, keys in by_file.items():
        index, data = read_header(path), _mapped(path)
        for key in keys:
            stored = index[key]
            yield key, data[stored.begin:stored.end].clone().view(stored.dtype).reshape(stored.shape)


def _read_runai(by_file: dict[Path, list[str]]):
    """(checkpoint key, tensor) through runai-model-streamer: many parallel reads into host buffers."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        wanted = {key for keys in by_file.values() for key in keys}
        streamer.stream_files([str(p) for p in by_file], device="cpu", tensor_names=wanted)
        yield from streamer.get_tensors()


class StagedCopy:
    """Moves host bytes to the device through two pinned staging buffers: a CPU copy into one (torch spreads a
    large copy over the host's cores) while the other's copies to the device run on a stream of their own. A
    pageable tensor's own `.to("cuda")` goes through the driver's small staging buffer on one thread, far below
    the link's bandwidth (docs/memory.md). A tensor stored in another dtype than its
    parameter's arrives in a scratch tensor and is cast on the device (round to nearest even, as on the host: the
    same bits). To a CPU device a tensor is cast in place of a copy (staging buys nothing there) unless `staged`
    asks for the staged path anyway, with plain buffers and synchronous copies (how the CPU tests check it)."""

    CHUNK_BYTES = 64 * 2**20

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, staged: bool | None = None):
        self.device, self.chunk_bytes = device, chunk_bytes
        cuda = device.type == "cuda"
        self.staged = cuda if staged is None else staged
        self._stream = torch.cuda.Stream(device) if cuda and self.staged else None
        self._buffers = ([torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
                         if self.staged else [])
        self._done: list = [None, None]  # per buffer: the event of its last copies to the device
        self._turn = 0

    def pieces(self, source: torch.Tensor, targets: list[tuple[int, int, torch.Tensor]]) -> None:
        """`source` (host bytes, at most `chunk_bytes`) staged once, and its bytes [lo, hi) copied into each
        target (lo, hi, device bytes), in stream order after every copy before."""
        buffer = self._buffers[self._turn]
        if self._done[self._turn] is not None:
            self._done[self._turn].synchronize()  # its previous copies to the device have read it
        buffer[:source.numel()].copy_(source)
        if self._stream is None:
            for lo, hi, dst in targets:
                dst.copy_(buffer[lo:hi])
        else:
            with torch.cuda.stream(self._stream):
                for lo, hi, dst in targets:
                    dst.copy_(buffer[lo:hi], non_blocking=True)
                self._done[self._turn] = torch.cuda.Event()
                self._done[self._turn].record()
        self._turn ^= 1

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A device tensor for bytes that are cast once they are there. The copies into it wait for the work queued
        before it: the memory may be a scratch tensor's that a cast still reads."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return out

    def arrived(self) -> None:
        """Orders what the current stream does next (a cast, any use) after the copies queued so far."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def __call__(self, tensor: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        """`tensor` (host) on the device in `dtype`; `into`: written into that device tensor (of `tensor`'s
        shape and `dtype`), which is returned."""
        if not self.staged:
            return tensor.to(device=self.device, dtype=dtype) if into is None else into.copy_(tensor)
        direct = into is not None and into.dtype == tensor.dtype and into.is_contiguous()
        out = into if direct else self.scratch(tensor.shape, tensor.dtype)
        src, dst = _bytes(tensor.contiguous()), _bytes(out)
        for start in range(0, src.numel(), self.chunk_bytes):
            stop = min(start + self.chunk_bytes, src.numel())
            self.pieces(src[start:stop], [(0, stop - start, dst[start:stop])])
        self.arrived()
        if into is not None:
            return out if direct else into.copy_(out)  # (a copy across dtypes rounds as .to does: the same bits)
        return out if out.dtype == dtype else out.to(dtype)

    def finish(self) -> None:
        """Waits for the last copies. The buffers then go back to torch's pinned-memory cache, which
        keeps them (128 MiB of host memory: torch has no public call that empties that cache)."""
        if self._stream is not None:
            self._stream.synchronize()


class _Incoming:
    """One parameter on its way from its file: the device bytes its stored bytes go to (the parameter's own, or a
    scratch tensor of the stored dtype, cast into the parameter once complete), and how far they have come."""

    def __init__(self, stored: StoredTensor, param: torch.Tensor, copy: StagedCopy):
        self.begin, self.end, self.next, self.param = stored.begin, stored.end, stored.begin, param
        direct = param.dtype == stored.dtype and param.is_contiguous()
        self.scratch = None if direct else copy.scratch(stored.shape, stored.dtype)
        self.bytes = _bytes(param if direct else self.scratch)

    def piece(self, start: int, limit: int) -> tuple[int, int, torch.Tensor]:
        """Its bytes from `next` up to `limit` (file offsets), as a target of the range that starts at `start`."""
        stop = min(self.end, limit)
        target = (self.next - start, stop - start, self.bytes[self.next - self.begin:stop - self.begin])
        self.next = stop
        return target

    def arrived(self, copy: StagedCopy) -> None:
        if self.scratch is not None:
            copy.arrived()
            self.param.copy_(self.scratch)  # the cast (round to nearest even, as .to: the same bits)
            self.scratch = self.bytes = None


def _load_ranges(params: dict[str, torch.Tensor], sources: dict[str, tuple[Path, str]], copy: StagedCopy, bar) -> None:
    """Each file read through its mapping in ranges of up to `copy.chunk_bytes` of consecutive wanted tensors,
    each range staged once and each tensor's part of it copied up into its parameter: a few interpreter-level
    operations a range and a tensor, where a copy of each tensor on its own took a dozen, every one of which waits
    for the interpreter lock while graphs are captured beside the load (`Policy.from_pretrained`)."""
    for path, items in _by_file(sources).items():
        index, data = read_header(path), _mapped(path)
        queue = deque(sorted(((index[key], params[ours]) for ours, key in items), key=lambda item: item[0].begin))
        carried: _Incoming | None = None  # a tensor the last range ended inside
        while queue or carried:
            start = carried.next if carried else queue[0][0].begin
            limit = start + copy.chunk_bytes
            targets, complete = [], []
            while True:
                if carried is None:  # the next tensor joins if its bytes follow on (a tensor not loaded is not read)
                    end = start + (targets[-1][1] if targets else 0)
                    if not queue or (targets and queue[0][0].begin != end) or queue[0][0].begin >= limit:
                        break
                    carried = _Incoming(*queue.popleft(), copy)
                targets.append(carried.piece(start, limit))
                if carried.next < carried.end:
                    break  # continues in the next range
                complete.append(carried)
                carried = None
            copy.pieces(data[start:start + targets[-1][1]], targets)
            for incoming in complete:
                incoming.arrived(copy)
            bar.update(len(complete))
        del data  # the mapping goes with its last view
    copy.arrived()  # the parameters written in place, as the casts: before anything the current stream does next


def _by_file(sources: dict[str, tuple[Path, str]]) -> dict[Path, list[tuple[str, str]]]:
    """`check_weights`'s answer grouped by file: (our name, checkpoint key) pairs."""
    grouped: dict[Path, list[tuple[str, str]]] = {}
    for ours, (path, key) in sources.items():
        grouped.setdefault(path, []).append((ours, key))
    return grouped


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_weights(model: nn.Module, checkpoint_dir: Path,
                  layout: WeightLayout = PI05_LAYOUT) -> dict[str, tuple[Path, str]]:
    """Checks every name and shape of `model` (any device, meta included) against the checkpoint's
    safetensors headers, no data read: missing, unexpected and wrong-shaped tensors are named in
    one CheckpointError. -> our name -> (file, key) of each tensor to load."""
    expected = {n: p for n, p in model.named_parameters()}
    sources, shapes = _scan_headers(checkpoint_dir, layout)
    unexpected = [key for ours, (_, key) in sources.items() if ours not in expected]
    missing = [n for n in expected if n not in sources]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_format_keys(layout.to_lerobot(n) for n in missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_format_keys(unexpected)}")
        raise CheckpointError(f"{checkpoint_dir} does not match the {layout.display} architecture; "
                              + "; ".join(parts) + _other_family_hint(layout, [key for _, key in shapes]))
    wrong_shape = [f"{source[1]}: checkpoint {list(shapes[source])} vs model {list(expected[ours].shape)}"
                   for ours, source in sources.items() if shapes[source] != tuple(expected[ours].shape)]
    if wrong_shape:
        raise CheckpointError(f"{checkpoint_dir}: tensors of the wrong shape: " + "; ".join(wrong_shape[:12]))

    return sources


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device,
                layout: WeightLayout = PI05_LAYOUT) -> nn.Module:
    """Gives `model` (built on the meta device) uninitialized parameters on `device` in the dtype policy's
    dtypes, for `load_weights` to fill in place: what runs on their storage before the load (a CUDA graph
    captured while the weights load: Policy.from_pretrained) reads the weights once they are there."""
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            module._parameters[name] = nn.Parameter(
                torch.empty(p.shape, dtype=layout.param_dtype(full, dtype), device=device),
                requires_grad=p.requires_grad)
    return model


def load_weights(model: nn.Module, checkpoint_dir: Path, dtype: torch.dtype, device: torch.device,
                 progress: bool = True, loader: str = "safetensors", layout: WeightLayout = PI05_LAYOUT,
                 sources: dict[str, tuple[Path, str]] | None = None, staging: StagedCopy | None = None) -> nn.Module:
    """Fills `model` from safetensors, strictly: built on the meta device, its parameters become the loaded
    tensors; materialized (`materialize`, on `device`), each is written in place, its storage kept.

    Every name and shape is checked against the headers (`check_weights`) before any data is read. To a device
    the bytes go through pinned staging buffers (`StagedCopy`; `staging`: another one, as the CPU tests use) and
    are cast there, so no full-precision copy of the model ever sits in host memory: the safetensors loader reads
    each file in ranges (`_load_ranges`), runai-model-streamer's parallel reads arrive a tensor at a time. To the
    host (a CPU device, offload) each tensor is copied out of the file's mapping, then cast where needed.
    `sources`: `check_weights`'s answer, where the caller checked already.
    """
    if sources is None:
        sources = check_weights(model, checkpoint_dir, layout)
    loader = check_weight_loader(loader)
    copy = staging or StagedCopy(torch.device(device))
    with tqdm(total=len(sources), desc="loading weights", unit="tensor", disable=not progress) as bar:
        if loader == "safetensors" and copy.staged:
            if any(p.is_meta for p in model.parameters()):
                materialize(model, dtype, device, layout)
            _load_ranges({n: p.data for n, p in model.named_parameters()}, sources, copy, bar)
        else:
            _load_tensors(model, sources, dtype, layout, copy, loader, bar)
    copy.finish()
    return model


def _load_tensors(model: nn.Module, sources: dict[str, tuple[Path, str]], dtype: torch.dtype, layout: WeightLayout,
                  copy: StagedCopy, loader: str, bar) -> None:
    """The load a tensor at a time, as `loader` reads them."""
    by_file = {path: [key for _, key in items] for path, items in _by_file(sources).items()}
    ours_of = {key: ours for ours, (_, key) in sources.items()}
    read = {"safetensors": _read_mapped, "runai-streamer": _read_runai}[loader]
    params = dict(model.named_parameters())
    in_place = not any(p.is_meta for p in params.values())
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in read(by_file):
        ours = ours_of[key]
        moved = copy(tensor, layout.param_dtype(ours, dtype), into=params[ours].data if in_place else None)
        if not in_place:
            loaded[ours] = moved
        bar.update()
    if not in_place:
        model.load_state_dict(loaded, strict=True, assign=True)
