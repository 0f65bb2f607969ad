"""What the benchmarks share: the workload, timing, random models and checkpoints, servers, output.

Each benchmark is a script (`python bench/NAME.py --help`); this module puts the repository's
`src/`, `client/src/` and `tests/` (the golden fixtures) on sys.path, so the scripts run from a plain checkout.

The workload ("ALOHA-3"): 3 cameras of 224x224, prompts padded to 200 tokens (70 valid), a chunk of
50 x 32 actions, 10 flow steps. `--smoke` runs the same code on the CPU with the golden test
checkpoint's tiny sizes (tests/test_bench_smoke.py runs every script that way).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "client" / "src"), str(ROOT / "tests")]

from fixtures import fixture_dir  # noqa: E402  (stdlib only: unpacks tests/data's golden fixtures)
from vlaserve.checkpoint.weights import to_lerobot_name  # noqa: E402
from vlaserve.demo import random_model  # noqa: E402
from vlaserve.config import ModelConfig, PolicyConfig  # noqa: E402
from vlaserve.family import load_policy_config  # noqa: E402
from vlaserve.types import ModelInputs  # noqa: E402

CAMERA_NAMES = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
TOKENS, VALID_TOKENS, HORIZON, STEPS = 200, 70, 50, 10
RESULTS = ROOT / "bench" / "results"


def log(*args) -> None:
    print(*args, flush=True)


# ---- command line and output --------------------------------------------------------------------
def parser(doc: str) -> argparse.ArgumentParser:
    """The script's parser (its docstring as help), with the options every benchmark has."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS),
                    help="folder for the JSON (and PNG) (default: $OUT, else bench/results)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds on the CPU: the golden checkpoint's tiny sizes, a short run of the same code")
    return ap


def save_json(results: dict, out: str | Path, name: str) -> Path:
    """results as <out>/<name>.json (written whole, so a run killed midway leaves the last good copy)."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)
    return path


def pyplot():
    """matplotlib's pyplot, drawing to files (the `bench` extra installs it)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("the benchmarks draw their plots with matplotlib: pip install 'vlaserve[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out: str | Path, name: str) -> Path:
    path = Path(out) / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    return path


# ---- timing -------------------------------------------------------------------------------------
def time_ms(fn, device: str = "cuda", warmup: int = 3, iters: int = 20) -> dict:
    """p50 / p95 / min ms of `fn` after `warmup` calls: CUDA events around each call on a GPU (device
    time, launch overhead included), the host clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": statistics.median(times), "p95_ms": times[min(len(times) - 1, int(0.95 * len(times)))],
            "min_ms": times[0], "n": len(times)}


def time_graphed(fn, warmup: int = 3, iters: int = 20) -> dict:
    """time_ms of `fn` captured in one CUDA graph (run once before, so that its kernels are compiled
    and its buffers allocated): what the fast path's graphs pay, no launch overhead."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, "cuda", warmup=warmup, iters=iters)


def percentiles(ms: list[float]) -> dict:
    """p50 / p90 / p99 / max of host latencies in ms (nearest rank)."""
    ms = sorted(ms)
    at = lambda q: ms[min(len(ms) - 1, int(round(q * (len(ms) - 1))))]  # noqa: E731
    return {"p50_ms": statistics.median(ms), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": ms[-1], "n": len(ms)}


# ---- models and inputs --------------------------------------------------------------------------
def golden_checkpoint(family: str = "pi05") -> Path:
    """The golden test checkpoint of `family` (LeRobot 0.6.1, tiny sizes, random weights)."""
    return fixture_dir(f"{family}_golden") / "checkpoint"


def model_config(smoke: bool) -> ModelConfig:
    """Full-size Pi0.5 (SigLIP So400m, Gemma 2B + 300M), or with --smoke the golden checkpoint's tiny sizes."""
    return load_policy_config(golden_checkpoint()).model if smoke else ModelConfig.full_size()


def aloha_config(model: ModelConfig, max_token_len: int = TOKENS) -> PolicyConfig:
    return PolicyConfig(model, CAMERA_NAMES, 14, 14, max_token_len=max_token_len)


def bench_model(smoke: bool, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A random Pi0.5 (weights in `dtype` with the fp32 set, as served) and the ALOHA-3 policy config."""
    cfg = model_config(smoke)
    return random_model(cfg, dtype, device, seed=seed), aloha_config(cfg)


def random_prefix_inputs(g: torch.Generator, b: int, vocab: int, cameras: int = len(CAMERA_NAMES),
                         tokens: int = TOKENS, valid: int = VALID_TOKENS):
    """Images in [-1, 1] (every camera present) and prompts of `valid` random tokens padded to
    `tokens`, drawn from generator g on its device: (images, image_masks, tokens, token_mask)."""
    device = g.device
    images = torch.rand(b, cameras, 3, 224, 224, device=device, generator=g) * 2 - 1
    masks = torch.ones(b, cameras, dtype=torch.bool, device=device)
    ids = torch.randint(3, vocab, (b, tokens), device=device, generator=g)
    token_mask = torch.zeros(b, tokens, dtype=torch.bool, device=device)
    token_mask[:, :valid] = True
    ids[~token_mask] = 0
    return images, masks, ids, token_mask


def make_inputs(b: int, vocab: int, seed: int = 0, device: str = "cuda") -> tuple[ModelInputs, torch.Tensor]:
    """A batch of the ALOHA-3 workload and its flow noise, drawn from `seed` (the same draws on every tree)."""
    g = torch.Generator(device=device).manual_seed(seed)
    prefix = random_prefix_inputs(g, b, vocab)
    noise = torch.randn(b, HORIZON, 32, device=device, generator=g)
    return ModelInputs(*prefix), noise


def sample(runner, inputs: ModelInputs, noise: torch.Tensor, steps: int = STEPS, rtc=None, prefix=None,
           vision_slots: int | None = None) -> tuple[torch.Tensor, dict]:
    """One call through a runner (the Runner protocol: EagerRunner or FastRunner), waited for:
    (its actions, a copy the next call leaves alone; {prefix_ms, denoise_ms})."""
    actions, times = runner.dispatch(inputs, noise, steps, rtc, prefix, vision_slots)
    stages = times.read()
    return actions.clone(), stages


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def per_item_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|Δ| per batch item, averaged: one item's max is a noisy statistic."""
    return float((a.float() - b.float()).abs().flatten(1).max(1).values.mean())


def lerobot_policy(policy_cls, config_cls, state: dict, dtype: str, fp32_modules: tuple[str, ...],
                   device: str = "cuda"):
    """A LeRobot 0.6.1 policy (ALOHA-3 features) holding exactly `state` (LeRobot names), built on
    `device` in `dtype` with `fp32_modules` upcast as LeRobot keeps them."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    feats = {f"observation.images.{c}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224))
             for c in CAMERA_NAMES}
    feats["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(14,))
    out = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(32,))}
    torch.set_default_device(device)
    torch.set_default_dtype(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    try:
        policy = policy_cls(config_cls(device=device, dtype=dtype, input_features=feats, output_features=out))
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
    for name in fp32_modules:
        getattr(policy.model, name).float()
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if "lm_head" not in k]
    if missing or unexpected:
        raise RuntimeError(f"lerobot load: missing {missing[:5]} unexpected {unexpected[:5]}")
    return policy.eval()


# ---- checkpoints --------------------------------------------------------------------------------
SHARD_BYTES = 2 * 10**9


def write_checkpoint(directory: Path, template: Path, model_config: ModelConfig, device: str) -> int:
    """A LeRobot-layout checkpoint of a random model of `model_config` (serving dtypes: bf16 + the fp32
    set), sharded at ~SHARD_BYTES with an index. Config, processor and tokenizer files come from
    `template`; at full size not its architecture.json (without one, config.json's variant names
    give the full size). Returns the weight bytes."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model = random_model(model_config, torch.bfloat16, device, seed=1)
    tensors = {to_lerobot_name(n): p.detach() for n, p in model.named_parameters()}
    shards, current, size = [], [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    shards.append(current)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].cpu().contiguous() for k in names}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    full_size = model_config == ModelConfig.full_size()
    for path in template.iterdir():
        if path.name.startswith("model") or (full_size and path.name == "architecture.json"):
            continue
        if path.is_dir():
            shutil.copytree(path, directory / path.name)
        else:
            shutil.copy(path, directory / path.name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return total


def bench_checkpoint(smoke: bool, device: str, workdir: Path) -> Path:
    """The checkpoint a server benchmark serves: with --smoke (or on a CPU) the golden one; else a
    full-size random one written under `workdir`."""
    if smoke or device != "cuda":
        return golden_checkpoint()
    checkpoint = workdir / "pi05-random-full"
    if not checkpoint.exists():
        write_checkpoint(checkpoint, golden_checkpoint(), ModelConfig.full_size(), device)
    return checkpoint


def evict_from_page_cache(directory: Path) -> None:
    """Flushes the files and asks the kernel to drop their cached pages (no root needed)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def robot_observation(robot: int, state_dim: int, horizon: int, max_action_dim: int,
                      frame: tuple[int, int] = (224, 224)) -> dict:
    """Robot `robot`'s observation, LeRobot keys (3 uint8 cameras), with its own fixed flow noise."""
    rng = np.random.default_rng(1000 + robot)
    obs = {f"observation.images.{c}": rng.integers(0, 256, (*frame, 3), dtype=np.uint8) for c in CAMERA_NAMES}
    obs["observation.state"] = rng.uniform(-1, 1, state_dim).astype(np.float32)
    obs["prompt"] = f"robot {robot}: pick up the red block"
    obs["noise"] = rng.standard_normal((horizon, max_action_dim)).astype(np.float32)
    return obs


# ---- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict:
    """The environment of a `vlaserve` child process: this tree's src/ and client/src/ first on PYTHONPATH."""
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "client" / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def start_server(command: str, checkpoint: Path | None, options: list[str], log_path: Path,
                 env: dict | None = None, port: int | None = None) -> tuple[subprocess.Popen, int]:
    """`vlaserve COMMAND [CHECKPOINT] --port P OPTIONS` as a fresh process, its output in `log_path`;
    P is a free port unless given (a restart on the same one)."""
    port = port or free_port()
    args = [sys.executable, "-m", "vlaserve.cli", command, *([str(checkpoint)] if checkpoint else []),
            "--port", str(port), *options]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(args, env=env or server_env(), stdout=out, stderr=subprocess.STDOUT)
    return proc, port


def wait_until_healthy(proc: subprocess.Popen, port: int, log_path: Path, bound_s: float = 900) -> float:
    """Polls /healthz until it answers 200 (seconds waited); raises with the server's log if the
    process exits first or `bound_s` passes."""
    started = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return time.perf_counter() - started
        except OSError:  # refused, or 503 while the runtime warms up
            if time.perf_counter() - started > bound_s:
                raise RuntimeError(f"not healthy after {bound_s} s:\n{log_path.read_text()[-4000:]}") from None
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen, log_path: Path) -> tuple[int, str]:
    """Terminates the server: (its exit code, the tail of its log)."""
    proc.terminate()
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    tail = "\n".join(line for line in log_path.read_text(errors="replace").splitlines() if "loading weights" not in line)
    return code, tail[-3000:]
