"""CUDA graphs over the fast path: static buffers per batch size (a prompt bucket uses views of
them), one graph for the prefix (per batch size, prompt length and vision slots) and one for all
Euler steps (per batch size, prompt length, step count and RTC on/off), replayed back to back with
events between them.

`FastRunner.launch` is: pick the buffers, copy the inputs in, replay (or run: a batch size `warmup`
did not capture, and the offload profile's prefix, run the same kernels without a graph), and
return without waiting; `sample` also waits, and copies the actions out. Which sizes are captured
is the caller's (RuntimeConfig.graph_sizes, up to its batch limit).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ...config import PolicyConfig
from ...model.pi05 import Pi05Model
from ...model.rtc import RTCGuidance
from ...types import ModelInputs
from ..prefix_cache import PrefixEntry
from .buffers import BufferSpec
from .model import StaticRTC
from .pi0 import FastPi0, fast_model


class _Graph:
    def __init__(self, fn, pool, stream: torch.cuda.Stream, capture_lock):
        # Warm up on a side stream (allocator + library handles), then capture. One stream per
        # engine: each new stream would get (and keep) its own cuBLAS workspace.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # The warm-up runs above (which compile the Triton kernels: the slow part) may overlap the
        # serving thread's eager calls; the capture itself holds the policy's device lock.
        with capture_lock, torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.output = fn()

    def replay(self):
        self.graph.replay()
        return self.output


@dataclass(frozen=True)
class EventTimes:
    """Stage times of one call from CUDA events recorded around its prefix and its Euler steps."""

    start: torch.cuda.Event
    mid: torch.cuda.Event
    end: torch.cuda.Event

    def read(self) -> dict[str, float]:
        self.end.synchronize()
        return {"prefix_ms": self.start.elapsed_time(self.mid), "denoise_ms": self.mid.elapsed_time(self.end)}


class FastRunner:
    """Runs batches through the fast path (FastPi05, or FastPi0): fused weights, Triton kernels, CUDA graphs.

    With a `layer_stream` (offload) the prefix runs the same kernels outside graphs, as its weights
    arrive layer by layer; the Euler steps stay in graphs.
    """

    def __init__(self, model: Pi05Model, config: PolicyConfig, use_graphs: bool = True, use_triton: bool = True,
                 device_lock=None, layer_stream=None, gemm_library: str = "cublas",
                 attention_library: str = "triton"):
        self.fast = fast_model(model, use_triton=use_triton, layer_stream=layer_stream, gemm_library=gemm_library,
                               attention_library=attention_library)
        self.state_dim = model.max_state_dim if isinstance(self.fast, FastPi0) else 0
        self.model, self.config = model, config
        self.device = model.action_in_proj.weight.device
        self.use_graphs = use_graphs
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._capture_stream = torch.cuda.Stream() if use_graphs else None
        self._device_lock = device_lock if device_lock is not None else threading.RLock()
        self._buffers: dict[tuple, dict] = {}
        self._rtc: dict[tuple, StaticRTC] = {}
        self._prefix_graphs: dict[tuple, _Graph] = {}
        # After `capture_all`, nothing is captured on the request path: a shape outside the captured
        # set runs the same kernels without a graph, and is counted.
        self.frozen = False
        self.captures = 0
        self.uncaptured_calls = 0
        self.padded_calls = 0  # batches run padded to the next captured size (graph_batches "ladder")
        self._sizes: tuple[int, ...] = ()  # the batch sizes `warmup` captured
        self._denoise_graphs: dict[tuple, _Graph] = {}

    def buffers(self, b: int, token_len: int) -> dict:
        """The static buffers of batch size b: allocated at the checkpoint's prompt length, views of
        those for a shorter one (a prompt bucket; the calls of one runner run in stream order)."""
        if (b, token_len) not in self._buffers:
            spec = BufferSpec.of(self.config, b, self.fast.dtype, token_len, self.state_dim)
            full = self.config.max_token_len
            self._buffers[(b, token_len)] = (spec.views(self.buffers(b, full)) if token_len < full
                                             else spec.allocate(self.device))
        return self._buffers[(b, token_len)]

    def _graphed(self, graphs: dict, key: tuple, fn):
        if key not in graphs:
            if self.frozen:
                self.uncaptured_calls += 1
                return fn()
            graphs[key] = _Graph(fn, self._pool, self._capture_stream, self._device_lock)
            self.captures += 1
        return graphs[key].replay()

    def _prefix(self, buf, vision_slots: int, graphs: bool):
        def run():
            pad = self.fast.prefix(buf["images"], buf["image_masks"], buf["tokens"], buf["token_mask"],
                                   buf["k_cache"], buf["v_cache"], vision_slots)
            if self.state_dim:  # Pi0: the state token's K/V, once per call, after the prefix
                pad = self.fast.state_token(buf["state"], pad, buf["k_cache"], buf["v_cache"])
            buf["pad"].copy_(pad)
            return buf["pad"]

        if self.fast.layer_stream is not None:
            with self._device_lock:  # the layer slots are shared with the eager model's calls during a warm-up
                return run()
        if graphs:
            return self._graphed(self._prefix_graphs, (*buf["tokens"].shape, vision_slots), run)
        return run()

    def _denoise(self, buf, num_steps: int, rtc: StaticRTC | None, graphs: bool):
        def run():
            sched = self.fast.schedule(num_steps)
            return self.fast.denoise(buf["pad"], buf["noise"], sched, buf["k_cache"], buf["v_cache"], rtc)

        if graphs:
            self.fast.schedule(num_steps)  # its tensors are allocated outside the capture
            return self._graphed(self._denoise_graphs, (*buf["tokens"].shape, num_steps, rtc is not None), run)
        return run()

    def _static_rtc(self, b: int, token_len: int, num_steps: int, rtc: RTCGuidance) -> StaticRTC:
        key = (b, token_len, num_steps)
        if key not in self._rtc:
            self._rtc[key] = StaticRTC.allocate(b, self.config.action_horizon, self.config.model.max_action_dim,
                                                num_steps, self.device)
        self._rtc[key].fill(rtc, self.fast.schedule(num_steps).times)
        return self._rtc[key]

    def _prefix_len(self, buf) -> int:
        return buf["pad"].shape[1] - (1 if self.state_dim else 0)

    def restore_prefix(self, buf, entries: list[PrefixEntry]) -> None:
        plen = self._prefix_len(buf)
        for i, e in enumerate(entries):
            buf["k_cache"][:, i, :plen] = e.k
            buf["v_cache"][:, i, :plen] = e.v
            buf["pad"][i] = e.pad

    def sample(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None = None,
               prefix: list[PrefixEntry] | None = None, vision_slots: int | None = None):
        """`launch`, waited for: (model-space actions [B, H, A] on the device, a copy the next call
        leaves alone; {prefix_ms, denoise_ms})."""
        out, times = self.launch(inputs, noise, num_steps, rtc, prefix, vision_slots)
        stages = times.read()
        return out.clone(), stages

    @torch.no_grad()
    def launch(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None = None,
               prefix: list[PrefixEntry] | None = None, vision_slots: int | None = None, graphs: bool = True):
        """Enqueues one call -> (model-space actions [B, H, A]: the graph's output buffer, which the
        next call overwrites in stream order; its EventTimes). Nothing here waits for the device.

        `prefix`: cached entries, one per item, restored instead of running the prefix. `vision_slots`:
        how many leading camera slots any item uses (absent cameras come last; the rest skip SigLIP).
        `graphs=False` (a request's runtime.cuda_graph false): the same kernels, never replayed nor padded."""
        b, token_len = inputs.tokens.shape
        padded = graphs and self.frozen and b not in self._sizes
        target = next((s for s in self._sizes if s >= b), b) if padded else b
        if target != b:  # a ladder: run at the next captured size, the last item repeated, and keep b rows
            self.padded_calls += 1
            p_inputs, p_noise, p_rtc, p_prefix = _padded(target, inputs, noise, rtc, prefix)
            out, times = self.launch(p_inputs, p_noise, num_steps, p_rtc, p_prefix, vision_slots)
            return out[:b], times
        buf = self.buffers(b, token_len)
        graphs = graphs and self.use_graphs
        if vision_slots is None:
            vision_slots = inputs.vision_slots()
        if prefix is None:
            for name in ("images", "image_masks", "tokens", "token_mask"):
                buf[name].copy_(getattr(inputs, name))
            if self.state_dim:
                buf["state"].copy_(inputs.state)
        buf["noise"].copy_(noise)
        static_rtc = None if rtc is None else self._static_rtc(b, token_len, num_steps, rtc)
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        if prefix is not None:
            self.restore_prefix(buf, prefix)
            if self.state_dim:  # the cache holds the prefix only: Pi0's state token is this call's
                buf["state"].copy_(inputs.state)
                plen = self._prefix_len(buf)
                buf["pad"].copy_(self.fast.state_token(buf["state"], buf["pad"][:, :plen], buf["k_cache"],
                                                       buf["v_cache"]))
        else:
            self._prefix(buf, vision_slots, graphs)
        mid.record()
        out = self._denoise(buf, num_steps, static_rtc, graphs)
        end.record()
        self._last = buf
        return out, EventTimes(start, mid, end)

    def prefix_entry(self, i: int) -> PrefixEntry:
        """Item i's prefix K/V from the last call, as a cache entry (copies: the buffers are reused)."""
        buf = self._last
        plen = self._prefix_len(buf)
        return PrefixEntry(buf["k_cache"][:, i, :plen].clone(), buf["v_cache"][:, i, :plen].clone(),
                           buf["pad"][i].clone())

    def warmup(self, batch_sizes=(1,), num_steps: int = 10, token_lens: tuple[int, ...] | None = None) -> None:
        """Compiles the kernels and captures the graphs of every batch size in `batch_sizes`, every
        prompt length in `token_lens` (config.prompt_lengths; default the checkpoint's), every
        camera layout (how many leading slots are present), with and without RTC; then freezes."""
        cameras, horizon, width = len(self.config.cameras), self.config.action_horizon, self.config.model.max_action_dim
        lengths = sorted(token_lens or (self.config.max_token_len,), reverse=True)
        # Largest first, as nano-vllm does: the graphs share one pool, and a smaller batch's tensors
        # then fit in blocks a larger one freed (ascending, each size grew the pool anew: run 32).
        for b in sorted(batch_sizes, reverse=True):
            for length in lengths:
                buf = self.buffers(b, length)
                noise = torch.randn_like(buf["noise"])
                for slots in range(cameras, 0, -1):
                    masks = torch.arange(cameras, device=self.device)[None].expand(b, -1) < slots
                    inputs = ModelInputs(buf["images"], masks.contiguous(), buf["tokens"], buf["token_mask"],
                                         buf.get("state"))
                    self.sample(inputs, noise, num_steps, None, vision_slots=slots)
                rtc = RTCGuidance(torch.zeros(b, horizon, width, device=self.device),
                                  torch.zeros(b, horizon, device=self.device), torch.zeros(b, device=self.device))
                self.sample(inputs, noise, num_steps, rtc, vision_slots=slots)  # the last layout
        self._sizes = tuple(sorted(batch_sizes))
        self.frozen = True


def _padded(size: int, inputs: ModelInputs, noise, rtc: RTCGuidance | None, prefix):
    """The batch grown to `size` rows by repeating its last item (its rows are computed and dropped;
    the item repeated has a camera layout the batch already has, so vision_slots still holds)."""
    def grow(t):
        return None if t is None else torch.cat([t, t[-1:].expand(size - t.shape[0], *t.shape[1:])])

    grown = ModelInputs(*(grow(t) for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask,
                                            inputs.state)))
    grown_rtc = None if rtc is None else RTCGuidance(grow(rtc.prev), grow(rtc.weights), grow(rtc.max_weight))
    grown_prefix = None if prefix is None else list(prefix) + [prefix[-1]] * (size - len(prefix))
    return grown, grow(noise), grown_rtc, grown_prefix
