"""Compiling a call's Triton kernels in worker processes, all at once, before its warm-up runs.

A warm-up compiles each kernel the first time it launches, one after another: with an empty compile
cache batch 1's graphs waited tens of seconds for it, a fraction of a second to seconds a kernel. Here the call
runs once with Triton's `jit_cache_hook` answering "skip" for every kernel not compiled yet: nothing
of it launches, and its specialization (the argument types, alignments and constexprs its launch
would compile for, in Triton's own serialized form) is recorded. Worker processes compile each
one with `JITFunction.preload`, exactly as the launch would have, into the compile cache (the
same key), from the moment it is recorded (`CompilePool.recorder`), and the warm-up after it loads
them from there instead of compiling.

Processes, not threads: Triton's front end is Python, so compile threads hold the interpreter lock
for much of their time, and compiles beside serving slowed every answer (less so from worker
processes; at the lowest CPU priority the compiles themselves took much longer). A worker never
touches the GPU: it compiles for the parent's target, which a stand-in driver reports
to Triton.

The hook is process-wide; it records only on the thread inside `recording()`, and lets every other
thread's launches compile as usual (a serving thread never launches a kernel that was skipped).
The same hook also tells a graph capture whether every Triton kernel it records is loaded already
(`loaded_kernels_only`), so a capture can go first and its warm-up run only when one is not
(FastRunner.capture).

Two more costs of a process's first kernels are taken off the path here: each worker builds the host
launcher of what it compiles (`build_launcher`), and Triton's key of itself is hashed on a thread while
the weights load (`hash_triton_ahead`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

log = logging.getLogger(__name__)


def compile_workers() -> int:
    """Worker processes for compiling: the host's cores but one (serving keeps one), at most 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


@contextlib.contextmanager
def _asked_on_this_thread(answer):
    """Within it, Triton calls `answer(launch)` (its hook's keyword arguments) for each launch on this
    thread of a kernel this process has not loaded, before it compiles or loads anything; `answer`
    returning True skips the launch. Other threads' launches go on as before."""
    import triton

    owner, previous = threading.get_ident(), triton.knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        if threading.get_ident() != owner:
            return previous(*args, **kwargs) if previous is not None else None
        return answer(kwargs)

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def hash_triton_ahead() -> threading.Thread:
    """Starts Triton's cache key of itself on a thread: a hash of its compiler's sources and of its
    ~500 MB library, which a process computes once (functools.lru_cache) the first time it looks a
    kernel up in the compile cache. That was the first warm-up's, on the way to the first action:
    about half a second of the capture thread. Started before the weights
    load, it is done long before: reading and hashing the library release the interpreter lock."""
    def run():
        try:
            from triton.runtime.cache import triton_key

            triton_key()
        except Exception as e:  # noqa: BLE001 - the first kernel lookup then hashes it, as without this
            log.info("Triton's cache key not computed ahead (%s: %s); the first warm-up computes it",
                     type(e).__name__, e)

    thread = threading.Thread(target=run, name="vlaserve-triton-key", daemon=True)
    thread.start()
    return thread


class KernelRecorder:
    """Specializations of the kernels launched on this thread that were not compiled yet:
    {specialization data (JSON, Triton's format): (the kernel's module, its name)}. `on_record(data,
    module, name)`, if given, is called for each one as it is first recorded. A pool's recorder
    (`CompilePool.recorder`) also holds the compile jobs its kernels were given to, and when the first was."""

    def __init__(self, on_record=None):
        self.recorded: dict[str, tuple[str, str]] = {}
        self.jobs: dict[str, Future] = {}
        self.started: float | None = None
        self._on_record = on_record

    @contextlib.contextmanager
    def recording(self):
        """Within it, on this thread, a launch of a kernel not compiled yet is recorded and skipped
        (launches nothing); compiled kernels launch as usual."""
        def record(launch) -> bool:
            kernel = launch["fn"].jit_function.fn
            data = launch["compile"]["specialization_data"]
            if data not in self.recorded:
                self.recorded[data] = (kernel.__module__, kernel.__qualname__)
                if self._on_record is not None:
                    self._on_record(data, *self.recorded[data])
            return True  # skip: compile nothing, launch nothing

        with _asked_on_this_thread(record):
            yield self


class KernelNotLoaded(Exception):
    """A launch inside `loaded_kernels_only` met a Triton kernel this process has not loaded."""


@contextlib.contextmanager
def loaded_kernels_only():
    """Within it, on this thread, a launch of a Triton kernel that this process has not loaded (not
    launched before: compiled or in the compile cache makes no difference) raises KernelNotLoaded
    before anything is compiled, loaded or launched."""
    def refuse(launch) -> bool:
        raise KernelNotLoaded(launch["fn"].jit_function.fn.__qualname__)

    with _asked_on_this_thread(refuse):
        yield


class CompilePool:
    """Worker processes compiling recorded specializations into the compile cache (the parent's
    TRITON_CACHE_DIR, inherited) for `target` (default: this process's GPU's Triton target)."""

    def __init__(self, workers: int, target=None):
        if target is None:
            from triton.runtime import driver

            target = driver.active.get_current_target()
        self.workers = workers
        # The last compile: its seconds from the first job submitted to the last done, and its slowest
        # kernel, (its name, seconds in its worker): with many workers the slowest bounds the compile.
        self.seconds, self.slowest = 0.0, None
        # Every job given to the workers, by specialization: one recorded by two recorders compiles once,
        # and counts once, in the first compile that waits for it.
        self._jobs: dict[str, Future] = {}
        self._counted: set[str] = set()
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker,
                                         initargs=((target.backend, target.arch, target.warp_size),))
        for _ in range(workers):  # start them now: their imports overlap the recording
            self._pool.submit(int)

    def recorder(self) -> KernelRecorder:
        """A recorder whose kernels go to the workers as they are recorded, so that their compiles
        overlap the rest of the recording (the calls' Python, and the libraries' first work on the
        device), and queue behind every kernel recorded before them: `compile` then waits for its own."""
        recorder = KernelRecorder(on_record=lambda data, module, name: self._submit(recorder, data, module, name))
        return recorder

    def _submit(self, recorder: KernelRecorder, data: str, module: str, name: str) -> None:
        if recorder.started is None:
            recorder.started = time.perf_counter()
        try:
            recorder.jobs[data] = self._job(data, module, name)
        except BrokenProcessPool:  # compile() submits it again, and says the workers are gone
            pass

    def _job(self, data: str, module: str, name: str) -> Future:
        if data not in self._jobs:
            self._jobs[data] = self._pool.submit(_compile, module, name, data)
        return self._jobs[data]

    def compile(self, recorder: KernelRecorder) -> int:
        """Compiles what `recorder` holds (what the workers were given as it was recorded, and the rest),
        in parallel, and waits -> how many compiled (the record is emptied). A kernel that fails here is
        left to its warm-up, which compiles it again and raises as the launch would (logged here once)."""
        recorded, recorder.recorded = recorder.recorded, {}
        started = recorder.started or time.perf_counter()
        recorder.jobs, recorder.started = {}, None
        try:  # (each one given to the workers as recorded is in the pool's table: _job finds it)
            jobs = [self._job(data, module, name) for data, (module, name) in recorded.items()]
        except BrokenProcessPool as e:  # a worker died (or none could start): the warm-ups compile
            log.warning("the compile workers are gone (%s); kernels compile as their warm-ups launch them", e)
            return 0
        errors = [job.exception() for job in jobs]  # waits for each
        self.seconds = time.perf_counter() - started
        failed = [e for e in errors if e is not None]
        if failed:
            log.warning("%d of %d kernels did not compile in the worker processes (%s: %s); their warm-up "
                        "compiles them", len(failed), len(jobs), type(failed[0]).__name__, failed[0])
        # a compiled kernel's job returns its seconds and why its launcher was not built (None: built, or none to build)
        done = [(name, job.result()) for job, e, (_, name) in zip(jobs, errors, recorded.values()) if e is None]
        self.slowest = max(((name, seconds) for name, (seconds, _) in done), key=lambda x: x[1], default=None)
        unbuilt = [problem for _, (_, problem) in done if problem is not None]
        if unbuilt:
            log.warning("%d kernels' launchers were not built in the worker processes (%s); their first launch "
                        "builds them", len(unbuilt), unbuilt[0])
        new = {data for data, e in zip(recorded, errors) if e is None} - self._counted
        self._counted |= new
        return len(new)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TargetDriver:
    """What Triton asks its driver while compiling, answered for the parent's GPU, none here."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _start_worker(target: tuple) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_TargetDriver(GPUTarget(*target)))
    # The kernels' device code (Triton, no torch: fast/kernel_code.py), imported as the worker starts,
    # which is while the parent records what to compile (CompilePool starts them), not by its first job.
    importlib.import_module(f"{__package__}.kernel_code")


def _compile(module: str, name: str, specialization_data: str) -> tuple[float, str | None]:
    """Compiles one recorded specialization, and its launcher -> (seconds, why the launcher was not
    built or None)."""
    started = time.perf_counter()
    kernel = importlib.import_module(module)
    for part in name.split("."):
        kernel = getattr(kernel, part)
    compiled = kernel.preload(specialization_data)
    problem = None
    try:
        build_launcher(compiled)
    except Exception as e:  # noqa: BLE001 - the parent's first launch then builds it, as without this
        problem = f"{type(e).__name__}: {e}"
    return time.perf_counter() - started, problem


def build_launcher(compiled) -> None:
    """Builds a compiled kernel's host launcher into the compile cache, where the parent's first launch
    of it finds it. Triton 3.6 generates a C launcher for each kernel signature and compiles it with the
    host's C compiler (~0.3 s) at that first launch: with an empty cache batch 1's warm-ups built about
    ten, seconds on the way to the first action. Later Triton versions launch every kernel
    through one prebuilt launcher and have none to build. Needs no GPU: the launcher only links
    against the CUDA driver library."""
    from triton.backends.nvidia import driver as nvidia

    if hasattr(nvidia, "make_launcher"):
        nvidia.CudaLauncher(compiled.src, compiled.metadata)
