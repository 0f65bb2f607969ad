"""Serving from the first captured CUDA graph (startup/: the plan, its captures and the runtime's gate
meanwhile, startup/capture.py; runtime/graph_keys.py `route`): the capture plan's order and completeness, how a batch runs while its own graphs
are not captured yet, and the states warming_up -> capturing -> ready.

CUDA graphs need a GPU. Here the real FastRunner runs on the CPU with the stock kernels, and a
"graph" is its function, run on replay: what is tested is everything around the capture — which
graphs exist when, which captured sizes a batch runs as, the rows it gets back, the prefix K/V the
cache reads after a split call, and that the request path never captures.
"""

import itertools
import sys
import threading
import time

import pytest
import torch

from fixtures import fixture_dir
from vlaserve import Policy
from vlaserve.config import RuntimeConfig, graph_batch_sizes
from vlaserve.errors import NotServing
from vlaserve.types import RTCGuidance
from vlaserve.runtime.graph_keys import GraphKey, route
from vlaserve.startup.plan import capture_plan
from vlaserve.runtime.graphs import FastRunner
from vlaserve.startup.capture import WARMUP_STEPS, GraphCapture
from vlaserve.runtime.graphs import _Graph as CUDAGraphCapture
from vlaserve.runtime.runner import Runtime
from vlaserve.startup.engine import CAPTURE_SWITCH_INTERVAL_S, Startup, start
from vlaserve.startup.turns import DeviceTurns
from vlaserve.types import ModelInputs

# --- the plan ---------------------------------------------------------------------------------


def test_plan_captures_each_callers_common_call_first_then_the_rest_largest_first():
    keys = capture_plan(tuple(range(1, 9)), (96, 200), 3)
    plan = [str(k) for k in keys]
    # a lone robot's call (batch 1, default bucket, every camera, no RTC): serving starts on it
    assert plan[:2] == ["b1 L96 cams3", "b1 L96 denoise"]
    # then a fleet's (the largest size at the default bucket), behind that size's largest graph, which
    # sizes the shared pool for every smaller one
    assert plan[2:5] == ["b8 L200 cams3", "b8 L96 cams3", "b8 L96 denoise"]
    # then the rest of batch 1, every shape before any other size's
    assert plan[5:13] == ["b1 L96 cams2", "b1 L96 cams1", "b1 L96 rtc", "b1 L200 cams3", "b1 L200 denoise",
                          "b1 L200 cams2", "b1 L200 cams1", "b1 L200 rtc"]
    # then the other sizes largest first, longest prompt first (the pool's order)
    assert plan[13:16] == ["b8 L200 denoise", "b8 L200 cams2", "b8 L200 cams1"]
    later = [(k.batch, -k.length) for k in keys[13:]]
    assert later == sorted(later, key=lambda t: (-t[0], t[1]))
    assert [k.batch for k in keys[-5:]] == [2] * 5 and plan[-1] == "b2 L96 rtc"


def test_plan_with_one_prompt_length_lists_the_fleets_prefix_once():
    plan = [str(k) for k in capture_plan((1, 2, 4), (200,), 2)]
    assert plan[:4] == ["b1 L200 cams2", "b1 L200 denoise", "b4 L200 cams2", "b4 L200 denoise"]
    assert len(plan) == len(set(plan)) == 3 * 4  # 3 sizes x (2 layouts + denoise + rtc)
    assert capture_plan((1,), (96, 200), 3)[:2] == capture_plan((1, 2), (96, 200), 3)[:2]


@pytest.mark.parametrize("mode,limit,lengths,cameras", [("all", 8, (96, 200), 3), ("ladder", 8, (200,), 3),
                                                        ("ladder", 6, (48, 96, 200), 2), ("all", 1, (200,), 1)])
def test_plan_holds_every_graph_once(mode, limit, lengths, cameras):
    sizes = graph_batch_sizes(mode, limit)
    plan = capture_plan(sizes, lengths, cameras)
    # every prefix graph (batch, length, layout) and Euler-steps graph (batch, length, rtc): the
    # calls a server makes need one of each
    prefix = {GraphKey(b, n, c) for b, n, c in itertools.product(sizes, lengths, range(1, cameras + 1))}
    denoise = {GraphKey(b, n, rtc=r) for b, n, r in itertools.product(sizes, lengths, (False, True))}
    assert len(plan) == len(set(plan)) == len(prefix | denoise) and set(plan) == prefix | denoise
    # today's 80 graphs for the default server (batch 1-8, two prompt lengths, three cameras)
    assert len(capture_plan(tuple(range(1, 9)), (96, 200), 3)) == 80


@pytest.mark.parametrize("batch,sizes,parts", [
    (5, [1], [(1, 1)] * 5),  # only batch 1 so far: five batch-1 replays
    (5, [1, 8], [(8, 5)]),  # a size within twice the batch: one padded replay
    (5, [1, 7, 8], [(7, 5)]),  # the smallest such size
    (5, [1, 4], [(4, 4), (1, 1)]),  # none within 2x: the largest below, then the rest
    (7, [1, 4], [(4, 4), (4, 3)]),  # ... and the rest padded where it can be
    (3, [1, 2, 4, 8], [(4, 3)]),  # the ladder, once all are captured
    (4, range(1, 9), [(4, 4)]),  # captured: as it is
    (1, [2], [(2, 1)]),
    (1, [4], []),  # nothing at or below it, nor within 2x: the caller runs it without graphs
])
def test_route(batch, sizes, parts):
    assert route(batch, sizes) == parts
    if parts:
        assert sum(rows for _, rows in parts) == batch and all(rows <= size for size, rows in parts)


# --- FastRunner on the CPU, with graphs that take time to capture -----------------------------


class _Graph:
    """A stand-in for a CUDA graph: replay runs the recorded function (on the static buffers, as a
    replay would)."""

    replays = 0

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        type(self).replays += 1
        return self.fn()


class _HostEvent:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True  # the CPU's work is done when launch returns

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


class SlowCaptureRunner(FastRunner):
    """The real FastRunner (buffers, routing, graph stores) on the CPU's stock kernels, its graphs the
    stand-ins above; it counts its warm-ups."""

    def __init__(self, policy, lock=None):
        super().__init__(policy.model, policy.config, use_graphs=False, use_triton=False, lock=lock)
        self.use_graphs = True
        self.warm_up_runs = 0  # every warm-up run, SigLIP's attention's among them
        self.attention_images: list[int] = []  # the image counts SigLIP's attention warmed up at
        attention = self.fast.warm_vision_attention
        self.fast.warm_vision_attention = lambda n: (self.attention_images.append(n), attention(n))

    def warm_up(self, fn, runs):
        for _ in range(runs):
            fn()
        self.warm_up_runs += runs

    def new_graph(self, fn):
        return _Graph(fn)

    def _events(self):
        return _HostEvent(), _HostEvent(), _HostEvent()


class SlowCapture(GraphCapture):
    """The real GraphCapture (warm-ups, scratch buffers, bookkeeping) into a SlowCaptureRunner; each
    capture first waits on `gate` (a slow warm-up the test controls), else sleeps a little. The stock
    kernels are no Triton kernels, so a capture could not tell a new one (`loaded_kernels_only`): every
    kernel signature warms up before its first capture, as with a CuTe library."""

    def __init__(self, runner, turns=None, gate=None, fail_at: str | None = None):
        super().__init__(runner, turns)
        self.gate, self.fail_at = gate, fail_at

    def _captures_first(self):
        return False

    def capture(self, key, num_steps):
        if str(key) == self.fail_at:
            raise RuntimeError(f"injected capture failure at {key}")
        if self.gate is not None:
            self.gate.acquire()
        else:
            time.sleep(0.001)
        return super().capture(key, num_steps)


class _HostTimedRunner(FastRunner):
    """The real FastRunner on the CPU's stock kernels, its stage events timed on the host."""

    def _events(self):
        return _HostEvent(), _HostEvent(), _HostEvent()


def _batch(config, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, s, length = len(config.cameras), config.model.vision.image_size, config.max_token_len
    masks = torch.ones(b, n, dtype=torch.bool)
    token_mask = torch.arange(length)[None].expand(b, -1) < torch.randint(5, 40, (b, 1), generator=g)
    inputs = ModelInputs(torch.rand(b, n, 3, s, s, generator=g) * 2 - 1, masks,
                         torch.randint(0, 1000, (b, length), generator=g) * token_mask, token_mask.contiguous())
    noise = torch.randn(b, config.action_horizon, config.model.max_action_dim, generator=g)
    return inputs, noise


def _item(inputs: ModelInputs, noise, i: int):
    return ModelInputs(inputs.images[i:i + 1], inputs.image_masks[i:i + 1], inputs.tokens[i:i + 1],
                       inputs.token_mask[i:i + 1]), noise[i:i + 1]


@pytest.fixture(scope="module")
def batch1_runner(golden_policy):
    """A runner whose plan got as far as batch 1 (every layout, RTC), with sizes up to 8 planned."""
    config = golden_policy.config
    runner = SlowCaptureRunner(golden_policy)
    capture = SlowCapture(runner)
    plan = capture_plan(tuple(range(1, 9)), (config.max_token_len,), len(config.cameras))
    batch_1 = [key for key in plan if key.batch == 1]
    for key in batch_1:
        capture.capture(key, config.num_inference_steps)
    assert len(batch_1) == runner.captures == 5
    return runner


def test_a_batch_not_captured_yet_runs_as_captured_batch_1_calls(golden_policy, batch1_runner):
    runner, config = batch1_runner, golden_policy.config
    steps = config.num_inference_steps
    inputs, noise = _batch(config, 5)
    before = (runner.captures, _Graph.replays, runner.split_calls)
    out, times = runner.dispatch(inputs, noise, steps)
    entries = [runner.prefix_entry(i) for i in range(5)]
    # five batch-1 calls, each a prefix and a denoise replay; nothing captured on the request path
    assert (runner.captures, _Graph.replays - before[1], runner.split_calls - before[2]) == (before[0], 10, 1)
    assert runner.request_path_captures == 0 and runner.uncaptured_calls == 0
    assert out.shape == (5, config.action_horizon, config.model.max_action_dim)
    stages = times.read()
    assert stages["prefix_ms"] > 0 and stages["denoise_ms"] > 0
    # item i gets exactly what a batch-1 call of item i gives (same batch size: bit for bit), in order
    for i in range(5):
        alone, alone_noise = _item(inputs, noise, i)
        expected, _ = runner.dispatch(alone, alone_noise, steps)
        assert torch.equal(out[i], expected[0]), i
        # the prefix K/V the cache reads after the split call is item i's, though its buffers were reused
        mine = runner.prefix_entry(0)
        assert torch.equal(entries[i].k, mine.k) and torch.equal(entries[i].v, mine.v)
        assert torch.equal(entries[i].pad, mine.pad)
    assert runner.request_path_captures == 0 and runner.uncaptured_calls == 0


class _EmptyPool:
    def recorder(self):
        from vlaserve.runtime.fast.precompile import KernelRecorder

        return KernelRecorder(on_record=lambda *kernel: pytest.fail(f"recorded {kernel}"))

    def compile(self, recorder):
        assert recorder.recorded == {}  # the stock kernels: no Triton kernel to record
        return 0


def test_recording_kernels_runs_each_signature_once_before_its_warm_up(golden_policy):
    """GraphCapture.record_kernels's dry runs: one per warm-up signature not warmed up yet (the camera
    layouts share the prefix's), none for what a warm-up already ran; the stock kernels here
    are no Triton kernels, so nothing is recorded to compile."""
    runner, config = SlowCaptureRunner(golden_policy), golden_policy.config
    capture = SlowCapture(runner)
    steps = config.num_inference_steps
    plan = capture_plan((1, 2), (config.max_token_len,), len(config.cameras))
    batch1 = [k for k in plan if k.batch == 1]
    pool = _EmptyPool()
    assert pool.compile(capture.record_kernels(batch1, steps, pool)) == 0
    assert runner.warm_up_runs == 3  # the prefix, the Euler steps, the Euler steps with RTC
    for key in batch1:
        capture.capture(key, steps)
    # the warm-ups still run (now without compiling), SigLIP's attention at 3, 2 and 1 images, and the
    # frames' conversion once (runtime/transfer.py `BytesIn`)
    assert runner.warm_up_runs == 6 + len(config.cameras) + 1
    assert pool.compile(capture.record_kernels(batch1, steps, pool)) == 0
    assert runner.warm_up_runs == 6 + len(config.cameras) + 1


def test_a_batch_pads_to_a_captured_size_within_twice_its_rows(golden_policy, batch1_runner):
    runner, config = SlowCaptureRunner(golden_policy), golden_policy.config
    steps, capture = config.num_inference_steps, SlowCapture(runner)
    for key in capture_plan((1, 4), (config.max_token_len,), len(config.cameras)):
        capture.capture(key, steps)
    inputs, noise = _batch(config, 3, seed=1)
    out, _ = runner.dispatch(inputs, noise, steps)
    assert runner.padded_calls == 1 and runner.split_calls == 0 and runner.uncaptured_calls == 0
    # the rows of a batch-4 call with the last item repeated (the ladder's padding)
    grown = ModelInputs(*(torch.cat([t, t[-1:]]) for t in (inputs.images, inputs.image_masks, inputs.tokens,
                                                            inputs.token_mask)))
    expected, _ = runner.dispatch(grown, torch.cat([noise, noise[-1:]]), steps)
    assert torch.equal(out, expected[:3])


def test_one_warm_up_per_kernel_signature(golden_policy):
    config = golden_policy.config
    plan = capture_plan((1, 2), (96, config.max_token_len), len(config.cameras))
    steps_run = []
    runner = SlowCaptureRunner(golden_policy)
    capture = SlowCapture(runner)
    schedule = runner.fast.schedule
    runner.fast.schedule = lambda n: (steps_run.append(n), schedule(n))[1]
    for key in plan:
        warm_s, capture_s = capture.capture(key, config.num_inference_steps)
        assert warm_s >= 0 and capture_s > 0
    assert runner.captures == len(plan) == 20
    # SigLIP's attention once per image count, before the first capture that meets it (3 cameras;
    # the plan's order: batch 1's common call, batch 2's, then batch 1's fewer-camera layouts, batch 2's)
    assert runner.attention_images == [3, 6, 2, 1, 4]
    # per (batch, length): the prefix once, the Euler steps once without and once with RTC; the frames'
    # conversion once
    assert runner.warm_up_runs - len(runner.attention_images) == 2 * 2 * 3 + 1
    # a warm-up's Euler loop: WARMUP_STEPS steps; the captured call's: the call's
    assert set(steps_run) == {WARMUP_STEPS, config.num_inference_steps}


def test_warm_ups_take_the_device_in_turn_and_recordings_hold_no_lock(golden_policy):
    """A warm-up runs kernels: it waits for its turn (startup/turns.py) and holds the device lock, so no batch
    launches while a kernel compiles or loads. A recording runs nothing and is made in thread-local capture mode:
    it holds no lock, and batches launch meanwhile. Its graph is stored, where `launch` finds it, once recorded."""
    config, seen = golden_policy.config, []

    class CountingTurns(DeviceTurns):
        def before_warm_up(self):
            seen.append("turn")
            super().before_warm_up()

    turns = CountingTurns()

    class WatchedRunner(SlowCaptureRunner):
        def warm_up(self, fn, runs):
            seen.append(("warm-up", turns.lock._is_owned()))
            super().warm_up(fn, runs)

        def new_graph(self, fn):
            # (a batch size's first prefix graph is followed by its frames' conversion's, runtime/transfer.py `BytesIn`)
            kind = "conversion recorded" if fn.__qualname__.startswith("BytesIn.") else "recorded"
            seen.append((kind, turns.lock._is_owned(), len(self._prefix_graphs) + len(self._denoise_graphs)))
            return super().new_graph(fn)

    capture = SlowCapture(WatchedRunner(golden_policy, lock=turns.lock), turns)
    plan = capture_plan((1, 2), (config.max_token_len,), len(config.cameras))
    for i, key in enumerate(plan):
        capture.capture(key, config.num_inference_steps)
        assert not any(step[1] for step in seen if step[0].endswith("recorded"))  # without the lock
        assert [step for step in seen if step[0] == "recorded"][-1] == ("recorded", False, i)  # stored only after
    warm_ups = [j for j, step in enumerate(seen) if step[0] == "warm-up"]
    # per kernel signature: per size, the prefix, the Euler steps with and without RTC, and SigLIP's attention
    # at each image count of its layouts (1-3 cameras: 1-3 images at batch 1, 2-6 at batch 2: 5 counts); the
    # frames' conversion once
    assert len(warm_ups) == 2 * 3 + 5 + 1
    assert all(seen[j] == ("warm-up", True) and seen[j - 1] == "turn" for j in warm_ups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")
def test_on_a_gpu_another_thread_launches_queries_and_waits_while_a_graph_records():
    """What serving does beside a capture — kernels on the legacy default stream, an event queried and waited
    for, a pinned copy back, a blocking read — in the middle of a recording: in thread-local mode neither breaks
    the other (in torch's default global mode the query would fail, and the capture with it)."""
    x = torch.ones(1 << 20, device="cuda")
    y = torch.empty_like(x)
    recording, go_on, made = threading.Event(), threading.Event(), {}

    def record():
        def call():
            y.copy_(x * 2)
            recording.set()
            assert go_on.wait(30)  # the capture stays open while the other thread works
            return y.add_(1)

        made["graph"] = CUDAGraphCapture(call, torch.cuda.graph_pool_handle(), torch.cuda.Stream())

    recorder = threading.Thread(target=record)
    recorder.start()
    assert recording.wait(30)
    a = torch.full((1 << 20,), 3.0, device="cuda")
    squares = (a * a).sum()
    done = torch.cuda.Event()
    done.record()
    done.query()
    done.synchronize()
    host = torch.empty(4, pin_memory=True)
    host.copy_(a[:4], non_blocking=True)
    torch.cuda.current_stream().synchronize()
    total = squares.item()
    go_on.set()
    recorder.join(30)
    assert total == 9.0 * (1 << 20) and host.tolist() == [3.0] * 4
    x.fill_(5.0)
    out = made["graph"].replay()
    torch.cuda.synchronize()
    assert bool((out == 11.0).all())  # the graph holds both of its recorded kernels, on the input of its replay


# --- Runtime: the states, and requests that arrive before batch 1 is captured ------------------


def _serve(policy, background: bool = True, sizes=(1, 2), weights_pending: bool = False, **capture_options):
    """A fresh Runtime serving a SlowCaptureRunner while its start-up captures the plan of `sizes`."""
    config = policy.config
    runtime = Runtime(policy.model, config, RuntimeConfig(device="cpu", dtype="float32"), torch.device("cpu"),
                      torch.float32, "test")
    startup = Startup(runtime)
    runner = SlowCaptureRunner(policy, lock=startup.turns.lock)  # as startup.engine.start builds it
    plan = capture_plan(sizes, (config.max_token_len,), len(config.cameras))
    startup.begin(SlowCapture(runner, startup.turns, **capture_options), plan, config.num_inference_steps, background=background, weights_pending=weights_pending)
    return runtime, runner, plan, startup


def _join_capture_thread(timeout: float = 60) -> None:
    """Waits for the newest capture thread to end. The newest: a test that failed may leave an older one
    blocked on its gate (a daemon), which joined without a timeout hung every later test."""
    thread = [t for t in threading.enumerate() if t.name == "vlaserve-capture"][-1]
    thread.join(timeout)
    assert not thread.is_alive(), f"the capture thread still runs after {timeout} s"


def test_states_and_a_request_that_waits_for_batch_1(golden_policy):
    config, gate = golden_policy.config, threading.Semaphore(0)
    runtime, runner, plan, startup = _serve(golden_policy, gate=gate)
    assert runtime.state == "warming_up" and not runtime.serving.is_set() and runtime.runner is runner
    graphs = runtime.stats()["graphs"]
    assert (graphs["captured"], graphs["total"], graphs["pending"], graphs["serving_after_s"]) == (0, 10, 10, None)
    assert graphs["pending_shapes"][0] == "b1 L200 cams3"

    inputs, noise = _batch(config, 2, seed=2)
    result = {}
    request = threading.Thread(target=lambda: result.update(out=runtime.enqueue(inputs, noise, 10, None).wait()))
    request.start()
    request.join(0.2)
    assert request.is_alive() and not result  # waiting: nothing runs before batch 1's graphs exist
    for _ in range(2):  # batch 1's first prefix (every camera) and its Euler steps: enough to serve
        gate.release()
    request.join()
    assert runtime.serving.is_set() and runtime.state == "capturing"
    assert result["out"][0].shape == (2, config.action_horizon, config.model.max_action_dim)
    assert runner.split_calls == 1 and runner.request_path_captures == 0 and runner.uncaptured_calls == 0
    graphs = runtime.stats()["graphs"]
    assert graphs["captured"] == 2 and graphs["pending"] == 8 and graphs["serving_after_s"] > 0
    assert graphs["captured_shapes"] == [str(k) for k in plan[:2]] and graphs["all_captured_after_s"] is None

    for _ in range(8):
        gate.release()
    _join_capture_thread()
    stats = runtime.stats()
    assert stats["state"] == "ready" and stats["graph_captures"] == 10 and stats["graphs"]["pending_shapes"] == []
    assert stats["graphs"]["all_captured_after_s"] >= stats["graphs"]["serving_after_s"]
    assert [g["shape"] for g in stats["graphs"]["per_graph"]] == [str(k) for k in plan]
    runtime.enqueue(inputs, noise, 10, None).wait()  # now batch 2's own graphs
    assert runner.split_calls == 1 and runner.request_path_captures == 0


def test_a_call_of_a_shape_not_captured_yet_asks_for_it_next_and_waits(golden_policy):
    """Serving starts with batch 1's first graphs; a call with RTC (or another camera layout) then
    moves its graphs ahead of the plan's order and waits for them instead of running uncaptured."""
    config, gate = golden_policy.config, threading.Semaphore(0)
    runtime, runner, plan, startup = _serve(golden_policy, gate=gate)
    for _ in range(2):
        gate.release()
    runtime.serving.wait(5)
    g = torch.Generator().manual_seed(3)
    horizon, dim = config.action_horizon, config.model.max_action_dim
    rtc = RTCGuidance(torch.randn(1, horizon, dim, generator=g), torch.rand(1, horizon, generator=g),
                      torch.tensor([2.0]))
    inputs, noise = _batch(config, 1, seed=3)
    result = {}
    request = threading.Thread(target=lambda: result.update(out=runtime.enqueue(inputs, noise, 10, rtc).wait()))
    request.start()
    rtc_key = GraphKey(1, config.max_token_len, rtc=True)
    deadline = time.monotonic() + 5
    while rtc_key not in startup.graphs._wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    assert request.is_alive() and not result  # waiting for its graph
    # Two captures: the one the capture thread may have begun already, and the RTC graph, though
    # the plan lists four graphs before it (batch 2's common call, batch 1's two other camera layouts).
    gate.release()
    gate.release()
    request.join(5)
    assert result["out"][0].shape == (1, horizon, dim)
    assert str(rtc_key) in runtime.stats()["graphs"]["captured_shapes"][2:4]
    assert plan.index(rtc_key) == 6 and runner.uncaptured_calls == 0 and runner.request_path_captures == 0
    for _ in plan:
        gate.release()
    _join_capture_thread()
    assert runtime.state == "ready"


def _counting_refreshes(runner) -> list:
    calls = []
    refresh = runner.refresh_weights
    runner.refresh_weights = lambda: (calls.append(time.perf_counter()), refresh())[1]
    return calls


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_graphs_captured_while_the_weights_load_serve_once_they_are_loaded(golden_policy):
    """start(weights_pending=True), as Policy.from_pretrained starts it with capture_while_loading: the plan is
    captured while the weights load; a request waits until `weights_loaded()`, which first computes again what
    the runner derived from the weights, and serving starts then, batch 1's graphs being captured already."""
    config, gate = golden_policy.config, threading.Semaphore(0)
    runtime, runner, plan, startup = _serve(golden_policy, gate=gate, weights_pending=True)
    refreshes = _counting_refreshes(runner)
    for _ in range(2):  # batch 1's common call: what serving waits for
        gate.release()
    assert _wait_for(lambda: runtime.stats()["graphs"]["captured"] == 2)
    inputs, noise = _batch(config, 1, seed=4)
    result = {}
    request = threading.Thread(target=lambda: result.update(out=runtime.enqueue(inputs, noise, 10, None).wait()))
    request.start()
    request.join(0.3)
    assert request.is_alive() and not runtime.serving.is_set() and runtime.state == "warming_up"
    assert runtime.stats()["graphs"]["serving_after_s"] is None
    startup.weights_loaded()
    assert len(refreshes) == 1 and runtime.serving.is_set() and runtime.state == "capturing"
    request.join(5)
    expected, _ = runner.dispatch(inputs, noise, 10)
    assert torch.equal(torch.from_numpy(result["out"][0]), expected.float())
    for _ in plan:
        gate.release()
    _join_capture_thread()
    assert runtime.state == "ready" and len(refreshes) == 1 and runner.request_path_captures == 0


def test_a_plan_captured_before_the_weights_arrive_ends_with_them(golden_policy):
    """Every graph captured and the weights still loading: not serving, not "ready", until they are loaded."""
    runtime, runner, plan, startup = _serve(golden_policy, weights_pending=True)
    assert _wait_for(lambda: runtime.stats()["graphs"]["pending"] == 0)
    thread = [t for t in threading.enumerate() if t.name == "vlaserve-capture"][-1]
    thread.join(0.2)
    assert thread.is_alive() and runtime.state == "warming_up" and not runtime.serving.is_set()
    startup.weights_loaded()
    _join_capture_thread()
    assert runtime.state == "ready" and runtime.serving.is_set() and runtime.stats()["graph_captures"] == len(plan)


def test_weights_pending_needs_the_background_warm_up_and_the_fast_path(golden_policy):
    runtime = Runtime(golden_policy.model, golden_policy.config, RuntimeConfig(device="cpu", dtype="float32"),
                      torch.device("cpu"), torch.float32, "test")
    startup = Startup(runtime)
    capture = SlowCapture(SlowCaptureRunner(golden_policy, lock=startup.turns.lock), startup.turns)
    plan = capture_plan((1,), (golden_policy.config.max_token_len,), len(golden_policy.config.cameras))
    with pytest.raises(ValueError, match="background"):
        startup.begin(capture, plan, 10, background=False, weights_pending=True)
    with pytest.raises(ValueError, match="fast path"):  # a CPU device has no CUDA fast path
        start(runtime, weights_pending=True)
    assert start(runtime) is None and runtime.state == "ready"  # the eager model: nothing to start


def test_a_dropped_runtime_is_freed_at_once(golden_policy):
    """No reference cycle keeps a Runtime (and its graphs) alive once dropped, nor its start-up once done: a
    cycle left it to the garbage collector, which could free it during another Runtime's capture, and on a GPU
    that capture then failed (the old graphs' memory returned with cudaFree: capture invalidated)."""
    import gc
    import weakref

    runtime, runner, _, startup = _serve(golden_policy, background=False)
    alive, startup_alive = weakref.ref(runtime), weakref.ref(startup)
    gc.disable()
    try:
        del startup
        assert startup_alive() is None  # done: the runtime holds nothing of it
        del runtime
        assert alive() is None  # freed by reference counting alone, not waiting for a collection
    finally:
        gc.enable()


def test_blocking_returns_with_every_graph_captured(golden_policy):
    runtime, runner, plan, startup = _serve(golden_policy, background=False)
    assert runtime.state == "ready" and runtime.serving.is_set() and runner.captures == len(plan)


def test_the_interpreter_switches_threads_often_while_graphs_are_captured_and_as_before_after(golden_policy):
    """Each launch a recording makes gives the interpreter lock up and takes it back; behind a busy serving thread
    it waited up to Python's switch interval (5 ms) each time. While the plan is captured the interval is
    CAPTURE_SWITCH_INTERVAL_S; after it, whatever it was, also when a capture fails."""
    seen = []

    class Watched(SlowCapture):
        def capture(self, key, num_steps):
            seen.append(sys.getswitchinterval())
            return super().capture(key, num_steps)

    before = sys.getswitchinterval()
    assert before > CAPTURE_SWITCH_INTERVAL_S  # (Python's default, 5 ms)
    for fail_at in (None, "b1 L200 denoise"):
        runtime = Runtime(golden_policy.model, golden_policy.config, RuntimeConfig(device="cpu", dtype="float32"),
                          torch.device("cpu"), torch.float32, "test")
        startup = Startup(runtime)
        capture = Watched(SlowCaptureRunner(golden_policy, lock=startup.turns.lock), startup.turns, fail_at=fail_at)
        plan = capture_plan((1,), (golden_policy.config.max_token_len,), len(golden_policy.config.cameras))
        startup.begin(capture, plan, golden_policy.config.num_inference_steps, background=True)
        _join_capture_thread()
        assert seen and set(seen) == {CAPTURE_SWITCH_INTERVAL_S} and sys.getswitchinterval() == before
        seen.clear()


def test_a_failure_before_batch_1_fails_requests_and_says_why(golden_policy):
    runtime, _, _, _ = _serve(golden_policy, fail_at="b1 L200 denoise")
    _join_capture_thread()
    assert runtime.state == "failed" and "injected capture failure" in runtime.stats()["graphs"]["error"]
    inputs, noise = _batch(golden_policy.config, 1)
    with pytest.raises(NotServing, match="failed to warm up"):
        runtime.enqueue(inputs, noise, 10, None)
    with pytest.raises(RuntimeError, match="injected"):  # blocking: the error reaches the caller
        _serve(golden_policy, background=False, fail_at="b1 L200 denoise")


def test_a_failure_after_batch_1_keeps_serving_on_the_captured_graphs(golden_policy):
    runtime, runner, _, _ = _serve(golden_policy, fail_at="b2 L200 cams3")
    _join_capture_thread()
    assert runtime.state == "failed" and runtime.serving.is_set()
    inputs, noise = _batch(golden_policy.config, 2)
    assert runtime.enqueue(inputs, noise, 10, None).wait()[0].shape[0] == 2
    assert runner.split_calls == 1 and runner.uncaptured_calls == 0


def test_waiting_is_bounded(golden_policy):
    gate = threading.Semaphore(0)
    runtime, _, plan, startup = _serve(golden_policy, sizes=(1,), gate=gate)
    startup.SERVING_WAIT_S = 0.05
    inputs, noise = _batch(golden_policy.config, 1)
    with pytest.raises(NotServing, match="still being captured"):
        runtime.enqueue(inputs, noise, 10, None)
    for _ in plan:
        gate.release()
    _join_capture_thread()
    assert runtime.state == "ready"


def test_the_eager_runtime_is_ready_at_once(golden_policy):
    graphs = golden_policy.runtime.stats()["graphs"]
    assert golden_policy.runtime.serving.is_set()
    assert graphs == {"captured": 0, "total": 0, "pending": 0, "captured_shapes": [], "pending_shapes": [],
                      "serving_after_s": 0.0, "all_captured_after_s": 0.0, "warmup_s": 0.0, "capture_s": 0.0,
                      "kernels_compiled_ahead": 0, "compile_ahead_s": 0.0, "per_graph": [], "error": None,
                      "warm_ups_skipped": 0, "memset_nodes": None}


class StampedEvent:
    """A CUDA event's timing interface over a fixed time stamp (ms)."""

    def __init__(self, at_ms: float):
        self.at_ms = at_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "StampedEvent") -> float:
        return other.at_ms - self.at_ms


def test_a_call_launched_behind_a_running_one_reports_the_device_gap_between_them():
    """EventTimes: prefix and denoise from its own events; the gap from the call before's end to
    this one's start only when the runner passed that end (it was still running at launch). A batch
    run as parts reports its first part's gap (the later parts follow their own batch's)."""
    from vlaserve.runtime.graphs import EventTimes, PartTimes

    alone = EventTimes(StampedEvent(10.0), StampedEvent(17.0), StampedEvent(24.0))
    assert alone.read() == {"prefix_ms": 7.0, "denoise_ms": 7.0}
    behind = EventTimes(StampedEvent(10.0), StampedEvent(17.0), StampedEvent(24.0), previous=StampedEvent(9.25))
    assert behind.read() == {"prefix_ms": 7.0, "denoise_ms": 7.0, "launch_gap_ms": 0.75}
    second = EventTimes(StampedEvent(24.5), StampedEvent(30.0), StampedEvent(36.0), previous=StampedEvent(24.0))
    assert PartTimes([behind, second]).read() == {"prefix_ms": 12.5, "denoise_ms": 13.5, "launch_gap_ms": 0.75}
    assert "launch_gap_ms" not in PartTimes([alone, second]).read()



@pytest.mark.parametrize("fixture", ["pi05_golden", "pi0_golden"])
def test_a_fast_model_built_before_its_weights_load_computes_what_one_built_after_does(fixture):
    """capture_while_loading's order (Policy.from_pretrained): the parameters materialized, the fast model built
    on them (its fused matrices become their storage, its folded norms and step schedules are computed from
    placeholder values), the weights loaded in place, then `refresh_weights`: the same actions, bit for bit, as
    the fast model of a policy loaded first. Without the refresh they differ (what the test would catch)."""
    import numpy as np

    from vlaserve.checkpoint.weights import load_weights, materialize
    from vlaserve.family import family_of

    checkpoint = fixture_dir(fixture) / "checkpoint"
    reference = Policy.from_pretrained(checkpoint, device="cpu", dtype="float32", progress=False)
    config, family = reference.config, family_of(reference.config)
    rng = np.random.default_rng(0)
    side = config.image_resolution[0]
    request = reference.request({"images": {c: rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                                            for c in config.cameras},
                                 "state": rng.standard_normal(config.state_dim).astype(np.float32),
                                 "task": "pick up the cube"}, seed=0)
    inputs, noise, _ = reference.preprocessor.collate([request])
    steps = config.num_inference_steps

    def built_before_the_load(refresh: bool) -> torch.Tensor:
        model = materialize(family.build_model(config).eval(), torch.float32, torch.device("cpu"), family.weights)
        for p in model.parameters():
            p.data.fill_(0.25)  # what the derived tensors are first computed from
        runner = _HostTimedRunner(model, config, use_graphs=False, use_triton=False)
        runner.fast.schedule(steps)  # made by a warm-up, before the load
        q = model.vlm.layers[0].self_attn.q_proj.weight
        fused = runner.fast.w.vlm[0].qkv
        load_weights(model, checkpoint, torch.float32, torch.device("cpu"), progress=False, layout=family.weights)
        assert q.data_ptr() == fused.data_ptr() and torch.equal(fused[:q.shape[0]], q)  # loaded where it was fused
        assert not torch.equal(q, torch.full_like(q, 0.25))
        if refresh:
            runner.refresh_weights()
        return runner.dispatch(inputs, noise, steps)[0]

    expected = _HostTimedRunner(reference.model, config, use_graphs=False, use_triton=False).dispatch(
        inputs, noise, steps)[0]
    assert torch.equal(built_before_the_load(refresh=True), expected)
    assert not torch.equal(built_before_the_load(refresh=False), expected)



def test_a_load_that_fails_stops_the_captures_and_serves_nothing(golden_policy):
    config, gate = golden_policy.config, threading.Semaphore(0)
    runtime, runner, plan, startup = _serve(golden_policy, gate=gate, weights_pending=True)
    gate.release()
    assert _wait_for(lambda: runtime.stats()["graphs"]["captured"] == 1)
    startup.weights_failed(OSError("disk gone"))
    for _ in plan:
        gate.release()
    _join_capture_thread()
    assert runtime.state == "failed" and not runtime.serving.is_set() and runner.captures < len(plan)
    inputs, noise = _batch(config, 1)
    with pytest.raises(NotServing, match="the weights did not load: OSError: disk gone"):
        runtime.enqueue(inputs, noise, 10, None)
