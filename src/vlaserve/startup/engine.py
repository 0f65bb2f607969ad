"""Start-up: an object that drives a Runtime from nothing to serving on the CUDA fast path, and is dropped.

It builds the fast runner, plans its CUDA graphs (startup/plan.py), compiles their kernels ahead where
the compile cache is empty (runtime/fast/precompile.py), captures them one at a time beside serving
(startup/capture.py, warm-ups in turn with serving: startup/turns.py), and meanwhile holds the
runtime's gate: a call waits for what it needs, then takes the device lock. `runtime.state` moves:
"warming_up" (nothing can run yet) -> "capturing" (batch 1's first prefix and Euler-steps graphs are
captured: `serving` is set and batches run, on the captured sizes, while the rest are captured; a call
of a batch-1 shape not captured yet has its graphs captured next and waits for them) -> "ready" (all
captured: the gate opens, and start-up is gone); or -> "failed" (a capture raised: logged, named in
stats()["graphs"]["error"]; batches keep running on the graphs captured before, or, if that was before
batch 1's first, are refused with NotServing). `warmup="blocking"` returns once all are captured (a
failure raises); "background" returns at once, and a batch launched before `serving` waits for it, at
most SERVING_WAIT_S.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

import torch
from tqdm.auto import tqdm

from ..config import RuntimeConfig, prompt_lengths
from ..errors import ConfigError, NotServing
from ..runtime.compile_cache import activate, is_empty
from ..runtime.device import finish_queued
from ..runtime.fast.precompile import CompilePool, KernelRecorder, compile_workers
from ..runtime.fast.targets import choose_target, target_for
from ..runtime.gate import ClosedGate
from ..runtime.graph_keys import GraphKey
from ..runtime.memory import estimate_memory
from ..runtime.runner import Runtime
from .capture import GraphCapture
from .plan import capture_plan
from .progress import CaptureProgress
from .turns import DeviceTurns

log = logging.getLogger(__name__)

# While the capture thread records graphs beside serving, the interpreter hands its lock between threads
# this often instead of every 5 ms (Python's default): each of a recording's ~1,500 kernel launches gives
# the lock up and takes it back, and behind a busy serving thread may wait up to the whole interval.
CAPTURE_SWITCH_INTERVAL_S = 0.0005


def captures_while_loading(settings: RuntimeConfig, device: torch.device) -> bool:
    """Whether the engine for `settings` on `device` may start before its weights load (weights_pending): as
    RuntimeConfig.captures_while_loading says, on a GPU the fast path serves (sm80 and newer)."""
    return (settings.captures_while_loading(device.type)
            and target_for(torch.cuda.get_device_capability(device)) is not None)


def start(runtime: Runtime, progress: bool = False, weights_pending: bool = False) -> "Startup | None":
    """Starts `runtime`'s fast path where its settings and device run it (both families) -> the start-up
    driving it (None: the eager model serves, ready at once). `progress`: a bar on stderr while graphs are
    captured. `weights_pending`: the model's parameters are on the device but not loaded yet (checkpoint.
    weights.materialize); its graphs are compiled and captured meanwhile, and serving waits for
    `weights_loaded()`."""
    settings, device = runtime.settings, runtime.device
    target = choose_target(device) if settings.runs_fast_path(device.type) else None
    if target is None:
        if weights_pending:
            raise ValueError("weights_pending needs the CUDA fast path")
        if settings.gemm_library != "cublas":
            raise ConfigError(f"gemm_library {settings.gemm_library!r} runs on the CUDA fast path only")
        if settings.attention_library != "triton":
            raise ConfigError(f"attention_library {settings.attention_library!r} runs on the CUDA fast path only")
        return None
    from ..runtime.graphs import FastRunner
    from ..runtime.fast.launch_tables import table_for

    cache = activate(settings.compile_cache, device)  # before any kernel compiles (TRITON_CACHE_DIR)
    # A cache without a single entry: every kernel is compiled, so a group's (the graphs serving waits for,
    # then each batch size's) are compiled together in worker processes before its warm-ups. With some
    # entries, a warm-up's compiles are the few the cache lacks: one by one, as they run.
    pool = CompilePool(compile_workers()) if is_empty(cache) else None
    startup = Startup(runtime, progress)
    config = runtime.config
    table = table_for(target)
    if settings.batch_invariant:  # its own backends and launches, chosen once here (RuntimeConfig checked the rest)
        gemm_library = attention_library = "invariant"
        table = table.batch_invariant_table()
    else:
        gemm_library, attention_library = settings.gemm_library, settings.attention_library
    fast = FastRunner(runtime.model, config, lock=startup.turns.lock, layer_stream=runtime.offload,
                      gemm_library=gemm_library, attention_library=attention_library, launch_table=table)
    lengths = prompt_lengths(settings.prompt_buckets, config.max_token_len)
    plan = capture_plan(settings.graph_sizes, lengths, len(config.cameras))
    if runtime.offload is not None:  # its prefix streams its layers outside graphs: the Euler steps' only
        plan = [key for key in plan if not key.is_prefix]
    # The allocator's reserved bytes, its unused cache returned first on both sides: what stays is the static
    # buffers and the graphs' private pools (free device memory also moves with other processes and with
    # what loading left cached).
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)

    def measure() -> None:
        torch.cuda.empty_cache()
        runtime.graph_bytes = torch.cuda.memory_reserved(device) - reserved_before
        shapes = {name: tuple(p.shape) for name, p in runtime.model.named_parameters()}
        estimate = estimate_memory(shapes, config, runtime.dtype, settings.profile, settings.batch_limit,
                                   graph_batches=settings.graph_batches, num_prompt_lengths=len(lengths))
        log.info("fast path: %d CUDA graphs for batch sizes %s and prompt lengths %s, %.2f GiB of device "
                 "memory (the startup check counted %.2f GiB for static buffers and graphs)", fast.captures,
                 ",".join(map(str, settings.graph_sizes)), ",".join(map(str, lengths)),
                 runtime.graph_bytes / 2**30, estimate.engine / 2**30)

    startup.begin(GraphCapture(fast, startup.turns), plan, config.num_inference_steps, settings.warmup == "background", measure, pool,
                    weights_pending)
    return startup


@contextlib.contextmanager
def _switching_often():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, CAPTURE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class Startup:
    """Captures a plan's graphs into a runtime's fast runner beside serving, holding the runtime's gate
    meanwhile (`entering`, `enqueued`, `collected`: runtime/gate.py) until every graph is captured."""

    # How long a batch launched before batch 1's graphs exist waits for them before NotServing: above any
    # warm-up seen (batch 1's kernels compile and its graphs capture in seconds; a CuTe library's compiles
    # in tens of seconds), and bounded so a stuck warm-up surfaces as errors, not as hung requests.
    SERVING_WAIT_S = 120.0

    def __init__(self, runtime: Runtime, progress: bool = False):
        self.runtime, self.progress = runtime, progress
        # Launches hold the runtime's device lock; a warm-up takes it when startup/turns.py says.
        self.turns = DeviceTurns(runtime.device_lock)
        self.graphs = CaptureProgress([])
        self._weights = threading.Event()  # set once the weights are loaded
        self._weights.set()
        self._serving_lock = threading.Lock()  # serving starts once: from the capture thread or the load's end
        self._settled = threading.Event()  # set once serving, or failed before it
        self._capture: GraphCapture | None = None

    def begin(self, capture: GraphCapture, plan: list[GraphKey], num_steps: int, background: bool, finish=lambda: None,
              compile_pool: CompilePool | None = None, weights_pending: bool = False) -> None:
        """Serves with `capture.runner` from the plan's first batch size on: captures the plan (capture.capture
        (key, num_steps) -> seconds of warm-up and of capture), sets `runtime.serving` once the first size's
        graphs are captured, and calls `finish` once all are, before "ready". `background`: the captures run
        in a thread and this returns at once; else they run here and a failure raises. `compile_pool`: before
        the first capture of a group of keys, the pool compiles their kernels together (capture.record_kernels
        (its keys, num_steps, pool) gives them to it): first the keys serving waits for, with the next group's
        kernels queued behind theirs, then each batch size's (the first size's others); the pool is closed
        once the plan ends. `weights_pending` (background only): the plan is compiled and captured meanwhile;
        serving and "ready" wait for `weights_loaded()`."""
        if weights_pending and not background:
            raise ValueError("a plan captured before the weights are loaded runs in the background")
        runtime = self.runtime
        self._capture = capture
        runner = capture.runner
        self.graphs = CaptureProgress(plan, num_steps)
        runtime.state = "warming_up"
        runtime.serving.clear()
        runtime.use(runner, gate=self, graph_stats=self.stats)
        if weights_pending:
            self._weights.clear()
        args = (capture, num_steps, finish, compile_pool)
        if not background:
            self._run(*args, reraise=True)
            return
        threading.Thread(target=self._run, args=args, kwargs={"reraise": False}, name="vlaserve-capture",
                         daemon=True).start()

    # ---- the gate, while start-up holds it ----------------------------------------------------------
    @contextlib.contextmanager
    def entering(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool):
        if not self.runtime.serving.is_set():
            self._wait_until_serving()  # outside the lock: a warm-up takes it
        if self.runtime.state == "capturing":
            self._await_graphs(token_len, vision_slots, num_steps, rtc)
        with self.turns.serving():
            yield

    def enqueued(self) -> None:
        self.turns.enqueued()

    def collected(self) -> None:
        self.turns.collected()

    # ---- the captures ----------------------------------------------------------------------------
    @staticmethod
    def _record(capture: GraphCapture, keys: list[GraphKey], num_steps: int,
                pool: CompilePool) -> tuple[KernelRecorder, float]:
        started = time.perf_counter()
        return capture.record_kernels(keys, num_steps, pool), time.perf_counter() - started

    def _compile(self, recorder: KernelRecorder, recording_s: float, what: str, pool: CompilePool) -> None:
        """Waits for `recorder`'s kernels to compile (see `begin`), recorded in `recording_s`; `what` names
        them in the log."""
        started = time.perf_counter()
        kernels = pool.compile(recorder)
        waited = time.perf_counter() - started
        self.graphs.compiled(kernels, recording_s + waited)
        # where the seconds went: the calls run to record their kernels, each kernel compiled from its recording on
        slowest = "" if pool.slowest is None else ", the slowest, %s, %.1f s in its worker" % pool.slowest
        log.info("%s: %d kernels compiled in %d worker processes, recorded in %.1f s, waited for %.1f s (%.1f s "
                 "from the first recorded%s)", what, kernels, pool.workers, recording_s, waited, pool.seconds, slowest)

    def _run(self, capture: GraphCapture, num_steps: int, finish, compile_pool: CompilePool | None, reraise: bool) -> None:
        graphs, runtime = self.graphs, self.runtime
        # Kernels are compiled by group before a group's first capture: the keys serving waits for (the
        # first action waits for their kernels only), then each batch size's.
        groups = {"serving": [k for k in graphs.plan if graphs.serves(k)]}
        for k in graphs.plan:
            groups.setdefault(f"batch {k.batch}", []).append(k)
        # The group captured after serving's (the largest batch size's: a fleet's call) is recorded right after
        # serving's and its kernels queue behind theirs, so that they compile on the workers serving's leave idle
        # (the slowest kernel bounds a group) instead of after serving began, while a fleet's batches ran as
        # batch-1 calls.
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
                            recorders[group] = self._record(capture, groups[group], num_steps, compile_pool)
                        if group == "serving" and after_serving is not None:
                            recorders[after_serving] = self._record(capture, groups[after_serving], num_steps,
                                                                    compile_pool)
                        self._compile(*recorders.pop(group), group, compile_pool)
                    bar.set_postfix_str(str(key), refresh=False)
                    graphs.captured(key, *capture.capture(key, num_steps))
                    bar.update()
                    self._start_serving_if_ready()
                self._weights.wait()  # every graph captured before the weights arrived: the plan ends with them
                if graphs.error is not None:  # the load failed (weights_failed)
                    return
                self._start_serving_if_ready()
            capture.release_scratch()
            finish()
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}")
            log.exception("CUDA graph capture failed after %d of %d graphs (%s); %s", len(graphs.done),
                          len(graphs.plan), graphs.error,
                          "batches run on the graphs captured before it" if runtime.serving.is_set()
                          else "no batch can run: restart the server, or serve with --no-fast-path")
            if reraise:
                raise
            return
        graphs.all_captured_after_s = time.perf_counter() - graphs.started
        edited = capture.runner.memset_nodes
        log.info("fast path: every CUDA graph captured after %.1f s (%.1f s of warm-up runs, %.1f s of captures, "
                 "%.1f s of it making %d memset nodes fill kernels; %d warm-ups skipped: their kernels were loaded)",
                 graphs.all_captured_after_s, graphs.warmup_s, graphs.capture_s, edited["edit_s"], edited["replaced"],
                 capture.warm_ups_skipped)
        runtime.state = "ready"
        runtime.open_gate(self.stats())  # start-up is done: enqueues take the plain device lock from here on

    def _fail(self, error: str) -> None:
        """A capture or the weights' load failed: batches run on the graphs captured so far, or, before serving
        began, are refused, naming the error."""
        runtime = self.runtime
        self.graphs.failed(error)
        runtime.state = "failed"
        self._settled.set()
        if runtime.serving.is_set():
            runtime.open_gate(self.stats())
        else:
            stats = self.stats()  # (final: nothing is captured any more)
            runtime.use(runtime.runner, gate=ClosedGate(f"the fast path failed to warm up ({error}); see the server "
                                                        f"log"), graph_stats=lambda: stats)

    def weights_loaded(self) -> None:
        """The weights are in place (captured with weights_pending): what the runner derived from them before
        is computed again, the device finishes every write, and serving starts if its graphs are captured."""
        self._capture.runner.refresh_weights()
        finish_queued(self.runtime.device)  # (graphs may be recording on another thread: no device-wide wait)
        self._weights.set()
        self._start_serving_if_ready()

    def weights_failed(self, error: BaseException) -> None:
        """The load of weights_pending's weights failed: the captures stop, nothing is served, and requests
        get NotServing naming the error."""
        self._fail(f"the weights did not load: {type(error).__name__}: {error}")
        self._weights.set()  # (a capture thread waiting for them ends)

    def _start_serving_if_ready(self) -> None:
        with self._serving_lock:
            runtime = self.runtime
            if (not runtime.serving.is_set() and runtime.state == "warming_up" and self._weights.is_set()
                    and self.graphs.can_serve()):
                graphs = self.graphs
                graphs.serving_after_s = time.perf_counter() - graphs.started
                runtime.state = "capturing"
                runtime.serving.set()
                self._settled.set()
                log.info("serving after %.1f s: batch %s's first CUDA graphs are captured; %d more in the background",
                         graphs.serving_after_s, min((k.batch for k in graphs.plan), default=1),
                         len(graphs.plan) - len(graphs.done))

    def _await_graphs(self, token_len: int, vision_slots: int, num_steps: int, rtc: bool) -> None:
        """While the plan is captured: a call whose shape has no graph yet at the plan's first batch size (its
        prompt length, camera layout or RTC not captured yet) asks for those graphs next and waits for them,
        at most SERVING_WAIT_S, so it never runs uncaptured. A shape the plan lacks (another step count) runs
        as it always does."""
        graphs = self.graphs
        if num_steps != graphs.num_steps:
            return
        first = graphs.plan[0].batch
        needed = [k for k in (GraphKey(first, token_len, vision_slots), GraphKey(first, token_len, rtc=rtc))
                  if k in graphs.planned]
        if not graphs.wait_for(needed, self.SERVING_WAIT_S):
            raise NotServing(f"the CUDA graphs for {', '.join(map(str, needed))} are still being captured after "
                             f"{self.SERVING_WAIT_S:.0f} s of waiting ({len(graphs.done)} of {len(graphs.plan)} captured)")

    def _wait_until_serving(self) -> None:
        graphs = self.graphs
        if not self._settled.wait(self.SERVING_WAIT_S):
            raise NotServing(f"the fast path's batch-1 CUDA graphs are still being captured after "
                             f"{self.SERVING_WAIT_S:.0f} s of waiting ({len(graphs.done)} of {len(graphs.plan)} captured)")
        if not self.runtime.serving.is_set():
            raise NotServing(f"the fast path failed to warm up ({graphs.error}); see the server log")

    def stats(self) -> dict:
        capture = self._capture
        return {**self.graphs.stats(), "warm_ups_skipped": capture.warm_ups_skipped,
                "memset_nodes": dict(capture.runner.memset_nodes)}
