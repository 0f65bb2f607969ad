"""The runtime: everything stateful on the device, behind one `run` call.

A runner turns a batch of model inputs into model-space actions. Two implement the same protocol:
`EagerRunner` (the reference model, any device) and `FastRunner` (fast/graphs.py: fused weights,
Triton kernels, CUDA graphs). `Runtime` owns the one that serves (on CUDA the fast one, from its
first captured batch size on, while the rest are captured: runtime/capture.py), the prefix cache
both share, and the device lock.

`Runtime.launch` only enqueues a batch (inputs in, graphs, actions back into host memory, all in
stream order) and returns at once; `Launched.wait` blocks until that batch is done. So the host can
prepare and enqueue batch k+1 while the device still runs batch k (vlaserve/batcher.py does).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import PolicyConfig, RuntimeConfig, prompt_lengths
from ..errors import ConfigError, NotServing
from ..model.flow import PrefixContext
from ..model.pi05 import Pi05Model
from ..model.rtc import RTCGuidance
from ..processing.prepare import to_device
from ..types import ModelInputs
from .capture import GraphKey, capture_plan
from .compile_cache import activate, is_empty
from .device import finish_queued, synchronize
from .fast.precompile import CompilePool, KernelRecorder, compile_workers
from .fast.targets import Target, choose_target, target_for
from .memory import estimate_memory
from .prefix_cache import PrefixCache, PrefixEntry
from .turns import DeviceTurns

log = logging.getLogger(__name__)


class StageTimes(Protocol):
    def read(self) -> dict[str, float]:
        """{prefix_ms, denoise_ms} of one call; blocks until its device work is done."""


class Runner(Protocol):
    def launch(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None = None,
               prefix: list[PrefixEntry] | None = None, vision_slots: int | None = None,
               graphs: bool = True) -> tuple[torch.Tensor, StageTimes]:
        """Enqueues a call: model-space actions [B, H, A] on the device (valid, in stream order, until
        the next launch) and its stage times. With `prefix` (one cached entry per item) the prefix
        pass is skipped; `vision_slots`: how many leading camera slots any item uses (known on the
        host, so the device is never asked); `graphs=False`: the same math without graph replay."""

    def prefix_entry(self, i: int) -> PrefixEntry:
        """Item i's prefix K/V from the last call, as a cache entry."""


@dataclass(frozen=True)
class HostTimed:
    """Stage times measured on the host around synchronous work."""

    times: dict[str, float]

    def read(self) -> dict[str, float]:
        return self.times


class EagerRunner:
    """The reference model, synchronously: `launch` returns when the call is done."""

    def __init__(self, model: Pi05Model, device: torch.device):
        self.model, self.device = model, device
        self._ctx: PrefixContext | None = None

    @torch.no_grad()
    def launch(self, inputs, noise, num_steps, rtc=None, prefix=None, vision_slots=None, graphs=True):
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
        actions = self.model.denoise(ctx, noise, num_steps, rtc)
        synchronize(self.device)
        return actions, HostTimed({"prefix_ms": (t1 - t0) * 1e3, "denoise_ms": (time.perf_counter() - t1) * 1e3})

    def prefix_entry(self, i: int) -> PrefixEntry:
        ctx = self._ctx
        return PrefixEntry(torch.stack([k[i, 0] for k, _ in ctx.kv]), torch.stack([v[i, 0] for _, v in ctx.kv]),
                           ctx.pad_mask[i].clone())


# While the capture thread records graphs beside serving, the interpreter hands its lock between threads
# this often instead of every 5 ms (Python's default): each of a recording's ~1,500 kernel launches gives
# the lock up and takes it back, and behind a busy serving thread may wait up to the whole interval (run
# 216, H100, 16 robots sending, warm compile cache: the plan's captures 30.4 s at 5 ms, 23.9 s at this).
CAPTURE_SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def _switching_often():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, CAPTURE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class Launched:
    """A batch whose device work is enqueued; its actions land in host memory when `done`. Its wait
    blocks on an event, with no lock held: a graph recorded meanwhile is in thread-local capture mode
    (fast/graphs.py `_Graph`), which another thread's event query or synchronize leaves alone."""

    def __init__(self, host: torch.Tensor, ready: torch.cuda.Event | None, stages: StageTimes,
                 turns: DeviceTurns):
        self._host, self._ready, self._stages, self._turns = host, ready, stages, turns
        turns.launched()

    @staticmethod
    def enqueue(actions: torch.Tensor, stages: StageTimes, turns: DeviceTurns) -> "Launched":
        if actions.device.type != "cuda":
            return Launched(actions.float().cpu(), None, stages, turns)
        # A fresh pinned block per batch: torch's caching host allocator hands it out again only
        # once the copy recorded on it has finished, so batches in flight never share one.
        host = torch.empty(actions.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(actions, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Launched(host, ready, stages, turns)

    def done(self) -> bool:
        return self._ready is None or self._ready.query()

    def wait(self) -> tuple[np.ndarray, dict[str, float]]:
        """Blocks until the batch is done: its model-space actions [B, H, A] (float32) and stage times."""
        try:
            if self._ready is not None:
                self._ready.synchronize()
            return self._host.numpy(), self._stages.read()
        finally:
            self._turns.collected()


class Runtime:
    """Serves batches on one device: picks the runner, consults the prefix cache, times the stages.

    On the CUDA fast path the runner's graphs are captured in runtime/capture.py's plan order and
    `state` moves: "warming_up" (nothing can run yet) -> "capturing" (batch 1's first prefix and
    Euler-steps graphs are captured: `serving` is set and batches run, on the captured sizes, while
    a background thread captures the rest; a call of a batch-1 shape not captured yet has its graphs
    captured next and waits for them) -> "ready" (all captured); or -> "failed" (a capture raised:
    logged, named in stats()["graphs"]["error"]; batches keep running on the graphs captured before,
    or, if that was before batch 1's first, fail with NotServing). Elsewhere (the eager model) it is "ready" at once.
    `warmup="blocking"` returns from the constructor once all are captured (a failure raises);
    "background" returns at once, and a batch launched before `serving` waits for it, at most
    SERVING_WAIT_S.
    """

    # How long a batch launched before batch 1's graphs exist waits for them before NotServing:
    # above any warm-up measured (batch 1's kernels compile and its graphs capture in seconds; quack's
    # compiles took ~33 s), and bounded so a stuck warm-up surfaces as errors, not as hung requests.
    SERVING_WAIT_S = 120.0

    def __init__(self, model: Pi05Model, config: PolicyConfig, runtime: RuntimeConfig, device: torch.device,
                 dtype: torch.dtype, revision: str, progress: bool = False, weights_pending: bool = False):
        """`weights_pending`: the model's parameters are on the device but not loaded yet (checkpoint.weights.
        materialize); its graphs are compiled and captured meanwhile, and serving waits for `weights_loaded()`."""
        self.model, self.config, self.settings, self.device, self.dtype = model, config, runtime, device, dtype
        self.progress = progress  # a progress bar on stderr while graphs are captured
        self._weights = threading.Event()  # set once the weights are loaded
        self._weights.set()
        self._serving_lock = threading.Lock()  # serving starts once: from the capture thread or the load's end
        # Launches hold the turns' lock; a warm-up before a graph's capture takes it when runtime/turns.py says.
        self.turns = DeviceTurns()
        self.offload = None
        if runtime.profile.offload:
            from .offload import LayerOffload

            self.offload = LayerOffload(model, device)
        self.runner: Runner = EagerRunner(model, device)
        self.fast_path = False
        self.graph_bytes = 0  # device memory the fast path's buffers and graphs took at warm-up
        self.state = "ready"  # see the class docstring
        self.serving = threading.Event()  # set once batches can run
        self.serving.set()
        self._settled = threading.Event()  # set once serving, or failed before it
        self._settled.set()
        self._graphs = _GraphProgress([])
        # The profile bounds the cache (one entry is a whole prefix's K/V: ~18 MB at full size).
        entries = min(runtime.prefix_cache, runtime.profile.prefix_cache_entries)
        if entries < runtime.prefix_cache:
            log.info("memory profile %s: prefix cache of %d entries (%d asked)", runtime.memory_profile, entries,
                     runtime.prefix_cache)
        self.prefix_cache = None if not entries else PrefixCache(entries, f"{revision}|{dtype}|{device}")
        target = choose_target(device) if runtime.runs_fast_path(device.type) else None
        if weights_pending and target is None:
            raise ValueError("weights_pending needs the CUDA fast path")
        if target is not None:
            self._start_fast_path(model, target, runtime.warmup == "background", weights_pending)  # both families
        elif runtime.gemm_library != "cublas":
            raise ConfigError(f"gemm_library {runtime.gemm_library!r} runs on the CUDA fast path only")
        elif runtime.attention_library != "triton":
            raise ConfigError(f"attention_library {runtime.attention_library!r} runs on the CUDA fast path only")

    @staticmethod
    def captures_while_loading(settings: RuntimeConfig, device: torch.device) -> bool:
        """Whether a Runtime for `settings` on `device` may start before its weights load (weights_pending): as
        RuntimeConfig.captures_while_loading says, on a GPU the fast path serves (sm80 and newer)."""
        return (settings.captures_while_loading(device.type)
                and target_for(torch.cuda.get_device_capability(device)) is not None)

    def _start_fast_path(self, model: Pi05Model, target: Target, background: bool, weights_pending: bool) -> None:
        from .fast.graphs import FastRunner
        from .fast.launch_tables import table_for

        cache = activate(self.settings.compile_cache, self.device)  # before any kernel compiles (TRITON_CACHE_DIR)
        # A cache without a single entry: every kernel is compiled, so a group's (the graphs serving
        # waits for, then each batch size's) are compiled together in worker processes before its
        # warm-ups (fast/precompile.py, serve_while_capturing). With
        # some entries, a warm-up's compiles are the few the cache lacks: one by one, as they run.
        pool = CompilePool(compile_workers()) if self.settings.parallel_compile and is_empty(cache) else None

        fast = FastRunner(model, self.config, turns=self.turns, layer_stream=self.offload,
                          gemm_library=self.settings.gemm_library, attention_library=self.settings.attention_library,
                          warmups=self.settings.capture_warmups, memset_kernels=self.settings.graph_memset_kernels,
                          launch_table=table_for(target))
        lengths = prompt_lengths(self.settings.prompt_buckets, self.config.max_token_len)
        plan = capture_plan(self.settings.graph_sizes, lengths, len(self.config.cameras))
        if self.offload is not None:  # its prefix streams its layers outside graphs: the Euler steps' only
            plan = [key for key in plan if not key.is_prefix]
        # The allocator's reserved bytes, its unused cache returned first on both sides: what stays is
        # the static buffers and the graphs' private pools (free device memory also moves with other
        # processes and with what loading left cached).
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)

        def measure() -> None:
            fast.release_scratch()
            torch.cuda.empty_cache()
            self.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
            shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
            estimate = estimate_memory(shapes, self.config, self.dtype, self.settings.profile,
                                       self.settings.batch_limit, graph_batches=self.settings.graph_batches,
                                       num_prompt_lengths=len(lengths))
            log.info("fast path: %d CUDA graphs for batch sizes %s and prompt lengths %s, %.2f GiB of device "
                     "memory (the startup check counted %.2f GiB for static buffers and graphs)", fast.captures,
                     ",".join(map(str, self.settings.graph_sizes)), ",".join(map(str, lengths)),
                     self.graph_bytes / 2**30, estimate.engine / 2**30)

        self.serve_while_capturing(fast, plan, self.config.num_inference_steps, background, measure, pool,
                                   weights_pending)

    def serve_while_capturing(self, runner, plan: list[GraphKey], num_steps: int, background: bool,
                              finish=lambda: None, compile_pool: CompilePool | None = None,
                              weights_pending: bool = False) -> None:
        """Serves with `runner` from the plan's first batch size on: captures the plan (runner.capture
        (key, num_steps) -> seconds of warm-up and of capture), sets `serving` once the first size's
        graphs are captured, and calls `finish` once all are, before "ready". `background`: the
        captures run in a thread and this returns at once; else they run here and a failure raises.
        `compile_pool`: before the first capture of a group of keys, the pool compiles their kernels together
        (runner.record_kernels(its keys, num_steps, pool) gives them to it): first the keys serving waits for,
        with the next group's kernels queued behind theirs, then each batch size's (the first size's
        others); the pool is closed once the plan ends. `weights_pending` (background only): the plan is
        compiled and captured meanwhile; serving and "ready" wait for `weights_loaded()`."""
        if weights_pending and not background:
            raise ValueError("a plan captured before the weights are loaded runs in the background")
        self.runner, self.fast_path = runner, True
        self._graphs = _GraphProgress(plan, num_steps)
        self.state = "warming_up"
        self.serving.clear()
        self._settled.clear()
        if weights_pending:
            self._weights.clear()
        args = (runner, num_steps, finish, compile_pool)
        if not background:
            self._capture(*args, reraise=True)
            return
        threading.Thread(target=self._capture, args=args, kwargs={"reraise": False}, name="vlaserve-capture",
                         daemon=True).start()

    @staticmethod
    def _record(runner, keys: list[GraphKey], num_steps: int, pool: CompilePool) -> tuple[KernelRecorder, float]:
        started = time.perf_counter()
        return runner.record_kernels(keys, num_steps, pool), time.perf_counter() - started

    def _compile(self, recorder: KernelRecorder, recording_s: float, what: str, pool: CompilePool) -> None:
        """Waits for `recorder`'s kernels to compile (see serve_while_capturing), recorded in `recording_s`;
        `what` names them in the log."""
        graphs = self._graphs
        started = time.perf_counter()
        kernels = pool.compile(recorder)
        waited = time.perf_counter() - started
        graphs.compiled(kernels, recording_s + waited)
        # where the seconds went: the calls run to record their kernels, each kernel compiled from its recording on
        slowest = "" if pool.slowest is None else ", the slowest, %s, %.1f s in its worker" % pool.slowest
        log.info("%s: %d kernels compiled in %d worker processes, recorded in %.1f s, waited for %.1f s (%.1f s "
                 "from the first recorded%s)", what, kernels, pool.workers, recording_s, waited, pool.seconds, slowest)

    def _capture(self, runner, num_steps: int, finish, compile_pool: CompilePool | None, reraise: bool) -> None:
        graphs = self._graphs
        # Kernels are compiled by group before a group's first capture: the keys serving waits for (the
        # first action waits for their kernels only), then each batch size's.
        groups = {"serving": [k for k in graphs.plan if graphs.serves(k)]}
        for k in graphs.plan:
            groups.setdefault(f"batch {k.batch}", []).append(k)
        # The group captured after serving's (the largest batch size's: a fleet's call) is recorded right after
        # serving's and its kernels queue behind theirs, so that they compile on the workers serving's leave idle
        # (the slowest kernel bounds a group) instead of after serving began, while a fleet's batches ran as
        # batch-1 calls (run 237: 1.6 s on an H100).
        after_serving = next((f"batch {k.batch}" for k in graphs.plan if not graphs.serves(k)), None)
        recorders: dict[str, tuple[KernelRecorder, float]] = {}  # by group: its recorder, recorded in seconds
        compiled: set[str] = set()
        try:
            with tqdm(total=len(graphs.plan), desc="capturing CUDA graphs", unit="graph",
                      disable=not self.progress) as bar, compile_pool or contextlib.nullcontext(), _switching_often():
                self._start_serving_if_ready()
                while graphs.error is None and graphs.next_key() is not None:
                    key = graphs.next_key()  # chosen at the last moment: a call may have asked for one
                    group = "serving" if graphs.serves(key) else f"batch {key.batch}"
                    if compile_pool is not None and group not in compiled:
                        compiled.add(group)
                        if group not in recorders:
                            recorders[group] = self._record(runner, groups[group], num_steps, compile_pool)
                        if group == "serving" and after_serving is not None:
                            recorders[after_serving] = self._record(runner, groups[after_serving], num_steps,
                                                                    compile_pool)
                        self._compile(*recorders.pop(group), group, compile_pool)
                    bar.set_postfix_str(str(key), refresh=False)
                    graphs.captured(key, *runner.capture(key, num_steps))
                    bar.update()
                    self._start_serving_if_ready()
                self._weights.wait()  # every graph captured before the weights arrived: the plan ends with them
                if graphs.error is not None:  # the load failed (weights_failed)
                    return
                self._start_serving_if_ready()
            finish()
        except Exception as e:
            graphs.failed(f"{type(e).__name__}: {e}")
            self.state = "failed"
            self._settled.set()
            log.exception("CUDA graph capture failed after %d of %d graphs (%s); %s", len(graphs.done),
                          len(graphs.plan), graphs.error,
                          "batches run on the graphs captured before it" if self.serving.is_set()
                          else "no batch can run: restart the server, or serve with --no-fast-path")
            if reraise:
                raise
            return
        graphs.all_captured_after_s = time.perf_counter() - graphs.started
        self.state = "ready"
        edited = getattr(runner, "memset_nodes", None)  # (the fast path's runner only)
        log.info("fast path: every CUDA graph captured after %.1f s (%.1f s of warm-up runs, %.1f s of captures%s; "
                 "%d warm-ups skipped: their kernels were loaded)", graphs.all_captured_after_s, graphs.warmup_s,
                 graphs.capture_s, f", {edited['edit_s']:.1f} s of it making {edited['replaced']} memset nodes "
                 f"fill kernels" if edited and edited["enabled"] else "", getattr(runner, "warm_ups_skipped", 0))

    def weights_loaded(self) -> None:
        """The weights are in place (Runtime(weights_pending=True)): what the runner derived from them before
        is computed again, the device finishes every write, and serving starts if its graphs are captured."""
        refresh = getattr(self.runner, "refresh_weights", None)
        if refresh is not None:
            refresh()
        finish_queued(self.device)  # (graphs may be recording on another thread: no device-wide wait)
        self._weights.set()
        self._start_serving_if_ready()

    def weights_failed(self, error: BaseException) -> None:
        """The load of a Runtime(weights_pending=True) failed: the captures stop, nothing is served, and
        requests get NotServing naming the error."""
        self._graphs.failed(f"the weights did not load: {type(error).__name__}: {error}")
        self.state = "failed"
        self._settled.set()
        self._weights.set()  # (a capture thread waiting for them ends)

    def _start_serving_if_ready(self) -> None:
        with self._serving_lock:
            if (not self.serving.is_set() and self.state == "warming_up" and self._weights.is_set()
                    and self._graphs.can_serve()):
                self._start_serving()

    def _start_serving(self) -> None:
        graphs = self._graphs
        graphs.serving_after_s = time.perf_counter() - graphs.started
        self.state = "capturing"
        self.serving.set()
        self._settled.set()
        log.info("serving after %.1f s: batch %s's first CUDA graphs are captured; %d more in the background",
                 graphs.serving_after_s, min((k.batch for k in graphs.plan), default=1),
                 len(graphs.plan) - len(graphs.done))

    def _await_graphs(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool) -> None:
        """While the plan is captured: a call whose shape has no graph yet at the plan's first batch
        size (its prompt length, camera layout or RTC not captured yet) asks for those graphs next
        and waits for them, at most SERVING_WAIT_S, so it never runs uncaptured. A shape the plan
        lacks (another step count) runs as it always does."""
        graphs = self._graphs
        if num_steps != graphs.num_steps:
            return
        first = graphs.plan[0].batch
        needed = [k for k in (GraphKey(first, token_len, vision_slots), GraphKey(first, token_len, rtc=rtc))
                  if k in graphs.planned]
        if not graphs.wait_for(needed, self.SERVING_WAIT_S):
            raise NotServing(f"the CUDA graphs for {', '.join(map(str, needed))} are still being captured after "
                             f"{self.SERVING_WAIT_S:.0f} s of waiting ({len(graphs.done)} of {len(graphs.plan)} captured)")

    def _wait_until_serving(self) -> None:
        graphs = self._graphs
        if not self._settled.wait(self.SERVING_WAIT_S):
            raise NotServing(f"the fast path's batch-1 CUDA graphs are still being captured after "
                             f"{self.SERVING_WAIT_S:.0f} s of waiting ({len(graphs.done)} of {len(graphs.plan)} captured)")
        if not self.serving.is_set():
            raise NotServing(f"the fast path failed to warm up ({graphs.error}); see the server log")

    def launch(self, inputs: ModelInputs, noise: torch.Tensor, num_steps: int, rtc: RTCGuidance | None,
               use_cache: list[bool] | None = None, graphs: bool = True) -> "Launched":
        """Enqueues a host batch and returns without waiting for the device: no call here blocks on
        work already running (inputs go up from host memory without a stream sync, the actions come
        back into pinned memory, and an event marks when they are there; the runner moves the inputs
        itself, RTC guidance too: the fast path straight into its static buffers). `use_cache`: per item,
        whether it may use the prefix cache (default all); `graphs=False`: no graph replay."""
        cache = self.prefix_cache
        if use_cache is not None and not any(use_cache):
            cache = None
        keys = None if cache is None else [
            cache.key(inputs.images[i], inputs.image_masks[i], inputs.tokens[i], inputs.token_mask[i],
                      [(slot, frame) for item, slot, frame in inputs.pending if item == i])
            if use_cache is None or use_cache[i] else None
            for i in range(len(inputs.tokens))]
        vision_slots = inputs.vision_slots()  # on the host: no device round trip in `sample`
        if not self.serving.is_set():
            self._wait_until_serving()  # outside the lock: a warm-up takes it
        if self.state == "capturing":
            self._await_graphs(inputs.tokens.shape[1], vision_slots, num_steps, rtc is not None)
        with self.turns.serving():
            runner = self.runner
            entries, hit = cache.fetch(keys) if cache is not None else (None, False)
            actions, stages = runner.launch(inputs, noise, num_steps, rtc, entries if hit else None, vision_slots,
                                            graphs=graphs)
            if cache is not None and not hit:
                for i, (key, entry) in enumerate(zip(keys, entries)):
                    if entry is None and key is not None:
                        cache.put(key, runner.prefix_entry(i))  # device copies, ordered before the next launch
            return Launched.enqueue(actions, stages, self.turns)

    def launches_quickly(self, num_steps: int, graphs: bool) -> bool:
        """Whether a launch of this step count returns at once, its work replayed from captured graphs:
        every graph captured ("ready": no capture to wait for or to make room for), the captured step
        count, graphs asked for, and no layer streamed from the host (the offload profile's prefix runs
        outside graphs). The eager model computes inside `launch`: never quick."""
        return (self.fast_path and self.state == "ready" and graphs and self.offload is None
                and num_steps == self._graphs.num_steps)

    def limit_host_threads(self) -> None:
        """For a server on a GPU: torch's host ops on one thread each. They are small (a request's
        images, tokens, noise), and run on several threads at once (workers, the batcher's); with
        the intra-op pool each is a parallel region whose barrier waits for all its team's threads,
        and on a host with a thread spinning on the GPU a 1 ms prepare then stalled ~25 ms (runs
        36-37). On a CPU device the pool stays: it runs the model."""
        if self.device.type == "cuda" and torch.get_num_threads() != 1:
            log.info("torch host ops on 1 thread (was %d): the model runs on the GPU", torch.get_num_threads())
            torch.set_num_threads(1)

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        # The turns read a flag, not this object: a callback into the Runtime made a reference cycle,
        # so a dropped Runtime lived on until the garbage collector freed it, and that could happen
        # during another Runtime's graph capture, whose cudaFree of the old graphs broke it (H200).
        self._state = state
        self.turns.capturing = state in ("warming_up", "capturing")

    def stats(self) -> dict:
        runner = self.runner
        return {"state": self.state, "fast_path": self.fast_path,
                "graph_captures": getattr(runner, "captures", 0), "uncaptured_calls": getattr(runner, "uncaptured_calls", 0),
                "padded_calls": getattr(runner, "padded_calls", 0), "split_calls": getattr(runner, "split_calls", 0),
                "request_path_captures": getattr(runner, "request_path_captures", 0),
                "graph_batches": list(self.settings.graph_sizes) if self.fast_path else [],
                "graph_bytes": self.graph_bytes,
                "graphs": {**self._graphs.stats(), "warm_ups_skipped": getattr(runner, "warm_ups_skipped", 0),
                           "memset_nodes": dict(getattr(runner, "memset_nodes", {})) or None},
                "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats()}


class _GraphProgress:
    """Where a capture plan stands, for stats()["graphs"] (seconds since the warm-up began), and
    which graph comes next: the plan's order, but a graph a waiting call needs first."""

    def __init__(self, plan: list[GraphKey], num_steps: int = 0):
        self.plan, self.num_steps = plan, num_steps
        self.planned = set(plan)
        self.timed: list[tuple[str, float, float]] = []  # (shape, warm-up s, capture s), in order
        self.started = time.perf_counter()
        self.serving_after_s: float | None = None
        self.all_captured_after_s: float | None = None
        self.error: str | None = None
        self.kernels_compiled = 0  # compiled ahead (a cold compile cache), and the seconds recording and waiting took
        self.compile_s = 0.0
        self._captured: set[GraphKey] = set()
        self._wanted: list[GraphKey] = []
        self._changed = threading.Condition()
        # Serving starts once the first batch size can run its first prompt length and camera
        # layout without RTC (the plan lists that prefix and its Euler steps first; the offload
        # profile's plan has no prefix graphs): the most common call. Others wait for theirs.
        first = [k for k in plan if k.batch == plan[0].batch] if plan else []
        self._serve_keys = {next(k for k in first if k.is_prefix == prefix)
                            for prefix in (True, False) if any(k.is_prefix == prefix for k in first)}
        if not plan:  # nothing to capture (the eager model): serving, and all captured, at once
            self.serving_after_s = self.all_captured_after_s = 0.0

    @property
    def done(self) -> list[str]:
        return [shape for shape, _, _ in self.timed]

    @property
    def warmup_s(self) -> float:
        return sum(w for _, w, _ in self.timed)

    @property
    def capture_s(self) -> float:
        return sum(c for _, _, c in self.timed)

    def can_serve(self) -> bool:
        return self._serve_keys <= self._captured

    def serves(self, key: GraphKey) -> bool:
        """Whether serving waits for `key`'s graph."""
        return key in self._serve_keys

    def next_key(self) -> GraphKey | None:
        """The next graph to capture: the first one a waiting call asked for, else the plan's next."""
        with self._changed:
            return next((k for k in (*self._wanted, *self.plan) if k not in self._captured), None)

    def wait_for(self, keys: list[GraphKey], timeout: float) -> bool:
        """Asks for `keys` next and waits until they are captured (or the capture failed) -> False
        after `timeout`."""
        with self._changed:
            missing = [k for k in keys if k not in self._captured]
            if not missing:
                return True
            self._wanted += [k for k in missing if k not in self._wanted]
            return self._changed.wait_for(
                lambda: self.error is not None or all(k in self._captured for k in missing), timeout)

    def failed(self, error: str) -> None:
        with self._changed:
            self.error = error
            self._changed.notify_all()

    def compiled(self, kernels: int, seconds: float) -> None:
        self.kernels_compiled += kernels
        self.compile_s += seconds

    def captured(self, key: GraphKey, warmup_s: float, capture_s: float) -> None:
        with self._changed:
            self.timed.append((str(key), warmup_s, capture_s))
            self._captured.add(key)
            self._changed.notify_all()

    def stats(self) -> dict:
        timed = list(self.timed)
        done = [shape for shape, _, _ in timed]
        return {"captured": len(done), "total": len(self.plan), "pending": len(self.plan) - len(done),
                "captured_shapes": done, "pending_shapes": [str(k) for k in self.plan if k not in self._captured],
                "serving_after_s": self.serving_after_s, "all_captured_after_s": self.all_captured_after_s,
                "warmup_s": sum(w for _, w, _ in timed), "capture_s": sum(c for _, _, c in timed),
                "kernels_compiled_ahead": self.kernels_compiled, "compile_ahead_s": self.compile_s,
                "per_graph": [{"shape": shape, "warmup_s": round(w, 4), "capture_s": round(c, 4)}
                              for shape, w, c in timed],
                "error": self.error}
