"""Compiling a call's Triton kernels on threads, all at once, before its warm-up runs.

A warm-up compiles each kernel the first time it launches, one after another: with an empty compile
cache batch 1's graphs waited ~20 s for it on an H200 (run 159), 0.3-1.5 s a kernel. Here the call
runs once with Triton's `jit_cache_hook` answering "skip" for every kernel not compiled yet: nothing
of it launches, and its specialization (the argument types, alignments and constexprs its launch
would compile for) is recorded. Then `JITFunction.preload` compiles each recorded specialization on
a thread pool, exactly as the launch would have (the same cache key: the kernel lands in Triton's
in-process cache and in the compile cache), and the warm-up after it finds every kernel compiled.
Triton's compiler spends its time in MLIR, LLVM and ptxas with the GIL released: on the 2-core CPU
12 kernels compiled for sm_90 in 5.5 s on one thread and 2.7 s on two.

The hook is process-wide; it records only on the thread inside `recording()`, and lets every other
thread's launches compile as usual (a serving thread never launches a kernel that was skipped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)


def compile_threads() -> int:
    """Threads for compiling: the host's cores but one (serving's host work keeps one)."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


class KernelRecorder:
    """Specializations of the kernels launched on this thread that were not compiled yet:
    {specialization data (JSON, Triton's format): its JITFunction}."""

    def __init__(self):
        self.recorded: dict[str, object] = {}

    @contextlib.contextmanager
    def recording(self):
        """Within it, on this thread, a launch of a kernel not compiled yet is recorded and skipped
        (launches nothing); compiled kernels launch as usual."""
        import triton

        owner, previous = threading.get_ident(), triton.knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            if threading.get_ident() != owner:
                return previous(*args, **kwargs) if previous is not None else None
            self.recorded[kwargs["compile"]["specialization_data"]] = kwargs["fn"].jit_function
            return True  # skip: compile nothing, launch nothing

        triton.knobs.runtime.jit_cache_hook = hook
        try:
            yield self
        finally:
            triton.knobs.runtime.jit_cache_hook = previous

    def compile(self, threads: int) -> int:
        """Compiles every recorded specialization on `threads` threads (the first failure raises,
        as the launch would have) -> how many; the record is emptied."""
        recorded, self.recorded = self.recorded, {}
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vlaserve-compile") as pool:
            for done in [pool.submit(kernel.preload, data) for data, kernel in recorded.items()]:
                done.result()
        return len(recorded)
