"""Every benchmark in bench/ runs its --smoke mode here, so none can rot unnoticed.

A smoke run is the script's own code on the CPU at the golden checkpoint's tiny sizes (servers,
clients, runners, the JSON and the plot), in a subprocess as a user runs it. Each check reads the
JSON it wrote and asserts values that only the real path produces: the golden cases matched, actions
bit-identical where the same function ran twice, a server answered every robot with its own
answer. Speeds are not checked (a CPU smoke run measures nothing worth keeping).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
# The subprocesses (and the servers they start) share this machine's cores with the test runner:
# one torch thread each keeps a smoke run in seconds instead of fighting over the cores.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# bf16 keeps 8 significant bits (relative error <= 2^-8 per rounding); through the tiny model's few
# layers the actions (|a| ~ 1) move by ~1e-3 against float32. 0.05 catches a wrong function, not noise.
BF16_BOUND = 0.05


def run(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--smoke", "--out", str(out), *args],
                          capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def result(out: Path, name: str, png: bool) -> dict:
    assert (out / f"{name}.png").is_file() == png
    return json.loads((out / f"{name}.json").read_text())


def check_bench_gpu(out: Path) -> None:
    r = result(out, "bench_gpu", png=True)
    assert r["device"] == "cpu" and r["smoke"] and r["served_variant"] == "eager_runner"
    (case,) = r["golden"].values()
    assert case["exact_ok"] and not case["eager_beyond_tolerance"]
    acc = r["accuracy"]["1"]
    # The eager runner runs the eager model: the same function, bit for bit; bf16 is not fp32.
    assert acc["eager_runner_vs_eager_bf16"] == 0.0 and acc["fast_repeat_bit_identical"]
    assert 0 < acc["eager_bf16_vs_fp32"] < BF16_BOUND and acc["fast_default_bucket_vs_fp32"] < BF16_BOUND
    assert r["workload"]["default_bucket"] < r["workload"]["tokens"]  # the bucketed call ran shorter prompts
    assert r["options_b1"]["prefix_cache_hit_equals_miss"] and r["options_b1"]["two_cams_vs_eager_bf16"] == 0.0
    assert r["policy_b1"]["wall_p50_ms"] >= r["policy_b1"]["gpu_p50_ms"] > 0
    assert r["timings"]["1"]["eager_runner"]["p50_ms"] > 0 and r["ceilings"]["bf16_gemm_tflops"] > 0


def check_bench_pi0_gpu(out: Path) -> None:
    r = result(out, "bench_pi0_gpu", png=True)
    acc = r["accuracy"]["1"]
    assert acc["eager_runner_vs_fp32"] == acc["eager_bf16_vs_fp32"]  # the runner runs the eager model
    assert 0 < acc["eager_runner_vs_fp32"] < BF16_BOUND and acc["eager_runner_repeat_bit_identical"]


def check_bf16_error(out: Path) -> None:
    r = result(out, "bf16_error", png=False)
    assert [len(r["per_call"][b]) for b in ("1", "2")] == [2, 1]
    summary = r["summary"]["1"]["ours_eager_runner"]
    assert summary["calls"] == 2 and 0 < summary["mean"] <= summary["max"] < BF16_BOUND


def check_bench_memory(out: Path) -> None:
    r = result(out, "bench_memory", png=True)
    # On a CPU every profile serves the eager model: the same actions, bit for bit (offload included).
    assert set(r["actions_b1"]) == {"eager", "default", "edge-16gb", "offload", "offload eager"}
    assert all(a["bit_identical_to_default"] for a in r["actions_b1"].values())
    cold = r["cold_start"]
    assert cold["loaders_bit_identical"]["bit_identical"]
    for name in ("cold safetensors", "warm safetensors"):
        assert cold[name]["process_to_first_action_s"] > cold[name]["first_infer_s"] > 0
        assert 0 < cold[name]["load_weight_bytes"] <= cold["weight_file_bytes"] and not cold[name]["fast_path"]


def check_bench_serve(out: Path) -> None:
    r = result(out, "bench_serve", png=False)
    assert r["first_action_shape"] == [50, 14] and r["server_exit_code"] == 0
    assert r["metadata"]["device"] == "cpu"
    assert r["openpi_ws"]["n"] == r["http_msgpack"]["n"] == r["realtime_ws"]["n"] == 3
    assert r["process_to_first_action_s"] > r["process_to_healthz_s"] > 0
    # 3 rounds of 2 observations: 3 batched calls, 6 single ones, every observation answered.
    batch = r["batch_request"]
    assert (batch["batch"], batch["one_call"]["n"], batch["concurrent_single"]["n"]) == (2, 3, 6)
    assert batch["one_call"]["obs_per_s"] > 0 and batch["concurrent_single"]["obs_per_s"] > 0


def check_bench_fleet(out: Path) -> None:
    r = result(out, "bench_fleet", png=True)
    assert [(lv["robots"], lv["hz"]) for lv in r["levels"]] == [(1, 0.0), (2, 0.0), (2, 2.0)]
    for lv in r["levels"]:  # every answer was its own robot's reference answer
        assert lv["answers"] > 0 and lv["errors"] == lv["wrong"] == lv["crossed"] == 0
        assert {"prepare_ms", "queue_ms", "run_ms", "handback_ms"} <= set(lv["stages_p99_ms"])
    assert {"prepare_ms", "handback_ms", "device_ms", "server_total"} <= set(r["batch1"]["breakdown_p99_ms"])
    assert r["min_distance_between_robots"] > 0.25  # robots' answers are told apart (WRONG_ANSWER)
    # One robot's answers all ran alone; the slowest 1% add up: server stages inside infer_ms, the rest outside
    # (outside_ms is that difference of two means: approx for float rounding only).
    assert list(r["levels"][0]["device_ms_by_batch"]) == ["1"]
    slow = r["levels"][0]["slowest"]
    assert slow["answers"] >= 1 and slow["outside_ms"] == pytest.approx(slow["latency_ms"] - slow["infer_ms"])
    assert slow["infer_ms"] >= slow["run_ms"] >= slow["device_ms"] > 0
    # The paced level's floor: the ideal batcher on this run's batch times, below what was measured
    # (nothing real beats it: host time per request at its lone-robot median, no other cost).
    paced = r["levels"][2]
    assert 0 < paced["floor"]["p50_ms"] <= paced["floor"]["p99_ms"] and len(r["floor_inputs"]["device_ms"]) == 8


def check_bench_rtc(out: Path) -> None:
    r = result(out, "bench_rtc", png=True)
    assert list(r["modes"]) == ["sync", "async", "async+rtc"]
    for mode in r["modes"].values():
        assert mode["ticks"] == 150 and mode["switches"] >= 1
    assert "executor" in r["modes"]["async+rtc"] and r["rtc_over_plain_jump_at_switch"] > 0


def check_bench_prepare(out: Path) -> None:
    r = result(out, "bench_prepare", png=False)
    for label in ("back_to_back", "after_idle", "after_busy"):
        stages, steps = r[label]["stages"], r[label]["prepare_steps"]
        assert set(stages) == {"decode", "request", "prepare", "encode", "metrics", "total"}
        assert {"tokenizer", "prepare_image (x3)", "stack_frames"} <= set(steps)
        for stage in (*stages.values(), *steps.values()):
            assert 0 < stage["p50_ms"] <= stage["p99_ms"]
    assert {"event_loop_to_worker", "worker_to_event_loop", "queue_to_waiting_thread", "thread_to_event_loop",
            "prepare_to_launch_via_event_loop", "prepare_to_launch_from_worker"} == set(r["hops_after_idle"])


def check_bench_overlap(out: Path) -> None:
    r = result(out, "bench_overlap", png=False)
    # Enqueued back to back or run alone: the same batches, the same kernels, the same bits.
    assert r["exactness"]["1"]["bitwise_equal"] and r["exactness"]["8"]["bitwise_equal"]
    assert [lv["robots"] for lv in r["fleet"]] == [1, 2]
    assert all(lv["obs_per_s"] > 0 for lv in r["fleet"])


def check_bench_ray(out: Path) -> None:
    r = result(out, "bench_ray", png=False)
    assert set(r["runs"]) == {"vlaserve_serve", "ray_1_replicas"}
    for run in r["runs"].values():
        assert run["exit_code"] == 0 and run["fleet"]["errors"] == 0 and run["openpi"]["n"] == 3
    assert set(r["ray_added_p50_ms"]) == {"metadata", "http_1step", "openpi"}


def check_tune_launch_tables(out: Path) -> None:
    r = result(out, "tune_launch_tables", png=True)
    assert r["smoke"] and r["start"] == "sm90"
    for family in ("splitk", "geglu", "qkv", "attention"):
        f = r["families"][family]
        # every candidate computed the starting config's function (a config's tiles cover every output)
        assert f["kept"] == f["tried"] == 2 and f["default_us"] > 0, (family, f)
        # the table written out holds the winner where it beat the starting config, else that config
        assert r["table"][family] == (f["best"] if f["best_us"] < f["default_us"] else f["default"]), family


def check_bench_encoded(out: Path) -> None:
    r = result(out, "bench_encoded", png=True)
    for size in ("224x224", "480x640"):
        rows = r["sizes"][size]
        # A JPEG body is smaller than the raw pixels', and a raw frame costs no encode or decode.
        assert rows["jpeg_q90"]["body_bytes"] < rows["raw"]["body_bytes"]
        assert rows["raw"]["client_encode_ms"] == rows["raw"]["server_decode_ms"] == 0.0
        assert rows["jpeg_q90"]["server_decode_ms"] > 0


SMOKE = {
    "bench_gpu": check_bench_gpu, "bench_pi0_gpu": check_bench_pi0_gpu, "bf16_error": check_bf16_error,
    "bench_memory": check_bench_memory, "bench_serve": check_bench_serve, "bench_fleet": check_bench_fleet,
    "bench_rtc": check_bench_rtc, "bench_prepare": check_bench_prepare, "bench_overlap": check_bench_overlap,
    "bench_ray": check_bench_ray, "bench_encoded": check_bench_encoded, "tune_launch_tables": check_tune_launch_tables,
}
# Modules the scripts import, not scripts.
LIBRARIES = {"common", "fleet_chaos", "fleet_model", "fleet_swap"}
SLOW = {"bench_gpu", "bench_memory", "bench_fleet", "bench_rtc", "bench_overlap", "bench_ray", "tune_launch_tables"}


def test_every_benchmark_has_a_smoke_check():
    scripts = {p.stem for p in BENCH.glob("*.py")} - LIBRARIES
    assert scripts <= set(SMOKE), f"bench scripts without a smoke check here: {sorted(scripts - set(SMOKE))}"


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SMOKE])
def test_smoke(script, tmp_path):
    run(script, tmp_path)
    SMOKE[script](tmp_path)


def test_bench_serve_startup(tmp_path):
    """--startup: two restarts (three with --same-host-restart), each answering its robots from /healthz
    on (the CPU's eager runtime has no graphs: every graph is "captured" at once, and none is ever
    captured on a request's path)."""
    run("bench_serve", tmp_path, "--startup", "--same-host-restart")
    r = json.loads((tmp_path / "bench_serve_startup.json").read_text())["startup"]
    assert set(r) == {"empty_compile_cache", "warm_compile_cache", "same_host_restart"}
    for start in r.values():
        assert start["server_exit_code"] == 0
        assert start["process_to_every_graph_s"] >= start["process_to_first_action_s"] > start["process_to_healthz_s"] > 0
        assert start["graphs"]["total"] == start["graphs"]["pending"] == 0
        assert start["request_path_captures"] == 0
        fleet = start["fleet"]
        assert fleet["robots"] == 2 and fleet["answers"] > 0 and fleet["errors"] == fleet["wrong"] == 0
        # a rate over at least the 0.5 s the robots keep sending after the last graph (here at once: no graphs)
        assert 0 < fleet["answers_per_s_after_capture"] <= fleet["answers"] / 0.5


@pytest.mark.slow
def test_bench_fleet_swap_weights(tmp_path):
    """--swap-weights: two updates in place under robots, none failed, every answer one version's (the golden
    checkpoint's and its perturbed copy's answers lie apart), none stale. (Which version answers how many depends
    on when batches ran on a busy CPU: not asserted.)"""
    run("bench_fleet", tmp_path, "--swap-weights")
    r = result(tmp_path, "bench_fleet_swap", png=True)["swap"]
    assert [u["success"] for u in r["updates"]] == [True, True] and r["references_apart"] > 0
    assert r["answers"] > 0 and r["failed_requests"] == r["answers_by_version"]["neither"] == r["stale_answers"] == 0


@pytest.mark.slow
def test_bench_gpu_golden_only_and_saved_actions(tmp_path):
    """--golden-only: both families' golden cases and the runtime's exactness checks; --actions saved
    by one run compare bit for bit in the next (the refactor gate, on the CPU's eager runner)."""
    saved = tmp_path / "before.pt"
    run("bench_gpu", tmp_path / "first", "--golden-only", "--actions", str(saved))
    run("bench_gpu", tmp_path / "second", "--golden-only", "--compare-actions", str(saved))
    r = result(tmp_path / "second", "golden_gpu", png=False)
    for family in ("pi05_golden", "pi0_golden"):
        # The golden tests' own tolerances (vlaserve.golden.tolerance): 1e-5, RTC's guided velocity more.
        assert all(case["exact_ok"] and not case["eager_beyond_tolerance"] for case in r[family]["cases"].values())
        assert r[family]["prefix_cache_hit_equals_miss"] and r[family]["overlapped_equals_serial"]
    assert [(v["bit_identical"], v["max_abs_diff"]) for v in r["actions_vs_saved"].values()] == [(True, 0.0)] * 2
    assert [v["rtc"] for v in r["actions_vs_saved"].values()] == [{"bit_identical": True, "max_abs_diff": 0.0}] * 2
    assert list(r["from_host_bit_identical"].values()) == [True] * 2  # the same inputs from host memory


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in LIBRARIES))
def test_help(script):
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--help"], capture_output=True, text=True,
                          env=ENV)
    assert proc.returncode == 0 and "--smoke" in proc.stdout and "--out" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_bench_gpu_batch_invariant(tmp_path):
    """--batch-invariant on the CPU: the default and the per-item eager runner timed, and the bit-identity
    check (every observation alone against each batch size at every position, from cache entries, without
    graphs) run and passed; its comparison also finds a planted mismatch."""
    run("bench_gpu", tmp_path, "--batch-invariant", "--batches", "1,2")
    r = result(tmp_path, "bench_gpu_invariant", png=True)
    assert set(r["timings"]) == {"1", "2"} and "cost_vs_default_served" in r["timings"]["2"]
    # 4 observations (the GPU run's 8): rotations of 1 and 2 (4 runs each), a cache-entry and a no-graphs run
    # per size
    assert r["bit_identity"] == {"observations": 4, "checked": 4 + 8 + 2 * (1 + 2), "identical": True,
                                 "mismatches": [], "mismatched": 0}
    sys.path.insert(0, str(BENCH))
    try:
        import torch
        from bench_gpu import bit_identity, rotations
    finally:
        sys.path.remove(str(BENCH))
    assert sorted(tuple(sorted(p for p, i in enumerate(items) if i == 3)) for items in rotations(4, 4)) == \
        [(0,), (1,), (2,), (3,)]  # observation 3 at every position once
    alone = torch.zeros(2, 3)
    planted = bit_identity(alone, [("x", [1, 0], torch.tensor([[0.0, 0, 0], [0, 1e-7, 0]]))])
    assert not planted["identical"] and planted["mismatches"][0]["observation"] == 0
