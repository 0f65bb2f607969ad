"""GPU memory per memory profile, and cold start, of full-size Pi0.5 in one run (~5 minutes on an H200).

Part 1, profiles. For default, edge-16gb and offload, under per-process caps of 16 and 8 GiB
(torch.cuda.set_per_process_memory_fraction(cap / total)), at batch 1, 4 and 8, on a full-size random
model (bf16 + the fp32 set): first the startup fit check's verdict (its estimate, or "does not fit:
<message>"), then, where it fits, peak memory and p50 latency (CUDA events) of Policy calls. Peak memory is
torch.cuda.max_memory_allocated, plus max_memory_reserved: graph pools and cached blocks count there, and
it is what the cap limits. Batch 8 is where edge-16gb differs from default: like its server, it runs a
batch of 8 as two batches of 4.

Part 2, cold start. Writes a full-size LeRobot-layout checkpoint (random weights, ~2 GB shards + index,
config/processor/tokenizer files from the golden checkpoint), checks that runai-model-streamer (when
installed) loads every tensor bit for bit as safetensors does, then in fresh subprocesses measures import
time, each stage of Policy.from_pretrained (weight-load throughput among them), time to first action
(from_pretrained + the first infer, fast path on, blocking warm-up) and the second action's time: cold
(files evicted from the page cache, empty Triton cache) per loader, and with the read-ahead that
`vlaserve serve` starts; then warm (files cached, Triton kernels compiled).

    python bench/bench_memory.py [--out DIR] [--batches 1,4,8] [--caps-gib 16,8] [--iters N] [--skip-cold-start]
                                 [--skip-profiles] [--workdir DIR --keep-checkpoint]

Writes bench_memory.json and .png (bench_memory_cold_start.* with --skip-profiles). --smoke runs the
actions check and the cold start on the CPU (tiny sizes; the caps need a GPU).
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from common import (CAMERA_NAMES, STEPS, TOKENS, VALID_TOKENS, aloha_config, evict_from_page_cache,
                    golden_checkpoint, log, make_inputs, model_config, parser, pyplot, random_model, sample,
                    save_json, save_png, server_env, time_ms, write_checkpoint)
from vlaserve.checkpoint.weights import load_weights
from vlaserve.demo import build_model
from vlaserve.config import PROFILES, PolicyConfig, RuntimeConfig
from vlaserve.errors import InsufficientMemory
from vlaserve.runtime.memory import GIB, check_fit, cuda_budget
from vlaserve.runtime.runner import Runtime
from vlaserve.startup.engine import start


def release(device: str = "cuda") -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- part 1: profiles ------------------------------------------------------------------------
def policy_config(smoke: bool = False) -> PolicyConfig:
    return aloha_config(model_config(smoke))


def make_policy(profile, fast_path: bool = True, device: str = "cuda") -> Runtime:
    """A random model's runtime (full size; tiny on a CPU), placed and engined as `profile` says
    (what from_pretrained does after loading)."""
    config = policy_config(smoke=device != "cuda")
    model = random_model(config.model, torch.bfloat16, device, seed=0)
    settings = RuntimeConfig(device=device, memory_profile=profile.name, fast_path=fast_path)
    settings = replace(settings, prompt_buckets=settings.resolved_prompt_buckets(config.max_token_len, device))
    runtime = Runtime(model, config, settings, torch.device(device), torch.bfloat16, "bench")
    start(runtime)
    return runtime


def compare_actions(device: str = "cuda") -> dict:
    """Same weights, inputs and noise at batch 1: every profile's actions against `default` and
    against the eager model (fast_path=False). Expected: edge-16gb and offload == default bit for bit
    (same kernels; offload's prefix streams its layers outside graphs); "offload eager" (offload with
    fast_path=False) == eager bit for bit; default vs eager within bf16 rounding (~1e-2, other kernels)."""
    inputs, noise = make_inputs(1, policy_config(device != "cuda").model.vlm.vocab_size, seed=7, device=device)
    actions = {}
    runs = {"eager": ("default", False), **{name: (name, True) for name in PROFILES}, "offload eager": ("offload", False)}
    for name, (profile, fast_path) in runs.items():
        policy = make_policy(PROFILES[profile], fast_path=fast_path, device=device)
        actions[name] = sample(policy.runner, inputs, noise, STEPS)[0].float().cpu()
        del policy
        release(device)
    report = {}
    for name, a in actions.items():
        report[name] = {"vs_default_max_abs": float((a - actions["default"]).abs().max()),
                        "vs_eager_max_abs": float((a - actions["eager"]).abs().max()),
                        "bit_identical_to_default": bool(torch.equal(a, actions["default"])),
                        "bit_identical_to_eager": bool(torch.equal(a, actions["eager"]))}
        log(f"actions {name}:", json.dumps(report[name]))
    return report


def run_parts(policy: Runtime, parts: list) -> None:
    for inputs, noise in parts:
        sample(policy.runner, inputs, noise, STEPS)


def profile_runs(profile, cap_gib: float, batches: list[int], iters: int) -> dict:
    """Fit check at each batch size under the cap; then peak memory and latency where it fits."""
    config = policy_config()
    shapes = {n: tuple(p.shape) for n, p in build_model(config.model).named_parameters()}
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * GIB / total)
    release()
    torch.cuda.set_per_process_memory_fraction(fraction)
    runs = {}
    for b in batches:
        try:
            estimate = check_fit(shapes, config, torch.bfloat16, profile, b, cuda_budget(torch.device("cuda")))
            runs[b] = {"fits": True, "estimate": estimate.as_dict()}
        except InsufficientMemory as e:
            runs[b] = {"fits": False, "message": f"does not fit: {e}"}
            log(f"{profile.name} cap {cap_gib} GiB b={b}: does not fit: {e}")
    fitting = [b for b in batches if runs[b]["fits"]]
    if not fitting:
        torch.cuda.set_per_process_memory_fraction(1.0)
        return runs
    # Built without the cap (random_model starts in float32, 13 GB); measured under it.
    torch.cuda.set_per_process_memory_fraction(1.0)
    policy = make_policy(profile)
    release()
    torch.cuda.set_per_process_memory_fraction(fraction)
    chunk = profile.batch_limit(max(batches))
    for b in fitting:
        # Like the server under this profile: a batch above its batch limit runs as several batches.
        parts = [make_inputs(min(chunk, b - start), config.model.vlm.vocab_size, seed=start)
                 for start in range(0, b, chunk)]
        call = functools.partial(run_parts, policy, parts)
        torch.cuda.reset_peak_memory_stats()
        try:
            copied = policy.offload.bytes_copied if policy.offload is not None else 0
            call()
            copied = policy.offload.bytes_copied - copied if policy.offload is not None else 0
            timed = time_ms(call, warmup=1, iters=iters)
        except torch.cuda.OutOfMemoryError as e:  # the estimate was too low: report it, keep going
            runs[b]["oom"] = str(e).splitlines()[0]
            log(f"{profile.name} cap {cap_gib} GiB b={b}: OOM despite the fit check: {runs[b]['oom']}")
            release()
            continue
        runs[b].update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                       p50_ms=timed["p50_ms"], min_ms=timed["min_ms"], weight_bytes_streamed_per_call=copied)
        log(f"{profile.name} cap {cap_gib} GiB b={b}: estimate {runs[b]['estimate']['total'] / GIB:.2f} GiB, "
            f"peak allocated {runs[b]['peak_allocated'] / GIB:.2f} GiB, reserved {runs[b]['peak_reserved'] / GIB:.2f}"
            f" GiB, p50 {runs[b]['p50_ms']:.1f} ms")
    del policy, parts, call
    release()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return runs


# ---- part 2: cold start ----------------------------------------------------------------------
# Runs in a fresh interpreter so that imports and first-time initialization are timed as a server sees them.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
checkpoint, device, loader, ahead = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if ahead:  # as `vlaserve serve` does: start reading the weight files before the heavy imports
    from pathlib import Path
    from vlaserve.checkpoint.files import read_ahead
    reader = read_ahead(Path(checkpoint))
import numpy as np
import torch
from vlaserve import Policy
imported = time.perf_counter()
policy = Policy.from_pretrained(checkpoint, device=device, dtype="bfloat16", progress=False, weights_loader=loader,
                                warmup="blocking")
loaded = time.perf_counter()
rng = np.random.default_rng(0)
obs = {"images": {c: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for c in policy.config.cameras},
       "state": rng.uniform(-1, 1, policy.config.state_dim).astype(np.float32), "task": "pick up the red block"}
policy.infer(obs, seed=0)
first = time.perf_counter()
policy.infer(obs, seed=1)
second = time.perf_counter()
print(json.dumps({"import_s": imported - t0, "from_pretrained_s": loaded - imported,
                  **{"load_" + k: v for k, v in policy.load_timings.items()},
                  "read_ahead_s": reader.seconds if ahead and reader else None,
                  "first_infer_s": first - loaded, "time_to_first_action_s": first - imported,
                  "process_to_first_action_s": first - t0, "second_action_ms": (second - first) * 1e3,
                  "fast_path": policy.metadata["fast_path"]}))
"""


def start_once(checkpoint: Path, device: str, env: dict, loader: str, ahead: bool) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), device, loader, "1" if ahead else "0"],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cold-start child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["subprocess_wall_s"] = time.perf_counter() - started
    return result


def compare_loaders(checkpoint: Path, device: str, config) -> dict:
    """Every tensor through safetensors and through runai-model-streamer, compared bit for bit."""
    loaded = {}
    for loader in ("safetensors", "runai-streamer"):
        model = load_weights(build_model(config), checkpoint, torch.bfloat16, torch.device(device),
                             progress=False, loader=loader)
        loaded[loader] = dict(model.named_parameters())
    a, b = loaded["safetensors"], loaded["runai-streamer"]
    differing = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    compared = len(a) if a.keys() == b.keys() else None
    del loaded, a, b
    release(device)
    return {"tensors_compared": compared, "differing": differing[:10], "bit_identical": compared and not differing}


def cold_start(template: Path, workdir: Path, model_config, device: str, smoke: bool = False) -> dict:
    """Fresh processes from a cold page cache and an empty Triton cache, per weight loader (and with
    the read-ahead `vlaserve serve` starts before importing torch); then one warm start. --smoke:
    safetensors alone, then warm."""
    checkpoint = workdir / "pi05-random-full"
    if not checkpoint.exists():
        checkpoint.mkdir(parents=True)
        write_checkpoint(checkpoint, template, model_config, device)
    weight_bytes = sum(f.stat().st_size for f in checkpoint.glob("model-*.safetensors"))
    out = {"weight_file_bytes": weight_bytes, "shards": len(list(checkpoint.glob("model-*.safetensors"))),
           "page_cache_note": "cold = files evicted with fsync + POSIX_FADV_DONTNEED, empty TRITON_CACHE_DIR"}
    release(device)
    base_env = server_env(HF_HUB_OFFLINE="1")
    runs = [("safetensors", False)] if smoke else [("safetensors", False), ("safetensors", True)]
    if importlib.util.find_spec("runai_model_streamer") is not None:
        if not smoke:
            runs.insert(0, ("runai-streamer", False))  # first: it leaves the page cache cold for the next run
        out["loaders_bit_identical"] = compare_loaders(checkpoint, device, model_config)
        log("loaders:", json.dumps(out["loaders_bit_identical"]))
    for loader, ahead in runs:
        name = f"cold {loader}{' + read-ahead' if ahead else ''}"
        evict_from_page_cache(checkpoint)
        env = {**base_env, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-cold-", dir=workdir)}
        out[name] = start_once(checkpoint, device, env, loader, ahead)
        log(f"{name}:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out[name].items()}))
    # Warm: files cached by the safetensors run before, Triton kernels compiled by it.
    out["warm safetensors"] = start_once(checkpoint, device, env, "safetensors", False)
    log("warm safetensors:", json.dumps(out["warm safetensors"]))
    return out


# ---- report ----------------------------------------------------------------------------------
def print_tables(results: dict) -> None:
    log("\n| profile | cap | batch | fit check | estimate GiB | peak allocated GiB | peak reserved GiB | p50 ms |")
    log("|---|---|---|---|---|---|---|---|")
    for name, caps in results.get("profiles", {}).items():
        for cap, runs in caps.items():
            for b, r in runs.items():
                if not r["fits"]:
                    log(f"| {name} | {cap} GiB | {b} | does not fit | | | | |")
                    continue
                measured = (f"{r['peak_allocated'] / GIB:.2f} | {r['peak_reserved'] / GIB:.2f} | {r['p50_ms']:.1f}"
                            if "p50_ms" in r else f"OOM: {r.get('oom', '?')} | | ")
                log(f"| {name} | {cap} GiB | {b} | fits | {r['estimate']['total'] / GIB:.2f} | {measured} |")
    cold = results.get("cold_start")
    if cold:
        log("\n| start | import s | config s | device s | weights s | GB/s | engine s | from_pretrained s | "
            "first infer s | process to first action s | second action ms |")
        log("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in cold_runs(cold):
            log(f"| {name} | {r['import_s']:.2f} | {r['load_config_s']:.2f} | {r['load_device_s']:.2f} | "
                f"{r['load_weights_s']:.2f} | {r['load_weights_gb_per_s'] or float('nan'):.2f} | {r['load_engine_s']:.2f} | "
                f"{r['from_pretrained_s']:.2f} | {r['first_infer_s']:.2f} | {r['process_to_first_action_s']:.2f} | "
                f"{r['second_action_ms']:.1f} |")


def cold_runs(cold: dict) -> list[tuple[str, dict]]:
    return [(name, r) for name, r in cold.items() if isinstance(r, dict) and "import_s" in r]


def plot(results: dict, out: str, stem: str) -> None:
    plt = pyplot()
    profiles = results.get("profiles", {})
    caps = sorted({cap for caps in profiles.values() for cap in caps}, key=float, reverse=True)
    fig, axes = plt.subplots(1, len(caps) + 2, figsize=(5 * (len(caps) + 2), 4.5))
    for ax, cap in zip(axes, caps):
        labels, reserved, allocated, estimates, notes = [], [], [], [], []
        for name, by_cap in profiles.items():
            for b, r in by_cap.get(cap, {}).items():
                labels.append(f"{name}\nb={b}")
                reserved.append(r.get("peak_reserved", 0) / GIB)
                allocated.append(r.get("peak_allocated", float("nan")) / GIB)
                estimates.append(r["estimate"]["total"] / GIB if r["fits"] else float("nan"))
                notes.append("refused" if not r["fits"] else "OOM" if "oom" in r else "")
        x = np.arange(len(labels))
        ax.bar(x, reserved, label="peak reserved (measured)")
        ax.scatter(x, allocated, color="white", edgecolor="black", s=25, label="peak allocated (measured)", zorder=3)
        ax.scatter(x, estimates, color="black", marker="_", s=200, label="estimate (fit check)", zorder=3)
        for i, note in enumerate(notes):
            if note:
                ax.text(i, 0.2, note, rotation=90, ha="center", va="bottom", fontsize=8)
        ax.axhline(float(cap), color="red", linestyle="--", label=f"cap {cap} GiB")
        ax.set_xticks(x, labels, fontsize=6)
        ax.set_ylabel("GiB")
        ax.set_title(f"device memory under a {cap} GiB cap")
        ax.legend(fontsize=7)
    ax = axes[len(caps)]
    for name, by_cap in profiles.items():
        runs = by_cap.get(caps[0], {}) if caps else {}
        points = [(int(b), r["p50_ms"]) for b, r in runs.items() if "p50_ms" in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("p50 per batch (ms)")
    ax.set_title(f"latency (cap {caps[0] if caps else '-'} GiB)")
    ax.legend(fontsize=7)
    ax = axes[len(caps) + 1]
    cold = results.get("cold_start")
    if cold:
        runs = cold_runs(cold)
        names = [name.replace(" + ", "\n+ ").replace(" ", "\n", 1) for name, _ in runs]
        bottom = np.zeros(len(runs))
        for key, label in (("import_s", "import"), ("load_config_s", "config + tokenizer"),
                           ("load_device_s", "CUDA init + fit check"), ("load_weights_s", "load weights"),
                           ("load_engine_s", "engine (kernels, graphs)"), ("first_infer_s", "first infer")):
            values = np.array([r[key] for _, r in runs])
            ax.bar(names, values, bottom=bottom, label=label)
            bottom += values
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel("seconds from process start")
        ax.set_title("time to first action (in-process API, blocking warm-up)")
        ax.legend(fontsize=7)
    fig.suptitle(f"Pi0.5 memory profiles and cold start on {results.get('gpu', '?')}")
    fig.tight_layout()
    save_png(fig, out, stem)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--batches", default="1,4,8", help="batch sizes (default: 1,4,8)")
    ap.add_argument("--caps-gib", default="16,8", help="per-process memory caps in GiB (default: 16,8)")
    ap.add_argument("--iters", type=int, default=8, help="timed calls per measurement (default: 8)")
    ap.add_argument("--golden", default=str(golden_checkpoint()),
                    help="checkpoint whose config, processor and tokenizer files the cold-start checkpoint copies")
    ap.add_argument("--workdir", default=None, help="where the cold-start checkpoint is written (default: a temp dir)")
    ap.add_argument("--skip-cold-start", action="store_true")
    ap.add_argument("--skip-profiles", action="store_true", help="only the cold start (part 2)")
    ap.add_argument("--keep-checkpoint", action="store_true", help="leave the cold-start checkpoint in --workdir")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_memory needs a CUDA device (--smoke runs on the CPU)")
    batches = [int(b) for b in args.batches.split(",")]
    caps = [float(c) for c in args.caps_gib.split(",")] if device == "cuda" else []  # caps: CUDA's allocator
    results: dict = {"device": device, "smoke": args.smoke, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "total_memory": torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None,
                     "workload": {"cameras": len(CAMERA_NAMES), "tokens": TOKENS, "valid_tokens": VALID_TOKENS,
                                  "steps": STEPS, "batches": batches, "caps_gib": caps}, "profiles": {}}
    started = time.time()
    stem = "bench_memory_cold_start" if args.skip_profiles else "bench_memory"

    def save():
        results["elapsed_s"] = time.time() - started
        save_json(results, args.out, stem)

    if not args.skip_profiles:
        results["actions_b1"] = compare_actions(device)
        save()
        for name, profile in PROFILES.items():
            results["profiles"][name] = {}
            for cap in caps:
                results["profiles"][name][f"{cap:g}"] = profile_runs(profile, cap, batches, args.iters)
                save()
    if not args.skip_cold_start:
        workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vlaserve-cold-"))
        try:
            results["cold_start"] = cold_start(Path(args.golden), workdir, model_config(args.smoke), device, args.smoke)
        finally:
            if not args.keep_checkpoint:
                shutil.rmtree(workdir, ignore_errors=True)
        save()
    print_tables(results)
    plot(results, args.out, stem)
    log(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
