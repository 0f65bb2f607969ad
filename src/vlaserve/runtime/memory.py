"""Memory profiles, and how much device memory each needs, known before any weight is loaded.

A profile says where the weights live and how much the engine may keep (docs/memory.md):
- default: every weight resident in the serving dtype; the CUDA fast path keeps graphs and static
  buffers for every batch size it meets.
- edge-16gb: resident too; graphs only for batches of at most 4. The server never forms a larger
  batch (its max batch size is capped); a larger batch from a library caller runs the same kernels
  without graphs. The prefix cache, when enabled, holds fewer entries.
- offload: the vision tower's and the VLM's layer matrices stay in pinned host memory and stream
  through two device slots per stack on every call (runtime/offload.py); on CUDA the fast path runs,
  the prefix outside CUDA graphs.

The estimate is weights + offload slots + K/V cache and static buffers + activations + the CUDA
graphs' pool + a fixed headroom, from the checkpoint's tensor shapes (safetensors headers) and the
policy's sizes; the formulas sit next to the code. `check_fit` compares it with what the process may use on the device.
The opt-in prefix cache is enabled after loading and is not in it (`prefix_kv_bytes` is one entry).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..checkpoint.files import available_memory_bytes
from ..checkpoint.weights import PI05_LAYOUT, WeightLayout, checkpoint_shapes, layout_for
from ..config import PROFILES, MemoryProfile, PolicyConfig, RuntimeConfig, graph_batch_sizes, prompt_lengths
from ..errors import InsufficientMemory
from .fast.buffers import BufferSpec
from .offload import STREAMED_PREFIXES, streamed

log = logging.getLogger(__name__)

GIB = 2**30
# What the terms below leave out: cuBLAS workspaces (one per stream, and graph capture uses side
# streams), graph-pool and allocator rounding, fragmentation. Set from a measurement: the fast path's
# peak at batch 1 (docs/benchmarks.md, 7.05 GiB) lies 0.43 GiB above the modelled terms; 0.75 GiB keeps
# a margin over that. bench/bench_memory.py prints estimate and measured peak side by side to recheck.
# (The graphs' pool beyond the modelled activations has its own term, GRAPH_POOL_PER_PROMPT_LENGTH.)
# (The CUDA context is outside the allocator and already missing from the free memory the check reads.)
HEADROOM_BYTES = 768 * 2**20
# The CUDA graphs' pool beyond the widest call the activations term models: a quarter of that call's
# activations per prompt length captured, fitted to measured buffers + graphs against the modelled ones at
# batches 1..8 (full size, 3 cameras; docs/benchmarks.md). (A term per graph fits worse: the ladder's
# graphs left as much over as the twice as many of "all".)
GRAPH_POOL_PER_PROMPT_LENGTH = 0.25
def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def counts_by_dtype(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                    layout: WeightLayout = PI05_LAYOUT) -> dict[str, int]:
    """Parameter counts per dtype under the family's serving dtype policy (its fp32 set)."""
    counts: Counter = Counter()
    for name, shape in shapes.items():
        counts[str(layout.param_dtype(name, dtype)).removeprefix("torch.")] += math.prod(shape)
    return dict(counts)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one profile needs at one batch size; `total` is device memory (host_pinned is not)."""

    profile: str
    batch_size: int  # the largest batch that will run (edge-16gb: capped at its max_graph_batch)
    weights: int
    offload_slots: int
    kv_and_buffers: int
    activations: int
    headroom: int
    host_pinned: int
    graph_pool: int = 0  # the CUDA graphs' pool beyond `activations` (GRAPH_POOL_PER_PROMPT_LENGTH)
    graph_count: int = 0  # CUDA graphs captured at warm-up (0: the eager model)

    @property
    def total(self) -> int:
        return self.weights + self.offload_slots + self.kv_and_buffers + self.activations + self.graph_pool + self.headroom

    @property
    def engine(self) -> int:
        """The engine's share: the fast path's static buffers and CUDA graphs (what the runtime's
        graph_bytes measures), or the eager model's K/V and activations."""
        return self.kv_and_buffers + self.activations + self.graph_pool

    def describe(self) -> str:
        parts = [f"weights {gib(self.weights)}"]
        if self.offload_slots:
            parts.append(f"layer slots {gib(self.offload_slots)}")
        parts += [f"K/V cache and buffers {gib(self.kv_and_buffers)}", f"activations {gib(self.activations)}"]
        if self.graph_count:
            parts.append(f"{self.graph_count} CUDA graphs' pool {gib(self.graph_pool)}")
        parts.append(f"headroom {gib(self.headroom)}")
        return f"{gib(self.total)} ({', '.join(parts)})"

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def prefix_kv_bytes(config: PolicyConfig, itemsize: int) -> int:
    """K and V of one prefix over every VLM layer: [L, Hkv, P, D] each (also one prefix cache entry)."""
    g = config.model.vlm
    return 2 * g.depth * g.num_kv_heads * config.prefix_len * g.head_dim * itemsize


def _kv_and_buffers_per_item(config: PolicyConfig, dtype: torch.dtype, graphs: bool) -> int:
    if not graphs:
        # Eager: the prefix's per-layer K/V, alive from the prefix pass to the last Euler step.
        return prefix_kv_bytes(config, dtype.itemsize)
    # The fast path's static buffers, per batch item (Pi0's carry its state token too).
    state_dim = config.max_state_dim if config.policy_type == "pi0" else 0
    return BufferSpec.of(config, 1, dtype, state_dim=state_dim).nbytes()


def _activations_per_item(config: PolicyConfig, itemsize: int, graphs: bool) -> int:
    """The widest moment of one call, per batch item: a vision layer or a prefix layer, whichever is
    larger (the expert's steps cover H = 50 tokens against the prefix's ~1000 and stay far below)."""
    v, g = config.model.vision, config.model.vlm
    p, s = config.prefix_len, itemsize
    # Vision, per image: residual stream, normed input and attention output [N, W]; fc1 and its GELU
    # [N, mlp]. Attention goes through SDPA, which on CUDA never materializes the [N, N] scores.
    vision = len(config.cameras) * v.num_patches * (3 * v.width + 2 * v.mlp_dim) * s
    if graphs:
        # A prefix layer at its widest: residual and normed input [P, W], fused gate/up [P, 2M], GELU(gate)
        # and the GeGLU product [P, M] each; plus the [P, P] attention mask in the model dtype.
        prefix = p * (2 * g.width + 4 * g.mlp_dim) * s + p * p * s
    else:
        # Eager: the MLP holds GELU(gate), up and their product [P, M] at once; attention materializes
        # the scores [Hq·P, P] in float32 twice (before and after the mask) and the probabilities in the
        # model dtype (8 + s bytes per score); plus the float32 [P, P] mask.
        prefix = p * (2 * g.width * s + max(3 * g.mlp_dim * s, g.num_heads * p * (8 + s)) + 4 * p)
    return max(vision, prefix)


def estimate_memory(shapes: Mapping[str, tuple[int, ...]], config: PolicyConfig, dtype: torch.dtype,
                    profile: MemoryProfile, batch_size: int = 1, fast_path: bool = True,
                    graph_batches: str = "all", num_prompt_lengths: int = 1) -> MemoryEstimate:
    """Device bytes for serving batches of up to `batch_size` under `profile`.

    `shapes` maps our parameter names to shapes (weights.checkpoint_shapes, or a model's). `fast_path`:
    whether the CUDA graph engine runs (on CUDA, unless the caller turned it off); `graph_batches`:
    which batch sizes it keeps buffers and graphs for (config.graph_batch_sizes); `num_prompt_lengths`:
    how many prompt lengths it captures graphs for (config.prompt_lengths: the buckets and the checkpoint's).
    """
    device_bytes = host_bytes = 0
    layer_bytes: Counter = Counter()  # bytes of each streamed layer, keyed "vision.layers.3" etc.
    layout = layout_for(config.policy_type)
    for name, shape in shapes.items():
        n = math.prod(shape) * layout.param_dtype(name, dtype).itemsize
        stack = next((prefix for prefix in STREAMED_PREFIXES if name.startswith(prefix)), None)
        if profile.offload and streamed(name, shape):
            host_bytes += n
            layer_bytes[stack + name[len(stack):].split(".", 1)[0]] += n
        else:
            device_bytes += n
    # Offload: two slots per stack, each the size of one of that stack's (identical) layers.
    slots = 2 * sum(max((n for key, n in layer_bytes.items() if key.startswith(stack)), default=0)
                    for stack in STREAMED_PREFIXES)

    graphs = fast_path  # under offload, too: only the prefix runs outside graphs there
    batch = profile.batch_limit(batch_size)
    itemsize = dtype.itemsize
    # The graph engine keeps buffers for every batch size it captured; eager code only the current call's.
    sizes = graph_batch_sizes(graph_batches, batch)
    buffer_items = sum(sizes) if graphs else batch
    activations = batch * _activations_per_item(config, itemsize, graphs)
    # Per batch size and prompt length: a prefix graph per camera layout (none under offload, whose
    # prefix runs outside graphs) and a denoise graph with and without RTC (runtime/graphs.py).
    per_shape = (0 if profile.offload else len(config.cameras)) + 2
    return MemoryEstimate(
        profile=profile.name, batch_size=batch, weights=device_bytes, offload_slots=slots,
        kv_and_buffers=buffer_items * _kv_and_buffers_per_item(config, dtype, graphs), activations=activations,
        headroom=HEADROOM_BYTES, host_pinned=host_bytes,
        graph_pool=int(GRAPH_POOL_PER_PROMPT_LENGTH * num_prompt_lengths * activations) if graphs else 0,
        graph_count=len(sizes) * num_prompt_lengths * per_shape if graphs else 0)


@dataclass(frozen=True)
class DeviceBudget:
    usable: int  # bytes this process may still allocate on the device
    source: str  # where the number comes from, for messages
    shared_with_host: bool = False  # an integrated GPU (Jetson): pinned host memory comes out of `usable` too

    def fits(self, needed: MemoryEstimate) -> bool:
        return needed.total + (needed.host_pinned if self.shared_with_host else 0) <= self.usable


def given_budget(usable: int) -> DeviceBudget:
    return DeviceBudget(usable, f"the given budget of {gib(usable)}")


def cuda_budget(device: torch.device) -> DeviceBudget:
    """Free device memory (plus what this process's allocator holds unused), capped by
    `torch.cuda.set_per_process_memory_fraction` when that is below 1."""
    # An index, not torch.device("cuda"): get_per_process_memory_fraction refuses a device without one.
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    usable = free + torch.cuda.memory_reserved(index) - allocated
    source = f"{gib(free)} free of {gib(total)} on cuda:{index}"
    # An integrated GPU (Jetson) has no memory of its own: `total` is the board's RAM, which the CPU
    # shares, and `free` what the OS can still give (targets.py's matrix marks these boards).
    integrated = torch.cuda.get_device_properties(index).is_integrated
    if integrated:
        source += (" (integrated GPU: the board's memory, shared with the CPU: free memory counts, not the total, "
                   "and layers pinned in host memory count against it too)")
    # torch has the getter since 2.6 (2.11 and 2.13 both do); without it no cap can be read.
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(index) if get_fraction is not None else 1.0
    if fraction < 1.0:
        # The caching allocator refuses to grow past fraction·total (freeing its cache before it does).
        cap = int(fraction * total)
        usable = min(usable, cap - allocated)
        source += f", per-process cap {gib(cap)} ({fraction:.1%})"
    return DeviceBudget(max(usable, 0), source, shared_with_host=integrated)


def check_fit(shapes: Mapping[str, tuple[int, ...]], config: PolicyConfig, dtype: torch.dtype,
              profile: MemoryProfile, batch_size: int, budget: DeviceBudget,
              fast_path: bool = True, graph_batches: str = "all", num_prompt_lengths: int = 1) -> MemoryEstimate:
    """The estimate, if it fits `budget`; else InsufficientMemory naming the numbers and the profiles that fit."""
    needed = estimate_memory(shapes, config, dtype, profile, batch_size, fast_path, graph_batches, num_prompt_lengths)
    if budget.fits(needed):
        return needed
    others = [estimate_memory(shapes, config, dtype, p, batch_size, fast_path, graph_batches, num_prompt_lengths)
              for p in PROFILES.values() if p is not profile]
    fitting = [e for e in others if budget.fits(e)]
    if fitting:
        options = ", ".join(f"{e.profile} (about {gib(e.total)})" for e in fitting)
        advice = (f"Profiles that fit: {options}; start with --memory-profile {fitting[0].profile} "
                  f"(memory_profile={fitting[0].profile!r}).")
    else:
        options = ", ".join(f"{e.profile} needs about {gib(e.total)}" for e in others)
        advice = f"No profile fits at this batch size ({options}): lower --max-batch-size or free device memory."
    raise InsufficientMemory(
        f"memory profile {profile.name!r} needs about {needed.describe()} for batches of up to "
        f"{needed.batch_size} in {str(dtype).removeprefix('torch.')}, but this process may use only "
        f"{gib(budget.usable)} ({budget.source}). {advice}")


def check_before_loading(checkpoint_dir: Path, config: PolicyConfig, dtype: torch.dtype, settings: RuntimeConfig,
                         device: torch.device) -> MemoryEstimate | None:
    """Policy.from_pretrained's startup check, from the checkpoint's headers. It runs on CUDA, or
    anywhere when `settings.memory_budget_bytes` is given; host memory (the CPU device) is not checked otherwise."""
    if settings.memory_budget_bytes is None and device.type != "cuda":
        return None
    budget = (given_budget(settings.memory_budget_bytes) if settings.memory_budget_bytes is not None
              else cuda_budget(device))
    shapes = checkpoint_shapes(checkpoint_dir, layout_for(config.policy_type))
    needed = check_fit(shapes, config, dtype, settings.profile, settings.max_batch_size, budget,
                       settings.runs_fast_path(device.type), settings.graph_batches,
                       len(prompt_lengths(settings.prompt_buckets, config.max_token_len)))
    log.info("memory profile %s: about %s needed for batches of up to %d; %s usable (%s)", settings.memory_profile,
             needed.describe(), needed.batch_size, gib(budget.usable), budget.source)
    check_host_fit(needed, available_memory_bytes())
    return needed


def check_host_fit(needed: MemoryEstimate, available: int | None) -> None:
    """Offload pins its streamed layers in host memory: refuse at startup when the host has less
    available (MemAvailable) than that, rather than swap or be killed while loading."""
    if needed.host_pinned and available is not None and needed.host_pinned > available:
        raise InsufficientMemory(
            f"memory profile {needed.profile!r} keeps {gib(needed.host_pinned)} of layers pinned in host memory, "
            f"but only {gib(available)} of host memory is available; free host memory or use a device that "
            "holds the model with --memory-profile edge-16gb")
