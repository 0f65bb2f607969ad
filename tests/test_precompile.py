"""Compiling kernels together before a warm-up (vlaserve.runtime.fast.precompile) and where the
runtime does it: once per batch size, before that size's first capture, only with an empty cache.

Triton compiles for sm_90 here with its bundled ptxas; a stand-in driver answers Triton's device
questions (device 0, an sm_90 target), so a launch specializes and compiles as on an H200 but runs
nothing (every call below is recorded, or a warm-up, which launches nothing). The worker processes
answer them the same way (precompile's own stand-in, for the target the parent passes)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

from vlaserve.runtime import compile_cache
from vlaserve.startup.plan import capture_plan
from vlaserve.runtime.graphs import FastRunner
from vlaserve.startup.capture import GraphCapture
from vlaserve.runtime.fast.kernels import launch_options
from vlaserve.runtime.fast.precompile import (CompilePool, KernelNotLoaded, KernelRecorder, compile_workers,
                                              build_launcher, hash_triton_ahead, loaded_kernels_only)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Sm90:
    """Triton's driver questions, answered for one sm_90 device with no GPU behind it."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


OPTIONS = launch_options()  # as the runtime launches its kernels (FP fusion pinned)


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def _broken(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), undefined_name)  # noqa: F821 (a compile error, on purpose)


@pytest.fixture
def sm90(monkeypatch, tmp_path):
    """The stand-in driver, a fresh compile cache, and a count of the compiles Triton runs."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "_active", _Sm90())  # (a GPU's own driver is back after the test)
    compiles = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiles.append(kw["fn"].name))
    for kernel in (_copy, _broken):
        kernel.device_caches.clear()
    yield compiles
    for kernel in (_copy, _broken):
        kernel.device_caches.clear()


def _cached(kernel) -> int:
    kernel_cache = kernel.device_caches[0][0]
    return len(kernel_cache)


def test_a_recorded_launch_compiles_nothing_and_launches_nothing(sm90):
    x, y = torch.empty(64), torch.empty(64)
    recorder = KernelRecorder()
    with recorder.recording():
        assert _copy[(1,)](x, y, 64, BLOCK=64, **OPTIONS) is None  # skipped: no kernel object, so nothing ran
        _copy[(1,)](x, y, 64, BLOCK=128, **OPTIONS)
        _copy[(1,)](x, y, 60, BLOCK=64, **OPTIONS)  # 60: not a multiple of 16, another specialization
        _copy[(1,)](x, y, 64, BLOCK=64, **OPTIONS)  # the same specialization again: recorded once
    assert len(recorder.recorded) == 3 and sm90 == [] and _cached(_copy) == 0
    assert triton.knobs.runtime.jit_cache_hook is None  # the hook is gone with the block


def _cache_entries(directory) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_the_workers_compile_into_the_cache_and_the_warm_up_finds_them(sm90, tmp_path):
    x, y = torch.empty(64), torch.empty(64)
    recorder = KernelRecorder()
    with recorder.recording():
        for block in (16, 32, 64):
            _copy[(1,)](x, y, 64, BLOCK=block, **OPTIONS)
    assert set(recorder.recorded.values()) == {(__name__, "_copy")}
    with CompilePool(2, _Sm90().get_current_target()) as pool:
        assert pool.slowest is None
        assert pool.compile(recorder) == 3 and recorder.recorded == {}
        name, seconds = pool.slowest  # the kernel a start waited for longest, as its worker timed it
        assert name == "_copy" and 0 < seconds < pool.seconds
    compiled = _cache_entries(tmp_path)
    assert len(compiled) >= 3 and sm90 == []  # compiled by the workers, into this process's cache
    # the launches compile what the workers compiled, under the same keys: no entry is added
    for block in (16, 32, 64):
        assert _copy.warmup(x, y, 64, BLOCK=block, grid=(1,), **OPTIONS) is not None
    assert _cache_entries(tmp_path) == compiled and len(sm90) == 3


def test_a_pools_recorder_gives_each_kernel_to_the_workers_as_it_is_recorded(sm90, tmp_path):
    """So that the compiles overlap the rest of the recording; compile() then waits for them."""
    x, y = torch.empty(64), torch.empty(64)
    with CompilePool(1, _Sm90().get_current_target()) as pool:
        recorder = pool.recorder()
        with recorder.recording():
            _copy[(1,)](x, y, 64, BLOCK=16, **OPTIONS)
            _copy[(1,)](x, y, 64, BLOCK=16, **OPTIONS)  # the same specialization: given once
            (job,) = recorder.jobs.values()
            job.result()  # compiled while the recording goes on
            assert _cache_entries(tmp_path)
            _copy[(1,)](x, y, 64, BLOCK=32, **OPTIONS)
        assert pool.compile(recorder) == 2 and recorder.jobs == {}
        assert 0 < pool.slowest[1] < pool.seconds
    compiled = _cache_entries(tmp_path)
    assert sm90 == []  # nothing compiled in this process
    for block in (16, 32):  # the launches load what the workers compiled: no entry is added
        assert _copy.warmup(x, y, 64, BLOCK=block, grid=(1,), **OPTIONS) is not None
    assert _cache_entries(tmp_path) == compiled and len(sm90) == 2


def test_a_kernel_two_recorders_record_compiles_once_and_counts_once(sm90, tmp_path):
    """A group recorded ahead (the one captured after serving's: Runtime._capture) may record a kernel the
    group before it is compiling: the workers get it once, and the second compile waits for that job."""
    x, y = torch.empty(64), torch.empty(64)
    with CompilePool(1, _Sm90().get_current_target()) as pool:
        first, second = pool.recorder(), pool.recorder()
        with first.recording():
            _copy[(1,)](x, y, 64, BLOCK=16, **OPTIONS)
        with second.recording():
            _copy[(1,)](x, y, 64, BLOCK=16, **OPTIONS)  # not loaded here yet: recorded again
            _copy[(1,)](x, y, 64, BLOCK=32, **OPTIONS)
        (shared,) = first.jobs.values()
        assert len(second.jobs) == 2 and shared in second.jobs.values()
        assert pool.compile(first) == 1 and shared.done()
        assert pool.compile(second) == 1  # its own kernel: the shared one was counted by the first
    assert sm90 == [] and len(_cache_entries(tmp_path)) >= 2


def test_workers_gone_while_recording_leave_the_recording_going_and_the_compiles_to_the_warm_ups(sm90, caplog):
    with CompilePool(1, _Sm90().get_current_target()) as pool:
        assert isinstance(pool._pool.submit(os._exit, 1).exception(), BrokenProcessPool)
        recorder = pool.recorder()
        with recorder.recording():
            _copy[(1,)](torch.empty(64), torch.empty(64), 64, BLOCK=64, **OPTIONS)  # no error here
        assert len(recorder.recorded) == 1
        with caplog.at_level("WARNING"):
            assert pool.compile(recorder) == 0
    assert "the compile workers are gone" in caplog.text


def test_another_threads_launches_compile_as_usual_while_one_records(sm90):
    x, y = torch.empty(64), torch.empty(64)
    recorder, compiled = KernelRecorder(), []
    with recorder.recording():
        other = threading.Thread(target=lambda: compiled.append(_copy.warmup(x, y, 64, BLOCK=32, grid=(1,), **OPTIONS)))
        other.start()
        other.join()
        _copy[(1,)](x, y, 64, BLOCK=64, **OPTIONS)
    assert compiled[0] is not None and sm90 == ["_copy"]  # the other thread's compile ran, not skipped
    assert len(recorder.recorded) == 1


def test_a_kernel_the_workers_cannot_compile_is_left_to_its_warm_up(sm90, tmp_path, caplog):
    recorder = KernelRecorder()
    with recorder.recording():
        _broken[(1,)](torch.empty(16), BLOCK=16, **OPTIONS)
    with CompilePool(1, _Sm90().get_current_target()) as pool, caplog.at_level("WARNING"):
        assert pool.compile(recorder) == 0
    assert "1 of 1 kernels did not compile" in caplog.text and "their warm-up compiles them" in caplog.text
    with pytest.raises(Exception, match="undefined_name"):  # where the launch raises, as without workers
        _broken.warmup(torch.empty(16), BLOCK=16, grid=(1,), **OPTIONS)


def test_workers_that_are_gone_leave_the_compiles_to_the_warm_ups(sm90, caplog):
    recorder = KernelRecorder()
    with recorder.recording():
        _copy[(1,)](torch.empty(64), torch.empty(64), 64, BLOCK=64, **OPTIONS)
    with CompilePool(1, _Sm90().get_current_target()) as pool:
        assert isinstance(pool._pool.submit(os._exit, 1).exception(), BrokenProcessPool)  # a worker died
        with caplog.at_level("WARNING"):
            assert pool.compile(recorder) == 0  # no error: serving goes on
    assert "the compile workers are gone" in caplog.text
    # compiled here
    assert _copy.warmup(torch.empty(64), torch.empty(64), 64, BLOCK=64, grid=(1,), **OPTIONS) is not None


def test_a_launch_of_a_kernel_not_loaded_here_raises_before_anything_compiles(sm90):
    """`loaded_kernels_only`: what a capture that goes before its warm-up relies on. Triton's warm-up
    entry specializes and looks a kernel up exactly as a launch does, and launches nothing."""
    x, y = torch.empty(64), torch.empty(64)
    assert _copy.warmup(x, y, 64, BLOCK=64, grid=(1,), **OPTIONS) is not None  # compiled and loaded here
    with loaded_kernels_only():
        assert _copy.warmup(x, y, 64, BLOCK=64, grid=(1,), **OPTIONS) is not None  # loaded: no question asked
        with pytest.raises(KernelNotLoaded, match="_copy"):
            _copy[(1,)](x, y, 64, BLOCK=32, **OPTIONS)
        with pytest.raises(KernelNotLoaded):
            _copy[(1,)](x, y, 60, BLOCK=64, **OPTIONS)  # 60: another specialization of a loaded kernel
        other = threading.Thread(target=lambda: _copy.warmup(x, y, 64, BLOCK=16, grid=(1,), **OPTIONS))
        other.start()
        other.join()
    assert sm90 == ["_copy", "_copy"]  # BLOCK 64 before, BLOCK 16 on the other thread; nothing inside
    assert triton.knobs.runtime.jit_cache_hook is None


def test_a_capture_goes_first_where_every_kernel_is_loaded(golden_policy, sm90):
    """The real GraphCapture.capture (the CPU stand-ins of
    test_capture.py), each call also launching real Triton kernels: a warm-up runs where a capture
    meets a kernel not loaded, and only there; nothing compiles inside a capture."""
    from test_capture import SlowCapture, SlowCaptureRunner

    config = golden_policy.config
    plan = capture_plan((1, 2), (config.max_token_len,), len(config.cameras))
    # the BLOCKs (specializations of _copy) each call launches: the prefix's the same at every size
    blocks = {(True, 1, False): [16], (False, 1, False): [32], (False, 1, True): [32, 64],
              (True, 2, False): [16], (False, 2, False): [128], (False, 2, True): [128]}

    class KernelsPerCall(SlowCaptureRunner):
        """A call launches its kernels through Triton's warm-up entry: a warm-up compiles and loads
        them; a capture meets them, loaded or not."""

        key = None  # the key being captured

        def new_graph(self, fn):
            compiled = len(sm90)
            self.launch(self.key)  # a capture records the call's launches
            assert len(sm90) == compiled, "a kernel compiled inside a capture"
            return super().new_graph(fn)

        def launch(self, key):
            x = torch.empty(64)
            for block in blocks[(key.is_prefix, key.batch, key.rtc)]:
                _copy.warmup(x, x, 64, BLOCK=block, grid=(1,), **OPTIONS)

    class CaptureOfKernels(SlowCapture):
        _captures_first = GraphCapture._captures_first  # these calls launch Triton kernels

        def capture(self, key, num_steps):
            self.runner.key = key
            return super().capture(key, num_steps)

        def _warm_up_call(self, key, num_steps):
            call = super()._warm_up_call(key, num_steps)
            return lambda: (self.runner.launch(key), call())[1]

    _copy.device_caches.clear()  # nothing loaded in the "process"
    sm90.clear()
    runner = KernelsPerCall(golden_policy)
    capture = CaptureOfKernels(runner)
    for key in plan:
        warm_s, capture_s = capture.capture(key, config.num_inference_steps)
        assert warm_s >= 0 and capture_s > 0
    assert runner.captures == len(plan) and len(sm90) == 4  # each kernel compiled once
    # b1's prefix warms up first (nothing has); b1's Euler steps with and without RTC and b2's
    # without meet a new BLOCK; b2's prefix and its Euler steps with RTC launch loaded ones only (of
    # the 6 signatures, 2 skip their warm-up); the frames' conversion (torch's kernels) warms up once
    assert (runner.warm_up_runs - len(runner.attention_images), capture.warm_ups_skipped) == (5, 2)


def test_a_cute_library_warms_every_signature_up_first(golden_policy):
    def new_capture():
        return GraphCapture(FastRunner(golden_policy.model, golden_policy.config, use_graphs=False, use_triton=False))

    capture = new_capture()
    assert not capture._captures_first()  # before the first warm-up
    capture._warmed.add(("prefix", 1, 48, None))
    assert capture._captures_first()
    for library in ("gemm_library", "attention_library"):  # CuTe DSL kernels compile per shape, unseen by Triton
        quack = new_capture()
        quack._warmed.add(("prefix", 1, 48, None))
        setattr(quack.runner, library, "quack" if library == "gemm_library" else "fa4")
        assert not quack._captures_first()


def test_tritons_own_key_is_hashed_on_a_thread_before_the_first_kernel_lookup():
    """Triton hashes its sources and library (functools.lru_cache'd) at a process's first kernel lookup;
    hash_triton_ahead does it on a thread of its own, so that lookup finds it cached."""
    from triton.runtime.cache import triton_key

    triton_key.cache_clear()
    thread = hash_triton_ahead()
    assert thread.name == "vlaserve-triton-key" and thread.daemon
    thread.join(timeout=120)
    assert triton_key.cache_info().currsize == 1  # computed there, once
    assert triton_key.cache_info().misses == 1


def test_a_triton_key_that_cannot_be_hashed_ahead_is_left_to_the_first_lookup(monkeypatch, caplog):
    import triton.runtime.cache

    def moved():
        raise AttributeError("no triton_key here")

    monkeypatch.setattr(triton.runtime.cache, "triton_key", moved)
    with caplog.at_level("INFO", logger="vlaserve.runtime.fast.precompile"):
        hash_triton_ahead().join(timeout=10)
    assert "not computed ahead (AttributeError: no triton_key here)" in caplog.text


def test_a_kernels_launcher_is_built_with_it_where_triton_builds_one_per_signature(monkeypatch):
    """Triton 3.6 compiles a C launcher per kernel signature at its first launch (nvidia driver's
    make_launcher, then CudaLauncher); the workers build it beside the kernel. Triton 3.9, here,
    launches through one prebuilt launcher: nothing to build."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nvidia

    built = []
    monkeypatch.setattr(nvidia, "CudaLauncher", lambda src, metadata: built.append((src, metadata)))
    compiled = SimpleNamespace(src="the kernel's source", metadata="its metadata")
    monkeypatch.delattr(nvidia, "make_launcher", raising=False)
    build_launcher(compiled)
    assert built == []
    monkeypatch.setattr(nvidia, "make_launcher", lambda *args: "C source", raising=False)
    build_launcher(compiled)
    assert built == [("the kernel's source", "its metadata")]


def test_a_launcher_a_worker_cannot_build_is_reported_and_its_kernel_still_compiled(sm90, monkeypatch):
    """A worker's job: the kernel compiled into the cache, and why its launcher was not built (the
    parent's first launch then builds it), e.g. a host without a C compiler."""
    from triton.backends.nvidia import driver as nvidia

    from vlaserve.runtime.fast.precompile import _compile

    def no_compiler(src, metadata):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(nvidia, "make_launcher", lambda *args: "C source", raising=False)
    monkeypatch.setattr(nvidia, "CudaLauncher", no_compiler)
    x, y = torch.empty(64), torch.empty(64)
    recorder = KernelRecorder()
    with recorder.recording():
        _copy[(1,)](x, y, 64, BLOCK=16, **OPTIONS)
    (data,) = recorder.recorded
    seconds, problem = _compile(__name__, "_copy", data)
    assert problem == "RuntimeError: no C compiler" and seconds > 0
    assert sm90 == ["_copy"]  # compiled all the same


def test_workers_leave_a_core_and_stop_at_sixteen(monkeypatch):
    for cores, workers in ((1, 1), (2, 1), (16, 15), (128, 16)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert compile_workers() == workers


def test_an_empty_cache_is_one_without_a_single_entry(tmp_path):
    assert compile_cache.is_empty(tmp_path)
    (tmp_path / "a1b2").mkdir()
    assert not compile_cache.is_empty(tmp_path)


class _Recording:
    """A graph capture's stand-in (startup/capture.py) that records the order of kernel recordings and captures."""

    warm_ups_skipped = 0  # what start-up reports of it, with its runner's memset_nodes

    def __init__(self):
        self.events = []
        self.runner = SimpleNamespace(memset_nodes={"replaced": 0, "left": 0, "edit_s": 0.0})

    def release_scratch(self):
        pass

    def record_kernels(self, keys, num_steps, pool):
        self.events.append(("record", tuple(keys), pool))
        return tuple(keys)

    def capture(self, key, num_steps):
        self.events.append(("capture", key))
        return 0.0, 0.0


class _Pool:
    """A compile pool stand-in: each compile is an event of the runner's; closed once the plan ends."""

    closed, workers, seconds, slowest = False, 3, 0.0, ("_mqa_split", 1.25)

    def __init__(self, events: list):
        self.events = events

    def compile(self, recorder):
        self.events.append(("compile", recorder))
        return 7

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


@pytest.mark.parametrize("with_pool", [False, True])
def test_the_graphs_serving_waits_for_then_each_batch_size_compile_together_before_their_first_capture(
        golden_policy, with_pool, caplog):
    from vlaserve.runtime.runner import Runtime
    from vlaserve.startup.engine import Startup

    capture = _Recording()
    runtime = Runtime(golden_policy.model, golden_policy.config, golden_policy.runtime.settings,
                      torch.device("cpu"), torch.float32, "test")
    plan = capture_plan((1, 2, 4), (48, 96), 2)
    pool = _Pool(capture.events) if with_pool else None
    with caplog.at_level("INFO", logger="vlaserve.startup.engine"):
        Startup(runtime).begin(capture, plan, 10, background=False, compile_pool=pool)
    captures = [e[1] for e in capture.events if e[0] == "capture"]
    assert captures == plan
    if not with_pool:
        assert [e for e in capture.events if e[0] != "capture"] == []
        return
    # first batch 1's common call, its prefix and Euler steps (what serving waits for: the first action waits
    # for their kernels only), then each batch size's keys, each group compiled right before its first capture
    serving = (plan[0], plan[1])
    assert plan[0].batch == plan[1].batch == 1 and plan[0].is_prefix and not plan[1].is_prefix
    group = {b: tuple(k for k in plan if k.batch == b) for b in (1, 2, 4)}
    # the largest size's group (its common call follows serving's) is recorded right after serving's, so its
    # kernels queue behind serving's and compile while serving's warm up and capture
    assert capture.events[:5] == [("record", serving, pool), ("record", group[4], pool), ("compile", serving),
                                 ("capture", plan[0]), ("capture", plan[1])]
    compiles = [(i, e[1]) for i, e in enumerate(capture.events) if e[0] == "compile"]
    assert [keys for _, keys in compiles] == [serving, group[4], group[1], group[2]]
    for i, keys in compiles[1:]:  # each right before the first of its keys still to capture
        first_left = next(k for k in keys if k not in serving)
        assert capture.events[i + 1] == ("capture", first_left)
    records = [e[1] for e in capture.events if e[0] == "record"]
    assert records == [serving, group[4], group[1], group[2]]  # each group recorded once
    for keys in (group[1], group[2]):  # the later groups recorded right before their compile
        assert capture.events.index(("compile", keys)) == capture.events.index(("record", keys, pool)) + 1
    assert pool.closed
    graphs = runtime.stats()["graphs"]
    assert graphs["kernels_compiled_ahead"] == 28 and graphs["compile_ahead_s"] >= 0
    assert "serving: 7 kernels compiled in 3 worker processes, recorded in" in caplog.text
    assert "batch 1: 7 kernels compiled in 3 worker processes, recorded in" in caplog.text
    assert "s from the first recorded, the slowest, _mqa_split, 1.2 s in its worker)" in caplog.text


def test_a_worker_imports_the_kernels_code_as_it_starts_and_never_torch(sm90):
    """A worker's imports are on batch 1's way to its first action with an empty compile cache: Triton's
    and the kernels' device code only, not torch (run 228, H100: batch 1's compile 5.3-6.7 s when each of the
    15 workers imported torch, 3.8-4.0 s without)."""
    with CompilePool(1, GPUTarget("cuda", 90, 32)) as pool:
        # eval: a builtin, so the job itself imports nothing into the worker (this module imports torch)
        modules = pool._pool.submit(eval, "set(__import__('sys').modules)").result()
    assert "vlaserve.runtime.fast.kernel_code" in modules and "torch" not in modules


def test_every_kernel_lives_where_a_worker_compiles_it_without_torch(sm90, tmp_path):
    """What a worker does with each recorded launch: its kernel's module imported, the kernel compiled
    for sm_90, here in a fresh process where importing torch fails."""
    import subprocess
    import sys

    from vlaserve.runtime.fast import kernel_code

    kernels = [name for name, value in vars(kernel_code).items() if isinstance(value, triton.runtime.JITFunction)]
    assert {"_splitk_gemm", "_mqa_split", "_action_step", "_quantize_rows"} <= set(kernels)
    for name in kernels:  # each compiled kernel's module is the one the workers import
        assert getattr(kernel_code, name).fn.__module__ == "vlaserve.runtime.fast.kernel_code"
    recorder = KernelRecorder()
    with recorder.recording():
        _copy[(1,)](torch.zeros(8), torch.zeros(8), 8, BLOCK=8, **OPTIONS)
    (data, _), = recorder.recorded.items()
    data = data.replace(f'"{__name__}._copy"', '"vlaserve.runtime.fast.kernel_code._gelu_flat"')
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from vlaserve.runtime.fast import precompile\n"
        "precompile._start_worker(('cuda', 90, 32))\n"
        f"print(precompile._compile('vlaserve.runtime.fast.kernel_code', '_gelu_flat', {data!r}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(tmp_path.rglob("_gelu_flat.cubin"))
