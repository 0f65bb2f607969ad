"""The fast path's kernels compiled while the weights load, on a first start (an empty compile cache).

What Triton compiles for a launch depends on the launch's specialization only: the arguments'
dtypes, the constexprs and launch options, which pointers are 16-byte aligned and which integers are
divisible by 16 or equal to 1, never on the values. All of that follows from the model's shapes and
dtypes and from how its tensors are laid out, so a copy of the model on the meta device (no storage:
a meta tensor's address is its offset, and the allocator's blocks are 512-byte aligned, so a view
falls in the same alignment class on both) makes the launches the loaded model will make. A compile
worker per batch size runs its warm-up calls on such a copy with every launch recorded and skipped
(precompile.KernelRecorder), and the workers compile what they recorded, batch 1's first, while this
process reads the weights. Before, the recording waited for the load and batch 1's 26 kernels took
8-10 s after it (runs 185, 189).

In workers forked before this process initialized CUDA (runner.fork_compile_workers), not on a
thread here nor in spawned workers: recording every batch size is ~5 s of Python, and beside the load
on a thread it held the interpreter lock the load's copies wait for between tensors (the weights took
7.9-11.4 s instead of 0.9-1.4, H200, run 187); spawned workers record 10-15 s late, after importing
torch, and their imports slowed the load to 5.4-5.9 s (run 188).

The runtime still records each batch size with the loaded model before its first warm-up
(Runtime._precompile): what it records that was not compiled here compiles then, and the log says
so (it should never).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
from triton.runtime.jit import JITFunction

from ...config import PolicyConfig, RuntimeConfig
from ..capture import GraphKey
from . import fp8_kernels, kernels
from .graphs import FastRunner
from .launch_tables import use_launch_table
from .precompile import CompilePool, KernelRecorder
from .targets import Target

log = logging.getLogger(__name__)

Recorded = dict[str, tuple[str, str]]  # KernelRecorder.recorded: specialization data -> (module, kernel)


def record_batch(build_model: Callable[[], torch.nn.Module], config: PolicyConfig, settings: RuntimeConfig,
                 keys: list[GraphKey], num_steps: int, target: Target) -> Recorded:
    """The kernels the warm-ups of `keys` (one batch size's) launch, from `build_model()` (on the
    meta device) under `target`'s launch table. Runs in a compile worker: nothing is launched, no
    GPU is touched."""
    if loaded_in_process():
        raise RuntimeError("a fast-path kernel is loaded in this process: its launches would run, not be recorded")
    use_launch_table(target)
    runner = FastRunner(build_model(), config, use_graphs=False, gemm_library=settings.gemm_library,
                        attention_library=settings.attention_library, warmups=settings.capture_warmups)
    recorder = KernelRecorder()
    runner.record_kernels(keys, num_steps, recorder)
    return recorder.recorded


def loaded_in_process() -> bool:
    """Whether a fast-path kernel is compiled or loaded in this process: Triton launches such a
    kernel instead of asking the recording hook, so the meta copy's recording cannot run here."""
    return any(cache[0] for module in (kernels, fp8_kernels) for fn in vars(module).values()
               if isinstance(fn, JITFunction) for cache in fn.device_caches.values())


class KernelsAhead:
    """Records the kernels of `plan` in `pool`'s workers, one batch size a worker, from the model
    `build_model` returns (picklable: it runs there; on the meta device, in the dtypes the loaded
    one will have), and compiles them in all of them, batch sizes in the plan's order, each kernel
    under the first size that launches it; on a thread of its own. `target`: the fast path's GPU
    target. `wait(batch)` returns once that batch size's kernels are compiled."""

    def __init__(self, build_model: Callable[[], torch.nn.Module], config: PolicyConfig, settings: RuntimeConfig,
                 plan: list[GraphKey], num_steps: int, target: Target, pool: CompilePool):
        self.target, self.pool = target, pool
        self.batches = list(dict.fromkeys(key.batch for key in plan))
        self.compiled = 0  # kernels compiled ahead, and the seconds until the last one was
        self.seconds = 0.0
        self.error: str | None = None
        self.recorded: set[str] = set()  # the specializations recorded and sent to compile
        self._jobs: dict[int, list[Future]] = {}
        self._submitted = {batch: threading.Event() for batch in self.batches}
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._submit, args=(build_model, config, settings, plan, num_steps),
                                        name="vlaserve-kernels-ahead", daemon=True)
        self._thread.start()

    def _submit(self, build_model, config, settings, plan, num_steps) -> None:
        try:
            records = {batch: self.pool.run(record_batch, build_model, config, settings,
                                            [key for key in plan if key.batch == batch], num_steps, self.target)
                       for batch in self.batches}
            for batch in self.batches:
                # nothing is compiled while recording: a later size records a smaller one's kernels again
                recorded = {data: kernel for data, kernel in records[batch].result().items()
                            if data not in self.recorded}
                self.recorded.update(recorded)
                self._jobs[batch] = self.pool.submit(recorded)
                self._submitted[batch].set()
                log.info("batch %d: %d kernels recorded on the model's meta copy %.1f s after the start; compiling "
                         "them", batch, len(recorded), time.perf_counter() - self._started)
        except Exception as e:  # the runtime's recording after the load compiles them
            self.error = f"{type(e).__name__}: {e}"
            log.warning("recording the kernels ahead of the load failed (%s); each batch size's kernels compile "
                        "after the load", self.error)
        finally:
            for submitted in self._submitted.values():
                submitted.set()

    def wait(self, batch: int) -> int:
        """Blocks until `batch`'s kernels are compiled -> how many (0: a size not in the plan, or the
        recording failed)."""
        if batch in self._submitted:
            self._submitted[batch].wait()
        compiled = self.pool.wait(self._jobs.pop(batch, []))
        self.compiled += compiled
        self.seconds = time.perf_counter() - self._started
        return compiled

    def close(self) -> None:
        """Stops the compile workers (the start failed)."""
        self.pool.close()
