"""Taking a plan's CUDA graphs into a FastRunner, one at a time, beside serving.

The runner replays (runtime/graphs.py); what it takes to get a graph — a warm-up that compiles and loads
its kernels on scratch buffers, in turn with serving (startup/turns.py), then the recording on the static
buffers — is here, with the bookkeeping that lets most captures skip their warm-up.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..runtime.fast.precompile import CompilePool, KernelNotLoaded, KernelRecorder, loaded_kernels_only
from ..runtime.graph_keys import GraphKey
from ..runtime.graphs import FastRunner
from ..runtime.transfer import BytesIn

# A warm-up runs the Euler loop for this many steps, not the call's: every step launches the same
# kernel specializations except the first and the last (Pi0.5's fused action step with and without
# the next step's input), so two steps compile and load everything the call's ten do
# (tests/test_gpu_targets.py checks it for every batch size, both families, with and without RTC)
# at a fifth of the host work.
WARMUP_STEPS = 2


class _AtOnce:
    """Device turns where nothing is served beside the plan (benchmarks, tests): every warm-up at once."""

    @staticmethod
    def warm_up():
        return contextlib.nullcontext()


class GraphCapture:
    """Captures graphs of a plan (startup/plan.py) into `runner`, taking the device for warm-ups when
    `turns` allows (startup/turns.py `DeviceTurns`; none: nothing is served meanwhile)."""

    def __init__(self, runner: FastRunner, turns=None):
        self.runner, self.turns = runner, turns if turns is not None else _AtOnce()
        self._scratch: dict[tuple, object] = {}  # warm-up buffers of the batch size being captured
        self._scratch_batch = 0
        self._warmed: set[tuple] = set()  # kernel signatures a warm-up has run (or a capture, every kernel loaded)
        self._vision_attention_warmed: set[int] = set()  # image counts SigLIP's attention ran at
        self.warm_ups_skipped = 0  # signatures captured first, every kernel loaded
        self._bytes_in_warmed = False  # the frames' conversion ran once, outside a capture

    @torch.no_grad()
    def capture(self, key: GraphKey, num_steps: int) -> tuple[float, float]:
        """Captures one graph of the plan -> seconds (warm-up, capture).

        The warm-up (where this kernel signature has not run: the prefix once per batch size and length, at
        the plan's first camera layout; the Euler steps once per batch size, length and RTC, WARMUP_STEPS of
        them) runs on scratch buffers, so a graph served meanwhile never reads half-written inputs, and takes
        the device (`turns.warm_up`), so no batch is launched while a kernel compiles or loads. The
        recording, on the static buffers, runs nothing and holds nothing (runtime/graphs.py `_Graph`): served
        batches launch meanwhile. The graph enters the runner's store once it can be replayed; its shape's
        static buffers are made before that, so serving, which reaches a shape only through a stored graph,
        never makes them at the same time.

        After the first warm-up a signature's capture goes first, and its warm-up runs only if the capture
        meets a Triton kernel this process has not loaded (the capture stops there and is dropped: nothing
        of it ran). What a warm-up does besides loading kernels (library handles, the capture stream's
        workspaces) the first one does, and it always runs."""
        runner = self.runner
        runner.plan_batch(key.batch)
        if not runner.use_graphs or (key.is_prefix and runner.fast.layer_stream is not None):
            return 0.0, 0.0  # nothing to capture: no graphs, or the offload profile's prefix
        started = time.perf_counter()
        graphs, graph_key, signature, _ = runner.call_of(key, num_steps)
        if graph_key in graphs:
            return 0.0, 0.0
        if key.is_prefix:
            self._warm_vision_attention(key.batch * key.slots)
        runs = int(signature not in self._warmed)
        graph = None
        if runs and self._captures_first():
            attempt = time.perf_counter()
            graph = self._capture_if_loaded(runner.served_call(key, num_steps))  # (a dropped attempt: warm-up time)
            self.warm_ups_skipped += graph is not None
        if runs and graph is None:
            with self.turns.warm_up():
                runner.warm_up(self._warm_up_call(key, num_steps), runs)
        self._warmed.add(signature)
        warmed = attempt if graph is not None else time.perf_counter()
        runner.add_graph(graphs, graph_key, graph if graph is not None else runner.new_graph(
            runner.served_call(key, num_steps)))
        if key.is_prefix and runner.needs_bytes_in(key.batch):
            self._add_bytes_in(key.batch, key.length, num_steps)
        return warmed - started, time.perf_counter() - warmed

    @torch.no_grad()
    def record_kernels(self, keys: list[GraphKey], num_steps: int, pool: CompilePool) -> KernelRecorder:
        """Gives `pool`'s processes the Triton kernels the warm-ups of `keys` would compile, before any of
        them runs (fast/precompile.py) -> the recorder `pool.compile` waits on. Each call not warmed up
        yet runs once on scratch buffers with those kernels recorded instead of launched (its other
        work, cuBLAS's, runs: on scratch, and never read), taking the device as a warm-up does."""
        runner = self.runner
        recorder, ran = pool.recorder(), set()  # each kernel to the workers as it is recorded
        if not runner.use_graphs:
            return recorder
        for key in keys:
            if key.is_prefix and runner.fast.layer_stream is not None:
                continue
            graphs, graph_key, signature, _ = runner.call_of(key, num_steps)
            if graph_key in graphs or signature in self._warmed or signature in ran:
                continue
            ran.add(signature)
            with self.turns.warm_up():
                call = self._warm_up_call(key, num_steps)
                with recorder.recording():
                    runner.warm_up(call, 1)
        return recorder

    def release_scratch(self) -> None:
        """Frees the warm-up buffers (once the plan is done)."""
        self._scratch, self._scratch_batch = {}, 0

    def _add_bytes_in(self, b: int, length: int, num_steps: int) -> None:
        """Batch size b's `BytesIn`; the first one's conversion runs once before, on scratch buffers, to load
        torch's kernels outside a capture (every batch size launches the same three: one dtype, one layout)."""
        if not self._bytes_in_warmed:
            scratch = self._scratch_of(b, length, num_steps)[0]
            with self.turns.warm_up():
                self.runner.warm_up(BytesIn.conversion(scratch), 1)
            self._bytes_in_warmed = True
        self.runner.add_bytes_in(b, length)

    def _captures_first(self) -> bool:
        """Whether a capture may go before its warm-up: once a warm-up has run, and only with Triton's and
        cuBLAS's kernels, or the invariant ones (Triton's too; a CuTe library compiles per shape, unseen by Triton)."""
        runner = self.runner
        return (bool(self._warmed) and runner.gemm_library in ("cublas", "invariant")
                and runner.attention_library in ("triton", "invariant"))

    def _capture_if_loaded(self, fn):
        """The graph of `fn`, or None if it launches a Triton kernel not loaded in this process yet
        (the capture stops at that launch and is dropped: a captured graph runs nothing until it is
        replayed, so nothing was written)."""
        try:
            with loaded_kernels_only():
                return self.runner.new_graph(fn)
        except KernelNotLoaded:
            return None

    def _warm_vision_attention(self, images: int) -> None:
        """SigLIP's attention at this image count, once, before the first capture that calls it. A
        camera layout's prefix warms up at the plan's first layout only (the same kernels), but torch's
        scaled_dot_product_attention, meeting a shape inside a capture with no eager call at it
        before, is slow there (milliseconds a call, 27 calls a prefix, at every prompt length)."""
        if images not in self._vision_attention_warmed:
            with self.turns.warm_up():
                self.runner.warm_up(lambda: self.runner.fast.warm_vision_attention(images), 1)
            self._vision_attention_warmed.add(images)

    def _warm_up_call(self, key: GraphKey, num_steps: int):
        """The call a warm-up of `key` runs: on scratch buffers, with WARMUP_STEPS Euler steps."""
        steps = min(num_steps, WARMUP_STEPS)
        return self.runner.call_of(key, steps)[3](*self._scratch_of(key.batch, key.length, steps))

    def _scratch_of(self, b: int, length: int, num_steps: int):
        """The warm-up buffers of batch size b (the previous size's go): (buffers, rtc buffers)."""
        if self._scratch_batch != b:
            self._scratch, self._scratch_batch = {}, b
        runner = self.runner
        with torch.cuda.stream(runner.capture_stream):  # allocated where they are used
            return (runner.buffer_set(self._scratch, b, length),
                    runner.rtc_buffers(b, length, num_steps, self._scratch))
