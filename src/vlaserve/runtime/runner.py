"""The runtime: everything stateful on the device, behind one `enqueue` call.

A runner turns a batch of model inputs into model-space actions. Two implement the same protocol:
`EagerRunner` (the reference model, any device) and `FastRunner` (runtime/graphs.py: fused weights,
Triton kernels, CUDA graphs, which start-up captures: vlaserve/startup/). `Runtime` owns the one
that serves, the prefix cache both share, and the device lock behind its gate (runtime/gate.py).

`Runtime.enqueue` puts a batch on the device (inputs in, graphs, actions back into host memory, all in
stream order) and returns at once; `Enqueued.wait` blocks until that batch is done. So the host can
prepare and enqueue batch k+1 while the device still runs batch k (vlaserve/batcher.py does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..checkpoint.weights import StagedCopy
from ..config import PolicyConfig, RuntimeConfig
from ..model.flow import PrefixContext
from ..model.pi05 import Pi05Model
from ..types import ModelInputs, RTCGuidance
from .device import synchronize
from .gate import Gate, OpenGate
from .prefix_cache import PrefixCache, PrefixEntry
from .transfer import to_device

log = logging.getLogger(__name__)


class StageTimes(Protocol):
    def read(self) -> dict[str, float]:
        """{prefix_ms, denoise_ms} of one call; blocks until its device work is done."""


class Runner(Protocol):
    def dispatch(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None = None,
               prefix: list[PrefixEntry] | None = None, vision_slots: int | None = None,
               graphs: bool = True, trace: torch.Tensor | None = None) -> tuple[torch.Tensor, StageTimes]:
        """Enqueues a call: model-space actions [B, H, A] on the device (valid, in stream order, until
        the next dispatch) and its stage times. With `prefix` (one cached entry per item) the prefix
        pass is skipped; `vision_slots`: how many leading camera slots any item uses (known on the
        host, so the device is never asked); `graphs=False`: the same math without graph replay.
        `trace` [B, num_steps + 1, H, A] (device, float32): filled with x before each Euler step and
        the actions after the last, with the same math (no graph replay)."""

    def prefix_entry(self, i: int) -> PrefixEntry:
        """Item i's prefix K/V from the last call, as a cache entry."""


@dataclass(frozen=True)
class HostTimed:
    """Stage times measured on the host around synchronous work."""

    times: dict[str, float]

    def read(self) -> dict[str, float]:
        return self.times


class EagerRunner:
    """The reference model, synchronously: `dispatch` returns when the call is done."""

    def __init__(self, model: Pi05Model, device: torch.device):
        self.model, self.device = model, device
        self._ctx: PrefixContext | None = None

    @torch.no_grad()
    def dispatch(self, inputs, noise, num_steps, rtc=None, prefix=None, vision_slots=None, graphs=True, trace=None):
        # non_blocking: a plain copy would wait for the batch the device is still running.
        inputs, noise = to_device(inputs, self.device), noise.to(self.device, non_blocking=True)
        rtc = None if rtc is None else rtc.to(self.device)
        t0 = time.perf_counter()  # (the eager model runs every slot; absent ones are masked; no graphs)
        if prefix is not None:
            kv = [(torch.stack([e.k[layer] for e in prefix])[:, None], torch.stack([e.v[layer] for e in prefix])[:, None])
                  for layer in range(len(prefix[0].k))]
            pad = torch.stack([e.pad for e in prefix])
            ctx = PrefixContext(kv=kv, pad_mask=pad, num_valid=pad.long().sum(1))
        else:
            embs, pad_mask = self.model.embed_prefix(inputs.images, inputs.image_masks, inputs.tokens,
                                                     inputs.token_mask)
            ctx = self.model.compute_prefix(embs, pad_mask)
        self._ctx = ctx  # the prefix cache keeps the VLM K/V only, never the state token's
        if inputs.state is not None:  # Pi0: the state token's K/V, once per call, joins the context
            ctx = self.model.with_state(ctx, inputs.state)
        synchronize(self.device)
        t1 = time.perf_counter()
        steps: dict | None = None if trace is None else {}
        actions = self.model.denoise(ctx, noise, num_steps, rtc, trace=steps)
        if trace is not None:
            for k, x in enumerate([*steps["x_t"], actions]):
                trace[:, k] = x
        synchronize(self.device)
        return actions, HostTimed({"prefix_ms": (t1 - t0) * 1e3, "denoise_ms": (time.perf_counter() - t1) * 1e3})

    def prefix_entry(self, i: int) -> PrefixEntry:
        ctx = self._ctx
        return PrefixEntry(torch.stack([k[i, 0] for k, _ in ctx.kv]), torch.stack([v[i, 0] for _, v in ctx.kv]),
                           ctx.pad_mask[i].clone())


class PerItemRunner(EagerRunner):
    """The eager model, batch-invariantly (RuntimeConfig.batch_invariant): each item of a batch runs on its
    own, with the shapes it has alone (prompts are padded to the checkpoint's length in this mode), so its
    actions are the bits it gets alone, at any batch size and position, from its prefix or a cached one.
    Nothing of another item reaches its call: its inputs, noise, RTC guidance and cache entry are its own
    (an item without RTC in a guided batch has zero weights: the guidance is then exactly nothing, so it
    runs unguided, as alone)."""

    def __init__(self, model: Pi05Model, device: torch.device):
        super().__init__(model, device)
        self._entries: list[PrefixEntry] = []

    @torch.no_grad()
    def dispatch(self, inputs, noise, num_steps, rtc=None, prefix=None, vision_slots=None, graphs=True, trace=None):
        actions, entries, times = [], [], {"prefix_ms": 0.0, "denoise_ms": 0.0}
        for i in range(noise.shape[0]):
            alone = None if rtc is None or not bool(rtc.weights[i].any()) else RTCGuidance(
                rtc.prev[i:i + 1], rtc.weights[i:i + 1], rtc.max_weight[i:i + 1])
            out, stages = super().dispatch(item_inputs(inputs, i), noise[i:i + 1], num_steps, alone,
                                           None if prefix is None else [prefix[i]],
                                           trace=None if trace is None else trace[i:i + 1])  # (a view: written through)
            actions.append(out)
            entries.append(super().prefix_entry(0))
            for stage, ms in stages.read().items():
                times[stage] += ms
        self._entries = entries
        return torch.cat(actions), HostTimed(times)

    def prefix_entry(self, i: int) -> PrefixEntry:
        return self._entries[i]


def item_inputs(inputs: ModelInputs, i: int) -> ModelInputs:
    """Item i of a batch as a batch of one: its own tensors, its pending frames renumbered."""
    return ModelInputs(inputs.images[i:i + 1], inputs.image_masks[i:i + 1], inputs.tokens[i:i + 1],
                       inputs.token_mask[i:i + 1], None if inputs.state is None else inputs.state[i:i + 1],
                       tuple((0, slot, frame) for item, slot, frame in inputs.pending if item == i))


class Enqueued:
    """A batch whose device work is enqueued; its actions land in host memory when `done`. Its wait
    blocks on an event, with no lock held: a graph recorded meanwhile is in thread-local capture mode
    (runtime/graphs.py `_Graph`), which another thread's event query or synchronize leaves alone."""

    def __init__(self, host: torch.Tensor, ready: torch.cuda.Event | None, stages: StageTimes, gate: Gate,
                 trace: torch.Tensor | None = None):
        self._host, self._ready, self._stages, self._gate = host, ready, stages, gate
        self._trace = trace
        gate.enqueued()

    @staticmethod
    def of(actions: torch.Tensor, stages: StageTimes, gate: Gate, trace: torch.Tensor | None = None) -> "Enqueued":
        """`trace`: the call's Euler trace on the device, brought back beside the actions."""
        if actions.device.type != "cuda":
            return Enqueued(actions.float().cpu(), None, stages, gate, trace)
        host, host_trace = _to_pinned(actions), None if trace is None else _to_pinned(trace)
        ready = torch.cuda.Event()
        ready.record()
        return Enqueued(host, ready, stages, gate, host_trace)

    def done(self) -> bool:
        return self._ready is None or self._ready.query()

    def wait(self) -> tuple[np.ndarray, dict[str, float]]:
        """Blocks until the batch is done: its model-space actions [B, H, A] (float32) and stage times."""
        try:
            if self._ready is not None:
                self._ready.synchronize()
            return self._host.numpy(), self._stages.read()
        finally:
            self._gate.collected()

    @property
    def trace(self) -> np.ndarray | None:
        """The Euler trace [B, num_steps + 1, H, A] (float32) once `wait` returned; None when not asked for."""
        return None if self._trace is None else self._trace.numpy()


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 copy in host memory, enqueued. A fresh pinned block per batch: torch's caching host
    allocator hands it out again only once the copy recorded on it has finished, so batches in flight
    never share one."""
    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


# stats()["graphs"] of an engine nothing captures graphs for (the eager model): serving, and all captured, at once.
NO_GRAPHS = {"captured": 0, "total": 0, "pending": 0, "captured_shapes": [], "pending_shapes": [],
             "serving_after_s": 0.0, "all_captured_after_s": 0.0, "warmup_s": 0.0, "capture_s": 0.0,
             "kernels_compiled_ahead": 0, "compile_ahead_s": 0.0, "per_graph": [], "error": None,
             "warm_ups_skipped": 0, "memset_nodes": None}


class Runtime:
    """Serves batches on one device: holds the runner, consults the prefix cache, times the stages.

    Built with the eager model's runner, "ready" at once. Start-up (vlaserve/startup/) hands it the CUDA
    fast path's runner (`use`) and holds its gate while it captures that runner's graphs, setting `state`
    ("warming_up", "capturing", "ready" or "failed") and `serving` (set once batches can run) as it goes;
    then it opens the gate (`open_gate`). `enqueue` reads the gate and nothing else of start-up.
    """

    def __init__(self, model: Pi05Model, config: PolicyConfig, runtime: RuntimeConfig, device: torch.device,
                 dtype: torch.dtype, revision: str):
        self.model, self.config, self.settings, self.device, self.dtype = model, config, runtime, device, dtype
        self.device_lock = threading.RLock()  # held around every enqueue, and by a warm-up
        self.gate: Gate = OpenGate(self.device_lock)
        self.offload = None
        if runtime.profile.offload:
            from .offload import LayerOffload

            self.offload = LayerOffload(model, device)
        self.runner: Runner = (PerItemRunner if runtime.batch_invariant else EagerRunner)(model, device)
        self.fast_path = False
        self.graph_bytes = 0  # device memory the fast path's buffers and graphs took at warm-up
        self.state = "ready"  # see the class docstring
        self.serving = threading.Event()  # set once batches can run
        self.serving.set()
        self._graph_stats = lambda: NO_GRAPHS
        # The profile bounds the cache (one entry is a whole prefix's K/V: ~18 MB at full size).
        entries = min(runtime.prefix_cache, runtime.profile.prefix_cache_entries)
        if entries < runtime.prefix_cache:
            log.info("memory profile %s: prefix cache of %d entries (%d asked)", runtime.memory_profile, entries,
                     runtime.prefix_cache)
        self.prefix_cache = None if not entries else PrefixCache(entries, f"{revision}|{dtype}|{device}")

    def use(self, runner: Runner, gate: Gate, graph_stats) -> None:
        """Serves with `runner` (the fast path's) behind `gate` (start-up's while it captures); `graph_stats()`:
        stats()["graphs"] meanwhile."""
        self.runner, self.fast_path = runner, True
        self.gate, self._graph_stats = gate, graph_stats

    def open_gate(self, graph_stats: dict) -> None:
        """Start-up is done: enqueues take the device lock and nothing else; `graph_stats` is its last report."""
        self.gate = OpenGate(self.device_lock)
        self._graph_stats = lambda: graph_stats

    def enqueue(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None,
                use_cache: list[bool] | None = None, graphs: bool = True, trace: bool = False) -> "Enqueued":
        """Enqueues a host batch and returns without waiting for the device: no call here blocks on
        work already running (inputs go up from host memory without a stream sync, the actions come
        back into pinned memory, and an event marks when they are there; the runner moves the inputs
        itself, RTC guidance too: the fast path straight into its static buffers). `use_cache`: per item,
        whether it may use the prefix cache (default all); `graphs=False`: no graph replay; `trace`:
        each Euler step's x comes back too (`Enqueued.trace`; a runner replays no graph for it)."""
        cache = self.prefix_cache
        if use_cache is not None and not any(use_cache):
            cache = None
        keys = None if cache is None else [
            cache.key(inputs.images[i], inputs.image_masks[i], inputs.tokens[i], inputs.token_mask[i],
                      [(slot, frame) for item, slot, frame in inputs.pending if item == i])
            if use_cache is None or use_cache[i] else None
            for i in range(len(inputs.tokens))]
        vision_slots = inputs.vision_slots()  # on the host: no device round trip in `sample`
        gate = self.gate  # start-up's while it captures graphs beside serving, then the plain device lock
        with gate.entering(inputs.tokens.shape[1], vision_slots, num_steps, rtc is not None):
            runner = self.runner
            entries, hit = cache.fetch(keys) if cache is not None else (None, False)
            steps = None if not trace else torch.empty((noise.shape[0], num_steps + 1, *noise.shape[1:]),
                                                       dtype=torch.float32, device=self.device)
            actions, stages = runner.dispatch(inputs, noise, num_steps, rtc, entries if hit else None, vision_slots,
                                            graphs=graphs, trace=steps)
            if cache is not None and not hit:
                for i, (key, entry) in enumerate(zip(keys, entries)):
                    if entry is None and key is not None:
                        cache.put(key, runner.prefix_entry(i))  # device copies, ordered before the next launch
            return Enqueued.of(actions, stages, gate, steps)

    def stage_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """New values of named parameters ((name, host tensor in any dtype) pairs) on the device in each parameter's
        dtype, beside the served ones, while batches go on: what `swap_weights` copies from. Where the device has
        no room for a second copy of the weights, the rest stay in host memory (the swap's copies then cross the
        link, which holds batches back longer)."""
        params = dict(self.model.named_parameters())
        copy, staged, on_host = StagedCopy(self.device), {}, False
        for name, tensor in tensors:
            dtype = params[name].dtype
            if not on_host:
                try:
                    staged[name] = copy(tensor, dtype)
                    continue
                except torch.cuda.OutOfMemoryError:
                    on_host = True
                    log.warning("no device memory to stage the new weights beside the served ones: the rest stay "
                                "in host memory, and the swap copies them across the link")
            staged[name] = tensor.to(dtype)  # (round to nearest even, as the device's cast: the same bits)
        copy.finish()
        return staged

    @torch.no_grad()
    def swap_weights(self, staged: dict[str, torch.Tensor]) -> None:
        """Copies `staged` (stage_weights') into the served parameters in place, in stream order behind the batches
        enqueued before, which run on the old weights; batches enqueued after run on the new. The fast path's
        tensors derived from the weights are computed again in place (its captured graphs read the same tensors:
        no re-capture), and the prefix cache, whose K/V the old weights computed, is emptied."""
        with self.device_lock:
            params = dict(self.model.named_parameters())
            for name, tensor in staged.items():
                params[name].copy_(tensor)
            if self.fast_path:
                self.runner.refresh_weights()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def limit_host_threads(self) -> None:
        """For a server on a GPU: torch's host ops on one thread each. They are small (a request's
        images, tokens, noise), and run on several threads at once (workers, the batcher's); with
        the intra-op pool each is a parallel region whose barrier waits for all its team's threads,
        which stalls a short prepare many times over on a host with a thread spinning on the GPU. On a
        CPU device the pool stays: it runs the model."""
        if self.device.type == "cuda" and torch.get_num_threads() != 1:
            log.info("torch host ops on 1 thread (was %d): the model runs on the GPU", torch.get_num_threads())
            torch.set_num_threads(1)

    def stats(self) -> dict:
        runner = self.runner
        return {"state": self.state, "fast_path": self.fast_path,
                "graph_captures": getattr(runner, "captures", 0), "uncaptured_calls": getattr(runner, "uncaptured_calls", 0),
                "padded_calls": getattr(runner, "padded_calls", 0), "split_calls": getattr(runner, "split_calls", 0),
                "request_path_captures": getattr(runner, "request_path_captures", 0),
                "graph_batches": list(self.settings.graph_sizes) if self.fast_path else [],
                "graph_bytes": self.graph_bytes,
                "graphs": self._graph_stats(),
                "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats()}


