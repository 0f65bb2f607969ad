"""The fast path's kernels recorded on a meta-device copy of the model and compiled while the weights
load, on a first start (vlaserve.runtime.fast.ahead), and where the runtime waits for them.

Triton specializes a launch on dtypes, constexprs, options and the alignment of pointers and
integers, so the meta copy must record exactly what the loaded model's warm-ups launch: here both
run through Triton's own binder (a stand-in driver answers for an sm_90 device, none is behind it),
the loaded model on the CPU allocator's addresses, the copy on the meta device's (its offsets)."""

from __future__ import annotations

import copy
import os
import pickle
import threading
from concurrent.futures import Future
from functools import partial

import pytest
import torch

from vlaserve.checkpoint.weights import load_weights
from vlaserve.config import RuntimeConfig
from vlaserve.family import family_of, load_policy_config, meta_model
from vlaserve.runtime.capture import capture_plan
from vlaserve.runtime.fast import ahead, kernels, targets
from vlaserve.runtime.fast.graphs import FastRunner
from vlaserve.runtime.fast.precompile import CompilePool, KernelRecorder, TargetDriver

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

H200 = targets.TARGETS[90]


@pytest.fixture
def sm90(monkeypatch):
    """Triton kernels on (no GPU here: recorded, never launched); the launch table is back after."""
    saved = copy.deepcopy(kernels.TUNING)
    monkeypatch.setattr(driver, "_active", TargetDriver(GPUTarget("cuda", 90, 32)))  # the workers' stand-in
    monkeypatch.setattr(kernels, "available", lambda: True)
    yield
    kernels.TUNING.clear()
    kernels.TUNING.update(saved)


def _checkpoint(golden):
    directory = golden / "checkpoint"
    config = load_policy_config(directory)
    return directory, config, family_of(config)


def _plan(config):
    return capture_plan((1, 2), (48, config.max_token_len), len(config.cameras))


def test_the_meta_copy_records_what_the_loaded_model_launches(sm90, golden):
    directory, config, family = _checkpoint(golden)
    plan, steps = _plan(config), config.num_inference_steps
    build = partial(meta_model, config, torch.bfloat16)
    recorded = {}
    for b in (1, 2):
        args = (build, config, RuntimeConfig(), [key for key in plan if key.batch == b], steps, H200)
        pickle.dumps(args)  # a compile worker runs it
        recorded[b] = ahead.record_batch(*args)
    assert len(recorded[1]) > 10 and recorded[2].keys() - recorded[1].keys()  # batch 2 has kernels of its own

    model = load_weights(family.build_model(config), directory, torch.bfloat16, torch.device("cpu"),
                         progress=False, layout=family.weights)
    runner = FastRunner(model, config, use_graphs=False)
    for b in (1, 2):
        recorder = KernelRecorder()
        runner.record_kernels([k for k in plan if k.batch == b], steps, recorder)
        assert recorder.recorded == recorded[b]


def test_nothing_is_recorded_where_a_fast_path_kernel_is_loaded(monkeypatch, sm90, golden):
    """Triton launches a kernel it finds loaded instead of asking the recording hook: on meta
    addresses. So the recording refuses to run in such a process."""
    _, config, _ = _checkpoint(golden)
    jitted = [fn for module in (kernels, ahead.fp8_kernels) for fn in vars(module).values() if isinstance(fn, JITFunction)]
    for fn in jitted:
        monkeypatch.setattr(fn, "device_caches", {0: ({}, None, None, None, None)})
    assert len(jitted) > 10 and not ahead.loaded_in_process()
    monkeypatch.setattr(jitted[-1], "device_caches", {0: ({"a specialization": object()}, None, None, None, None)})
    assert ahead.loaded_in_process()
    with pytest.raises(RuntimeError, match="launches would run"):
        ahead.record_batch(partial(meta_model, config, torch.bfloat16), config, RuntimeConfig(), _plan(config), 10, H200)


class _Pool:
    """CompilePool's interface: `run` records a batch size (its keys' batch) from `recorded` (or
    raises `error`), `submit` keeps the order of what it is given, a kernel named "broken" fails
    to compile."""

    def __init__(self, recorded=None, error=None):
        self.recorded, self.error, self.submitted, self.closed = recorded, error, [], False

    def run(self, fn, build_model, config, settings, keys, num_steps, target):
        assert fn is ahead.record_batch and {key.batch for key in keys} == {keys[0].batch}
        future = Future()
        future.set_exception(self.error) if self.error else future.set_result(self.recorded[keys[0].batch])
        return future

    def submit(self, recorded):
        self.submitted.append(dict(recorded))
        return [kernel for _, kernel in recorded.values()]

    def wait(self, jobs):
        return sum(job != "broken" for job in jobs)

    def close(self):
        self.closed = True


def test_batch_one_compiles_first_each_kernel_once_and_each_size_is_waited_for(golden):
    _, config, _ = _checkpoint(golden)
    recorded = {1: {"a": ("m", "k1"), "b": ("m", "k2")}, 2: {"a": ("m", "k1"), "c": ("m", "broken")},
                4: {"b": ("m", "k2")}}
    pool = _Pool(recorded)
    early = ahead.KernelsAhead(None, config, RuntimeConfig(), capture_plan((1, 2, 4), (48,), 2), 10, H200, pool)
    assert early.wait(1) == 2 and early.wait(4) == 0 and early.wait(2) == 0 and early.wait(8) == 0
    # the plan's order (1, then largest first), each kernel under the first size that launches it
    assert pool.submitted == [recorded[1], {}, {"c": ("m", "broken")}]
    assert early.compiled == 2 and early.error is None and early.seconds > 0
    assert early.recorded == {"a", "b", "c"}  # the runtime compiles none of them again
    early.close()
    assert pool.closed


def test_a_recording_that_fails_is_logged_and_every_wait_returns(golden, caplog):
    _, config, _ = _checkpoint(golden)
    with caplog.at_level("WARNING"):
        early = ahead.KernelsAhead(None, config, RuntimeConfig(), _plan(config), 10, H200,
                                   _Pool(error=RuntimeError("no model today")))
        assert early.wait(1) == 0 and early.wait(2) == 0
    assert early.error == "RuntimeError: no model today" and "compile after the load" in caplog.text


def _where_a_job_runs():
    from triton.runtime import driver

    return (driver.active.get_current_target(), os.environ["TRITON_CACHE_DIR"], os.environ["CUDA_VISIBLE_DEVICES"],
            os.getppid())


def test_forked_workers_compile_for_the_target_and_cache_given_after_they_started(tmp_path):
    with CompilePool(2, start="fork") as pool:
        with pytest.raises(RuntimeError, match="aim first"):
            pool.run(_where_a_job_runs)
        target = GPUTarget("cuda", 90, 32)
        assert pool.aim(tmp_path, target) is pool
        assert pool.run(_where_a_job_runs).result(timeout=60) == (target, str(tmp_path), "", os.getpid())


class _Ahead:
    """KernelsAhead's interface to the runtime, with a gate the test opens per batch size."""

    def __init__(self):
        self.pool, self.target, self.compiled, self.seconds = None, None, 5, 0.25  # target None: the runtime stays eager
        self.recorded = set()
        self.waited: list[int] = []
        self.gates = {b: threading.Event() for b in (1, 2, 4)}

    def wait(self, batch):
        self.gates[batch].wait()
        self.waited.append(batch)
        return 0


class _Recording:
    def __init__(self, early):
        self.early, self.events = early, []

    def capture(self, key, num_steps):
        self.events.append((key, list(self.early.waited)))
        return 0.0, 0.0


def test_each_batch_size_waits_for_its_kernels_before_its_first_capture(golden_policy):
    from vlaserve.runtime.runner import Runtime

    early = _Ahead()
    runtime = Runtime(golden_policy.model, golden_policy.config, golden_policy.runtime.settings,
                      torch.device("cpu"), torch.float32, "test", kernels_ahead=early)
    plan = capture_plan((1, 2, 4), (48, 96), 2)
    runner = _Recording(early)
    runtime.serve_while_capturing(runner, plan, 10, background=True)
    assert not runtime.serving.wait(0.2) and runner.events == []  # batch 1's kernels are not compiled yet
    for b in (1, 4, 2):
        early.gates[b].set()
    assert runtime._settled.wait(10) and runtime.serving.is_set()
    while runtime.state != "ready":
        threading.Event().wait(0.01)
    assert [key for key, _ in runner.events] == plan
    for key, waited in runner.events:  # every capture came after its batch size's wait
        assert key.batch in waited
    assert early.waited == [1, 4, 2]
    graphs = runtime.stats()["graphs"]
    assert graphs["kernels_compiled_during_load"] == 5 and graphs["kernels_during_load_s"] == 0.25


class _Workers:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_the_forked_workers_go_home_where_nothing_compiles_ahead(monkeypatch, tmp_path, golden):
    """A warm compile cache (the kernels load from it) or a GPU without the fast path: no recording,
    and the workers forked before CUDA's initialization end."""
    from vlaserve.runtime import runner

    _, config, _ = _checkpoint(golden)
    cuda = torch.device("cuda")
    monkeypatch.setattr(runner, "activate", lambda directory, device: tmp_path)
    monkeypatch.setattr(runner, "choose_target", lambda device: None)  # e.g. a GPU below sm80
    workers = _Workers()
    assert runner.compile_kernels_ahead(None, config, RuntimeConfig(), cuda, workers) is None and workers.closed
    monkeypatch.setattr(runner, "choose_target", lambda device: H200)
    (tmp_path / "a kernel").mkdir()  # a warm cache
    workers = _Workers()
    assert runner.compile_kernels_ahead(None, config, RuntimeConfig(), cuda, workers) is None and workers.closed
    assert runner.compile_kernels_ahead(None, config, RuntimeConfig(), cuda, None) is None


def test_workers_are_forked_only_where_the_fast_path_may_compile_its_own_kernels():
    from vlaserve.runtime import runner

    cuda = torch.device("cuda")
    assert runner.compiles_ahead(RuntimeConfig(), cuda)
    assert not runner.compiles_ahead(RuntimeConfig(), torch.device("cpu"))
    for off in ({"parallel_compile": False}, {"fast_path": False}, {"precision": "fp8"}, {"gemm_library": "quack"},
                {"attention_library": "fa4"}, {"memory_profile": "offload"}):
        assert not runner.compiles_ahead(RuntimeConfig(**off), cuda), off
    assert runner.fork_compile_workers(RuntimeConfig(), torch.device("cpu")) is None
