"""CUDA graphs over the fast path: static buffers per batch size (a prompt bucket uses views of
them), one graph for the prefix (per batch size, prompt length and vision slots) and one for all
Euler steps (per batch size, prompt length, step count and RTC on/off), replayed back to back with
events between them.

`FastRunner.dispatch` is: pick the buffers, copy the inputs in, replay (a batch size not captured
for this shape runs as captured ones: padded or split, runtime/graph_keys.py `route`; the offload
profile's prefix runs the same kernels without a graph), and return without waiting; `sample` also
waits, and copies the actions out. Which graphs are captured, and when, is the caller's
(`capture`, one at a time, in start-up's plan, startup/plan.py: RuntimeConfig.graph_sizes x prompt
lengths x camera layouts x RTC).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ..config import PolicyConfig
from ..model.pi05 import Pi05Model
from ..types import ModelInputs, RTCGuidance
from .graph_keys import GraphKey, route
from .prefix_cache import PrefixEntry
from .transfer import BytesIn, into_buffers, to_device
from .fast.buffers import BufferSpec
from .fast.launch_tables import SM90, LaunchTable
from .fast.memset_nodes import memsets_as_kernels
from .fast.model import StaticRTC
from .fast.pi0 import FastPi0, fast_model
from .fast.precompile import CompilePool, KernelNotLoaded, KernelRecorder, loaded_kernels_only

# A warm-up runs the Euler loop for this many steps, not the call's: every step launches the same
# kernel specializations except the first and the last (Pi0.5's fused action step with and without
# the next step's input), so two steps compile and load everything the call's ten do
# (tests/test_gpu_targets.py checks it for every batch size, both families, with and without RTC)
# at a fifth of the host work.
WARMUP_STEPS = 2


class _Graph:
    """One captured call. A capture records and runs nothing: the kernels it records must have run
    before (a warm-up compiles them). It is recorded in thread-local capture mode: only this thread
    is barred from calls that would break a capture (a synchronize, an event query, cudaMalloc), so
    other threads go on launching batches and waiting for them meanwhile. (Global mode, torch's
    default, bars every thread of the process: serving held a lock around every device call and
    waited out each recording, 0.03-0.3 s a graph.) The capture stream is one of torch's pool
    streams, which are non-blocking: work other threads put on the legacy default stream does not
    join the capture.

    Captured with CUDAGraph.capture_begin / capture_end, not the `torch.cuda.graph` context: that
    context first synchronizes the whole device and empties the allocator's cache (device and
    pinned host), before every graph. Beside serving that waited for the batch in flight, and
    handed every cached block back to the driver for the next batch and warm-up to allocate
    anew; the runtime empties the cache once, when the plan is done (runtime/runner.py)."""

    def __init__(self, fn, pool, stream: torch.cuda.Stream):
        # The libraries' memset nodes are replaced by fill kernels before instantiation (memset_nodes.py:
        # the same bytes, a cheaper launch), so the capture is kept until then.
        self.graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.stream(stream):
            self.graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                self.output = fn()
            finally:
                self.graph.capture_end()
        started = time.perf_counter()
        self.memsets_replaced, self.memsets_left = memsets_as_kernels(self.graph.raw_cuda_graph())
        self.edit_s = time.perf_counter() - started
        self.graph.instantiate()  # (what capture_end does for a graph it does not keep)

    def replay(self):
        self.graph.replay()
        return self.output


@dataclass(frozen=True)
class EventTimes:
    """Stage times of one call from CUDA events recorded around its prefix and its Euler steps; with
    `previous` (the call before's end, when this one was launched before it ended) also
    `launch_gap_ms`: the device's time from that end to this call's start, which overlapped launches
    should keep to the input copies (the batcher forms the next batch just before the running one
    ends; a late launch leaves the device idle)."""

    start: torch.cuda.Event
    mid: torch.cuda.Event
    end: torch.cuda.Event
    previous: torch.cuda.Event | None = None

    def read(self) -> dict[str, float]:
        self.end.synchronize()
        times = {"prefix_ms": self.start.elapsed_time(self.mid), "denoise_ms": self.mid.elapsed_time(self.end)}
        if self.previous is not None:
            times["launch_gap_ms"] = self.previous.elapsed_time(self.start)
        return times


@dataclass(frozen=True)
class PartTimes:
    """Stage times of a batch run as parts (`route`): from the first part's start to the last's
    end, of which the parts' prefixes are the prefix time and the rest the denoise time."""

    parts: list[EventTimes]

    def read(self) -> dict[str, float]:
        first = self.parts[0].read()
        prefix = first["prefix_ms"] + sum(part.read()["prefix_ms"] for part in self.parts[1:])
        total = self.parts[0].start.elapsed_time(self.parts[-1].end)
        gap = {"launch_gap_ms": first["launch_gap_ms"]} if "launch_gap_ms" in first else {}
        return {"prefix_ms": prefix, "denoise_ms": total - prefix, **gap}


class _OwnTurns:
    """A runner's device turns where no start-up hands it its own (benchmarks, tests): a lock, taken at once."""

    def __init__(self):
        self.lock = threading.RLock()

    def warm_up(self):
        return self.lock


class FastRunner:
    """Runs batches through the fast path (FastPi05, or FastPi0): fused weights, Triton kernels, CUDA graphs.

    With a `layer_stream` (offload) the prefix runs the same kernels outside graphs, as its weights
    arrive layer by layer; the Euler steps stay in graphs.

    `capture` takes one graph of a plan (startup/plan.py) at a time, beside serving: its warm-up
    runs on scratch buffers of the same shapes (never on the static buffers a served graph reads),
    only where the capture meets a kernel not loaded yet, holding the device when `turns` allows;
    the recording holds nothing. From the first `capture` on the
    request path never captures: a batch whose graphs are not captured (yet) runs on captured
    sizes of its shape (`route`: padded, or split), and only a shape with none runs without graphs
    (counted in `uncaptured_calls`).
    """

    def __init__(self, model: Pi05Model, config: PolicyConfig, use_graphs: bool = True, use_triton: bool = True,
                 turns=None, layer_stream=None, gemm_library: str = "cublas",
                 attention_library: str = "triton", launch_table: LaunchTable = SM90):
        self.fast = fast_model(model, use_triton=use_triton, layer_stream=layer_stream, gemm_library=gemm_library,
                               attention_library=attention_library, launch_table=launch_table)
        self.state_dim = model.max_state_dim if isinstance(self.fast, FastPi0) else 0
        self.model, self.config = model, config
        self.device = self.fast.device
        self.use_graphs = use_graphs
        self.gemm_library, self.attention_library = gemm_library, attention_library
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._capture_stream = torch.cuda.Stream() if use_graphs else None
        # The device lock, and when a warm-up takes it: start-up's (startup/turns.py), else the runner's own lock.
        self._turns = turns if turns is not None else _OwnTurns()
        self._buffers: dict[tuple, dict] = {}
        self._scratch: dict[tuple, object] = {}  # warm-up buffers of the batch size being captured
        self._scratch_batch = 0
        self._warmed: set[tuple] = set()  # kernel signatures a warm-up has run (or a capture, every kernel loaded)
        self._vision_attention_warmed: set[int] = set()  # image counts SigLIP's attention ran at
        self._rtc: dict[tuple, StaticRTC] = {}
        self._prefix_graphs: dict[tuple, _Graph] = {}
        self._bytes_in: dict[int, BytesIn] = {}  # per batch size, captured after its first prefix graph
        self._denoise_graphs: dict[tuple, _Graph] = {}
        self.frozen = False  # captures only through `capture` (a plan), never on the request path
        self.captures = 0
        self.warm_ups_skipped = 0  # signatures captured first, every kernel loaded
        # The libraries' memset nodes made fill kernels in the graphs captured, those no fill kernel
        # covers, and the seconds the edits took.
        self.memset_nodes = {"replaced": 0, "left": 0, "edit_s": 0.0}
        self.request_path_captures = 0  # captures inside `dispatch` (a runner without a plan)
        self.uncaptured_calls = 0
        self.padded_calls = 0  # batches run padded to a larger captured size (`route`)
        self.split_calls = 0  # batches run as several captured sizes while graphs are being captured
        self._sizes: set[int] = set()  # the batch sizes `capture` was given
        self._last_rows: list = []  # per item of the last call: (buffers, row), or its prefix entry copied
        self._last_end: torch.cuda.Event | None = None  # the last call's end (EventTimes.previous)

    def _buffer_set(self, store: dict, b: int, token_len: int) -> dict:
        if (b, token_len) not in store:
            spec = BufferSpec.of(self.config, b, self.fast.dtype, token_len, self.state_dim)
            full = self.config.max_token_len
            store[(b, token_len)] = (spec.views(self._buffer_set(store, b, full)) if token_len < full
                                     else spec.allocate(self.device))
        return store[(b, token_len)]

    def buffers(self, b: int, token_len: int) -> dict:
        """The static buffers of batch size b: allocated at the checkpoint's prompt length, views of
        those for a shorter one (a prompt bucket; the calls of one runner run in stream order)."""
        return self._buffer_set(self._buffers, b, token_len)

    def _rtc_buffers(self, b: int, token_len: int, num_steps: int, store: dict | None = None) -> StaticRTC:
        store = self._rtc if store is None else store
        key = ("rtc", b, token_len, num_steps)
        if key not in store:
            store[key] = StaticRTC.allocate(b, self.config.action_horizon, self.config.model.max_action_dim,
                                            num_steps, self.device)
        return store[key]

    def _warm_up(self, fn, runs: int) -> None:
        """Runs `fn` on the capture stream (compiling its kernels, creating the library handles a
        capture needs), and waits for it on the host only: serving's stream never waits."""
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(runs):
                fn()
        stream.synchronize()

    def _new_graph(self, fn) -> _Graph:
        edited = self.memset_nodes
        graph = _Graph(fn, self._pool, self._capture_stream)
        edited["replaced"] += graph.memsets_replaced
        edited["left"] += graph.memsets_left
        edited["edit_s"] += graph.edit_s
        return graph

    def _graphed(self, graphs: dict, key: tuple, fn):
        if key not in graphs:
            if self.frozen:
                self.uncaptured_calls += 1
                return fn()
            self._warm_up(fn, 2)  # a runner without a plan (benchmarks, tests): on its own buffers
            graphs[key] = self._new_graph(fn)
            self.captures += 1
            self.request_path_captures += 1
        return graphs[key].replay()

    def _prefix_fn(self, buf, vision_slots: int):
        def run():
            pad = self.fast.prefix(buf["images"], buf["image_masks"], buf["tokens"], buf["token_mask"],
                                   buf["k_cache"], buf["v_cache"], vision_slots)
            if self.state_dim:  # Pi0: the state token's K/V, once per call, after the prefix
                pad = self.fast.state_token(buf["state"], pad, buf["k_cache"], buf["v_cache"])
            buf["pad"].copy_(pad)
            return buf["pad"]

        return run

    def _denoise_fn(self, buf, num_steps: int, rtc: StaticRTC | None):
        def run():
            sched = self.fast.schedule(num_steps)
            return self.fast.denoise(buf["pad"], buf["noise"], sched, buf["k_cache"], buf["v_cache"], rtc)

        return run

    def _prefix(self, buf, vision_slots: int, graphs: bool):
        run = self._prefix_fn(buf, vision_slots)
        if self.fast.layer_stream is not None:
            with self._turns.lock:  # every call streams its layers through the same slots: one at a time
                return run()
        if graphs:
            return self._graphed(self._prefix_graphs, (*buf["tokens"].shape, vision_slots), run)
        return run()

    def _denoise(self, buf, num_steps: int, rtc: StaticRTC | None, graphs: bool):
        run = self._denoise_fn(buf, num_steps, rtc)
        if graphs:
            self.fast.schedule(num_steps)  # its tensors are allocated outside the capture
            return self._graphed(self._denoise_graphs, (*buf["tokens"].shape, num_steps, rtc is not None), run)
        return run()

    def _static_rtc(self, b: int, token_len: int, num_steps: int, rtc: RTCGuidance) -> StaticRTC:
        static = self._rtc_buffers(b, token_len, num_steps)
        static.fill(rtc, self.fast.schedule(num_steps).times)
        return static

    @torch.no_grad()
    def capture(self, key: GraphKey, num_steps: int) -> tuple[float, float]:
        """Captures one graph of a plan -> seconds (warm-up, capture). The warm-up (where this kernel signature has
        not run: the prefix once per batch size and length, at the plan's first camera layout; the Euler steps
        once per batch size, length and RTC, WARMUP_STEPS of them) runs on scratch buffers, so a graph served
        meanwhile never reads half-written inputs, and takes the device (`turns.warm_up`: the device lock, when
        serving leaves room): no batch is launched while a kernel compiles or loads (with warm-ups outside the
        lock, serving beside captures stalled). The recording, on the static
        buffers, runs nothing and holds nothing (`_Graph`): served batches launch meanwhile. A batch size's
        scratch buffers go when the plan moves to another size.

        The graph enters its store, where `dispatch` finds it, once it can be replayed; its shape's static buffers
        are made here before that, so serving, which reaches a shape only through a stored graph, never makes
        them at the same time.

        After the first warm-up a signature's capture goes first, and its warm-up runs only if the capture
        meets a Triton kernel this process has not loaded (the capture stops there and is dropped; nothing of
        it ran): most of a plan's signatures launch no kernel an earlier one did not. What a warm-up does
        besides loading kernels (library handles, the capture stream's workspaces) the first one does, and it
        always runs."""
        self.frozen = True
        self._sizes.add(key.batch)
        if not self.use_graphs or (key.is_prefix and self.fast.layer_stream is not None):
            return 0.0, 0.0  # nothing to capture: no graphs, or the offload profile's prefix
        b, length = key.batch, key.length
        started = time.perf_counter()
        graphs, graph_key, signature, make = self._call_of(key, num_steps)
        if graph_key in graphs:
            return 0.0, 0.0

        def served_call():  # on the static buffers the graph will read
            return make(self.buffers(b, length), self._rtc_buffers(b, length, num_steps))

        if key.is_prefix:
            self._warm_vision_attention(b * key.slots)
        runs = int(signature not in self._warmed)
        graph = None
        if runs and self._captures_first():
            attempt = time.perf_counter()
            graph = self._capture_if_loaded(served_call())  # (a dropped attempt counts as warm-up time)
            self.warm_ups_skipped += graph is not None
        if runs and graph is None:
            with self._turns.warm_up():
                self._warm_up(self._warm_up_call(key, num_steps), runs)
        self._warmed.add(signature)
        warmed = attempt if graph is not None else time.perf_counter()
        graphs[graph_key] = graph if graph is not None else self._new_graph(served_call())
        self.captures += 1
        if key.is_prefix and b not in self._bytes_in:
            self._bytes_in[b] = self._capture_bytes_in(b, length, num_steps)
        return warmed - started, time.perf_counter() - warmed

    def _capture_bytes_in(self, b: int, length: int, num_steps: int) -> BytesIn:
        """Batch size b's `BytesIn`; the first one's conversion runs once before, on scratch buffers, to load
        torch's kernels outside a capture (every batch size launches the same three: one dtype, one layout)."""
        if not self._bytes_in:
            scratch = self._scratch_of(b, length, num_steps)[0]
            with self._turns.warm_up():
                self._warm_up(BytesIn.conversion(scratch), 1)
        return BytesIn(self.buffers(b, length), self._new_graph)

    def _captures_first(self) -> bool:
        """Whether a capture may go before its warm-up: once a warm-up has run, and only with Triton's and
        cuBLAS's kernels, or the invariant ones (Triton's too; a CuTe library compiles per shape, unseen by Triton)."""
        return bool(self._warmed) and self.gemm_library in ("cublas", "invariant") \
            and self.attention_library in ("triton", "invariant")

    def _capture_if_loaded(self, fn) -> _Graph | None:
        """The graph of `fn`, or None if it launches a Triton kernel not loaded in this process yet
        (the capture stops at that launch and is dropped: a captured graph runs nothing until it is
        replayed, so nothing was written)."""
        try:
            with loaded_kernels_only():
                return self._new_graph(fn)
        except KernelNotLoaded:
            return None

    def _warm_vision_attention(self, images: int) -> None:
        """SigLIP's attention at this image count, once, before the first capture that calls it. A
        camera layout's prefix warms up at the plan's first layout only (the same kernels), but torch's
        scaled_dot_product_attention, meeting a shape inside a capture with no eager call at it
        before, is slow there (milliseconds a call, 27 calls a prefix, at every prompt length)."""
        if images not in self._vision_attention_warmed:
            with self._turns.warm_up():
                self._warm_up(lambda: self.fast.warm_vision_attention(images), 1)
            self._vision_attention_warmed.add(images)

    def _warm_up_call(self, key: GraphKey, num_steps: int):
        """The call a warm-up of `key` runs: on scratch buffers, with WARMUP_STEPS Euler steps."""
        steps = min(num_steps, WARMUP_STEPS)
        return self._call_of(key, steps)[3](*self._scratch_of(key.batch, key.length, steps))

    def _call_of(self, key: GraphKey, num_steps: int):
        """-> (its graph store, its key there, its warm-up signature, make(buffers, rtc) -> the call)."""
        b, length = key.batch, key.length
        if key.is_prefix:
            # One camera layout differs from another in SigLIP's batch (b x slots images) only: the same
            # Triton specializations; quack's CuTe kernels may compile per GEMM shape, so each warms up.
            signature = ("prefix", b, length, key.slots if self.gemm_library == "quack" else None)
            return (self._prefix_graphs, (b, length, key.slots), signature,
                    lambda buf, rtc: self._prefix_fn(buf, key.slots))
        self.fast.schedule(num_steps)  # allocated outside the capture
        return (self._denoise_graphs, (b, length, num_steps, key.rtc), ("denoise", b, length, key.rtc),
                lambda buf, rtc: self._denoise_fn(buf, num_steps, rtc if key.rtc else None))

    def _scratch_of(self, b: int, length: int, num_steps: int):
        """The warm-up buffers of batch size b (the previous size's go): (buffers, rtc buffers)."""
        if self._scratch_batch != b:
            self._scratch, self._scratch_batch = {}, b
        with torch.cuda.stream(self._capture_stream):  # allocated where they are used
            return (self._buffer_set(self._scratch, b, length),
                    self._rtc_buffers(b, length, num_steps, self._scratch))

    @torch.no_grad()
    def record_kernels(self, keys: list[GraphKey], num_steps: int, pool: CompilePool) -> KernelRecorder:
        """Gives `pool`'s processes the Triton kernels the warm-ups of `keys` would compile, before any of
        them runs (fast/precompile.py) -> the recorder `pool.compile` waits on. Each call not warmed up
        yet runs once on scratch buffers with those kernels recorded instead of launched (its other
        work, cuBLAS's, runs: on scratch, and never read), taking the device as a warm-up does."""
        recorder, ran = pool.recorder(), set()  # each kernel to the workers as it is recorded
        if not self.use_graphs:
            return recorder
        for key in keys:
            if key.is_prefix and self.fast.layer_stream is not None:
                continue
            graphs, graph_key, signature, _ = self._call_of(key, num_steps)
            if graph_key in graphs or signature in self._warmed or signature in ran:
                continue
            ran.add(signature)
            with self._turns.warm_up():
                call = self._warm_up_call(key, num_steps)
                with recorder.recording():
                    self._warm_up(call, 1)
        return recorder

    def refresh_weights(self) -> None:
        """What the fast model derived from the weights, computed again now that they are loaded (Runtime.
        weights_loaded): the graphs captured before read the same tensors."""
        self.fast.refresh_weights()

    def release_scratch(self) -> None:
        """Frees the warm-up buffers (once the plan is done)."""
        self._scratch, self._scratch_batch = {}, 0

    def captured_sizes(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool,
                       with_prefix: bool = True) -> list[int]:
        """The batch sizes whose graphs for this shape are captured (the prefix's only where the
        call runs it: not for cached prefixes, nor offloaded ones)."""
        with_prefix = with_prefix and self.fast.layer_stream is None
        return [b for b in sorted(self._sizes) if (b, token_len, num_steps, rtc) in self._denoise_graphs
                and (not with_prefix or (b, token_len, vision_slots) in self._prefix_graphs)]

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
        """`dispatch`, waited for: (model-space actions [B, H, A] on the device, a copy the next call
        leaves alone; {prefix_ms, denoise_ms})."""
        out, times = self.dispatch(inputs, noise, num_steps, rtc, prefix, vision_slots)
        stages = times.read()
        return out.clone(), stages

    @torch.no_grad()
    def dispatch(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None = None,
               prefix: list[PrefixEntry] | None = None, vision_slots: int | None = None, graphs: bool = True):
        """Enqueues one call -> (model-space actions [B, H, A]: the graph's output buffer, which the
        next call overwrites in stream order; its stage times). Nothing here waits for the device.

        `inputs`, `noise`: on the host (Runtime.enqueue: each goes up once, into its static buffer) or
        the device. `prefix`: cached entries, one per item, restored instead of running the prefix. `vision_slots`:
        how many leading camera slots any item uses (absent cameras come last; the rest skip SigLIP).
        `graphs=False` (a request's runtime.cuda_graph false): the same kernels, never replayed nor
        padded. A batch size without graphs for this shape runs as captured ones (`route`)."""
        b, token_len = inputs.tokens.shape
        if vision_slots is None:
            vision_slots = inputs.vision_slots()
        graphs = graphs and self.use_graphs
        parts = [(b, b)]
        if graphs and self.frozen:
            captured = self.captured_sizes(token_len, vision_slots, num_steps, rtc is not None, prefix is None)
            parts = route(b, captured) or parts  # none: run as it is (uncaptured, counted)
        if parts == [(b, b)]:
            out, times = self._dispatch_one(inputs, noise, num_steps, rtc, prefix, vision_slots, graphs)
            self._last_rows = [(self._last, i) for i in range(b)]
            return out, times
        # Cut into parts and padded on the device (a padded batch repeats rows of every input: on the
        # host, a transposing copy of its frames), its pending frames placed first.
        inputs, noise = to_device(inputs, self.device), noise.to(self.device, non_blocking=True)
        return self._dispatch_parts(parts, inputs, noise, num_steps, rtc, prefix, vision_slots)

    def _dispatch_parts(self, parts: list[tuple[int, int]], inputs, noise, num_steps, rtc, prefix, vision_slots):
        """One batch as several calls of captured sizes, the last padded where `route` says; their
        actions gathered into one [B, H, A] tensor in the items' order."""
        self.padded_calls += any(rows < size for size, rows in parts)
        self.split_calls += len(parts) > 1
        out, times, rows_of, first = None, [], [], 0
        for j, (size, rows) in enumerate(parts):
            part = _rows(slice(first, first + rows), inputs, noise, rtc, prefix)
            if rows < size:  # the batch's last item repeated: its rows are computed and dropped
                part = _padded(size, *part)
            part_out, part_times = self._dispatch_one(*part[:2], num_steps, part[2], part[3], vision_slots, True)
            if out is None:
                out = torch.empty((inputs.tokens.shape[0], *part_out.shape[1:]), dtype=part_out.dtype,
                                  device=part_out.device)
            out[first:first + rows].copy_(part_out[:rows])  # the next replay overwrites the graph's output
            # The prefix cache asks for each item's K/V after the call: copy them now where a later
            # part of the same size reuses these buffers.
            reused = any(s == size for s, _ in parts[j + 1:])
            rows_of += [self._entry(self._last, i) if reused else (self._last, i) for i in range(rows)]
            times.append(part_times)
            first += rows
        self._last_rows = rows_of
        return out, PartTimes(times)

    def _events(self):
        return tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))

    def _dispatch_one(self, inputs, noise, num_steps, rtc, prefix, vision_slots, graphs):
        b, token_len = inputs.tokens.shape
        buf = self.buffers(b, token_len)
        if prefix is None:
            into_buffers(inputs, buf, self._bytes_in.get(b) if graphs else None)
        start, mid, end = self._events()
        # Still running: this call is launched behind it, and the gap between them is measured.
        previous = self._last_end if self._last_end is not None and not self._last_end.query() else None
        start.record()
        if prefix is not None:
            self.restore_prefix(buf, prefix)
            if self.state_dim:  # the cache holds the prefix only: Pi0's state token is this call's
                buf["state"].copy_(inputs.state, non_blocking=True)
                plen = self._prefix_len(buf)
                buf["pad"].copy_(self.fast.state_token(buf["state"], buf["pad"][:, :plen], buf["k_cache"],
                                                       buf["v_cache"]))
        else:
            self._prefix(buf, vision_slots, graphs)
        mid.record()
        # What only the Euler steps read goes up once the prefix is on its way.
        buf["noise"].copy_(noise, non_blocking=True)
        static_rtc = None if rtc is None else self._static_rtc(b, token_len, num_steps, rtc)
        out = self._denoise(buf, num_steps, static_rtc, graphs)
        end.record()
        self._last, self._last_end = buf, end
        return out, EventTimes(start, mid, end, previous)

    def _entry(self, buf, i: int) -> PrefixEntry:
        plen = self._prefix_len(buf)
        return PrefixEntry(buf["k_cache"][:, i, :plen].clone(), buf["v_cache"][:, i, :plen].clone(),
                           buf["pad"][i].clone())

    def prefix_entry(self, i: int) -> PrefixEntry:
        """Item i's prefix K/V from the last call, as a cache entry (copies: the buffers are reused)."""
        row = self._last_rows[i]
        return row if isinstance(row, PrefixEntry) else self._entry(*row)


def _rows(rows: slice, inputs: ModelInputs, noise, rtc: RTCGuidance | None, prefix):
    """The batch's items `rows`: (inputs, noise, rtc, prefix entries)."""
    def take(t):
        return None if t is None else t[rows]

    part = ModelInputs(*(take(t) for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask,
                                           inputs.state)))
    part_rtc = None if rtc is None else RTCGuidance(take(rtc.prev), take(rtc.weights), take(rtc.max_weight))
    return part, take(noise), part_rtc, None if prefix is None else prefix[rows]

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
