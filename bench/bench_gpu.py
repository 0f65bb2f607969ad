"""GPU benchmark of Pi0.5 on the "ALOHA-3" workload, ours against LeRobot 0.6.1, in one run.

Full-size Pi0.5 with random weights (bf16 + fp32 set), 3 cameras 224x224, prompts padded to
200 tokens (70 valid) -> 968 prefix tokens, chunk 50x32, 10 steps; batch 1, 2, 4, 8.

    python bench/bench_gpu.py [--lerobot] [--tune] [--batches 1,2,4,8] [--golden DIR] [--out DIR]

From a clean checkout: `bench/prepare_device.sh` here (golden copy + wheels), then one device call
carrying `.golden` and `.whl` (the script's header has the command).

Checks first (max|Δ| of actions between variants), then times each variant with CUDA events
after warm-up, and writes JSON + PNG under bench/results/ (and --out). The GEMM ceiling is
measured twice: in a burst, and sustained at the GPU's power limit (the batch-8 floor is given at
both); NVML's SM clock and board power are read while each batch size's default path is timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlaserve.checkpoint.weights import random_model, to_lerobot_name  # noqa: E402
from vlaserve.config import ATTENTION_LIBRARIES, GEMM_LIBRARIES, ModelConfig, PolicyConfig, RuntimeConfig  # noqa: E402
from vlaserve.model.pi05 import Pi05Model  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402
from vlaserve.types import ModelInputs  # noqa: E402

CAMERAS, TOKENS, VALID_TOKENS, HORIZON, STEPS = 3, 200, 70, 50, 10
sys.path.insert(0, str(ROOT / "tests"))
from fixtures import fixture_dir  # noqa: E402  (unpacks the repository's golden fixtures)

GOLDEN = str(fixture_dir("pi05_golden"))


def flops_per_call(model: Pi05Model, num_cameras: int, token_len: int, horizon: int, steps: int) -> dict:
    """Matrix FLOPs of one call at batch 1 (for achieved-rate reporting)."""
    v, g, e = model.vision.dims, model.vlm.dims, model.expert.dims
    n_img = num_cameras * v.num_patches
    vis = 2 * n_img * v.depth * (4 * v.width * v.num_heads * v.head_dim + 2 * v.width * v.mlp_dim) \
        + 4 * n_img * v.num_patches * v.num_heads * v.head_dim * v.depth
    p = n_img + token_len
    qkv = g.width * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
    per_tok = 2 * (qkv + g.num_heads * g.head_dim * g.width + 3 * g.width * g.mlp_dim)
    prefix = p * per_tok * g.depth + 4 * p * p * g.num_heads * g.head_dim * (g.depth - 1)
    e_qkv = e.width * (e.num_heads + 2 * e.num_kv_heads) * e.head_dim
    e_params = e_qkv + e.num_heads * e.head_dim * e.width + 3 * e.width * e.mlp_dim
    expert_bytes = 2 * e_params * e.depth  # bf16 weights read once per step
    return {"vision_flop": vis, "prefix_flop": prefix, "expert_weight_bytes_per_step": expert_bytes,
            "expert_flop_per_step": 2 * horizon * e_params * e.depth + 4 * horizon * (p + horizon) * e.num_heads * e.head_dim * e.depth}


def math_floor_ms(flops: dict, steps: int, tflops: float, tbps: float) -> float:
    compute = (flops["vision_flop"] + flops["prefix_flop"]) / (tflops * 1e12) * 1e3
    memory = flops["expert_weight_bytes_per_step"] * steps / (tbps * 1e12) * 1e3
    return compute + memory


def floor_ms_batched(flops: dict, b: int, steps: int, ceilings: dict) -> float:
    """Batch b: the prefix's FLOPs at the GEMM ceiling, plus the expert's larger of its FLOPs at
    that ceiling and one read of its weights per step."""
    tflops, tbps = ceilings["bf16_gemm_tflops"] * 1e12, ceilings["copy_tbps"] * 1e12
    prefix = b * (flops["vision_flop"] + flops["prefix_flop"]) / tflops
    expert = steps * max(b * flops["expert_flop_per_step"] / tflops, flops["expert_weight_bytes_per_step"] / tbps)
    return (prefix + expert) * 1e3


def log(*args):
    print(*args, flush=True)


def time_cuda(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"p50_ms": statistics.median(times), "p95_ms": times[min(len(times) - 1, int(0.95 * len(times)))],
            "min_ms": times[0], "n": len(times)}


def time_graphed(fn, warmup=3, iters=20):
    """time_cuda of `fn` captured in one CUDA graph (run once before, so that its kernels are
    compiled and its buffers allocated): what the fast path's graphs pay, no launch overhead."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, warmup=warmup, iters=iters)


class PowerSampler:
    """The SM clock and board power, read by NVML every few ms while a block runs: whether it ran
    at the power limit (the H200 holds 700 W by lowering its clock; run 86). Empty without NVML."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s, self.result, self._samples = interval_s, {}, []
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # NVML is a reading aid, not a requirement of the bench
            self._nvml = None

    def read(self) -> dict:
        """One reading now: {sm_mhz, power_w}, or {} without NVML."""
        if self._nvml is None:
            return {}
        nvml = self._nvml
        return {"sm_mhz": nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM),
                "power_w": nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3}

    def _run(self):
        while not self._stop.is_set():
            self._samples.append(self.read())
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if self._nvml is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._nvml is not None:
            self._stop.set()
            self._thread.join()
            if self._samples:
                clocks = [r["sm_mhz"] for r in self._samples]
                self.result = {"sm_mhz_mean": statistics.mean(clocks), "sm_mhz_min": min(clocks),
                               "power_w_mean": statistics.mean(r["power_w"] for r in self._samples),
                               "samples": len(self._samples)}
        return False


def hold(fn, seconds: float):
    """Runs fn back to back for `seconds` (synchronizing every few calls): what follows is timed at
    the clock the GPU holds under that load (at its power limit for GEMMs)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()


def ceilings():
    """The bf16 GEMM ceiling twice: a short burst (10 products of 8192^3 at full clock) and
    sustained (after 3 s of back-to-back products, at the power limit: the rate a batch-8 call made
    only of GEMMs would hold), and the device-to-device copy rate."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flop = 2 * 8192**3
    torch.cuda.synchronize()
    time.sleep(2.0)  # start cool: the burst figure is the full-clock one
    t = time_cuda(lambda: a @ b, warmup=3, iters=10)["p50_ms"]
    hold(lambda: a @ b, 3.0)
    with PowerSampler() as power:
        ts = time_cuda(lambda: a @ b, warmup=0, iters=20)["p50_ms"]
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    tc = time_cuda(lambda: y.copy_(x), warmup=2, iters=10)["p50_ms"]
    return {"bf16_gemm_tflops": flop / (t * 1e-3) / 1e12, "bf16_gemm_tflops_sustained": flop / (ts * 1e-3) / 1e12,
            "sustained_nvml": power.result, "copy_tbps": 2 * x.numel() / (tc * 1e-3) / 1e12}


def at_sustained(ceiling: dict) -> dict:
    return {**ceiling, "bf16_gemm_tflops": ceiling["bf16_gemm_tflops_sustained"]}


def random_prefix_inputs(g, b: int, vocab: int, cameras: int = CAMERAS, tokens: int = TOKENS,
                         valid: int = VALID_TOKENS):
    """Images in [-1, 1] (every camera present) and prompts of `valid` random tokens padded to
    `tokens`, drawn from generator g: (images, image_masks, tokens, token_mask) on the GPU."""
    images = torch.rand(b, cameras, 3, 224, 224, device="cuda", generator=g) * 2 - 1
    masks = torch.ones(b, cameras, dtype=torch.bool, device="cuda")
    ids = torch.randint(3, vocab, (b, tokens), device="cuda", generator=g)
    token_mask = torch.zeros(b, tokens, dtype=torch.bool, device="cuda")
    token_mask[:, :valid] = True
    ids[~token_mask] = 0
    return images, masks, ids, token_mask


def default_bucket(tokens: int = TOKENS) -> int:
    """The prompt length the server pads a VALID_TOKENS prompt to on CUDA by default (the "auto"
    prompt bucket), or the checkpoint's `tokens`."""
    return min([b for b in RuntimeConfig().resolved_prompt_buckets(tokens, "cuda") if b >= VALID_TOKENS],
               default=tokens)


def bucketed(inputs: ModelInputs, length: int) -> ModelInputs:
    """The batch with its prompts cut to `length` tokens (its valid tokens all fit: only padding goes)."""
    assert not inputs.token_mask[:, length:].any()
    return ModelInputs(inputs.images, inputs.image_masks, inputs.tokens[:, :length].contiguous(),
                       inputs.token_mask[:, :length].contiguous(), inputs.state, inputs.pending)


def make_inputs(b: int, vocab: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    prefix = random_prefix_inputs(g, b, vocab)
    noise = torch.randn(b, HORIZON, 32, device="cuda", generator=g)
    return ModelInputs(*prefix), noise


def eager(model, inputs, noise):
    with torch.no_grad():
        return model.sample(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask, noise, STEPS)


def served_call(engine, inputs, noise):
    """One call as the server makes it: Runtime.launch reads the camera slots in use from the host
    batch and passes them on, so nothing in the timed window waits on the device (FastRunner.sample
    without them reads the masks back: a device round trip before the graphs are launched). Every
    camera of the bench's inputs is present."""
    return engine.sample(inputs, noise, STEPS, None, vision_slots=CAMERAS)


def maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def per_item_max(a, b) -> float:
    return float((a.float() - b.float()).abs().flatten(1).max(1).values.mean())


def lerobot_policy(policy_cls, config_cls, state: dict, dtype: str, fp32_modules: tuple[str, ...]):
    """A LeRobot 0.6.1 policy (ALOHA-3 features) holding exactly `state` (LeRobot names), built on the
    GPU in `dtype` with `fp32_modules` upcast as LeRobot keeps them."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    feats = {f"observation.images.{c}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224))
             for c in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")}
    feats["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(14,))
    out = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(32,))}
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    try:
        policy = policy_cls(config_cls(device="cuda", dtype=dtype, input_features=feats, output_features=out))
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


def build_lerobot(model, dtype: str):
    """LeRobot 0.6.1's PI05 (eager) holding exactly our weights."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    return lerobot_policy(PI05Policy, PI05Config, {to_lerobot_name(n): p for n, p in model.named_parameters()},
                          dtype, ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"))


def lerobot_sample(policy, inputs, noise):
    imgs = [inputs.images[:, i] for i in range(CAMERAS)]
    masks = [inputs.image_masks[:, i] for i in range(CAMERAS)]
    with torch.no_grad():
        return policy.model.sample_actions(imgs, masks, inputs.tokens, inputs.token_mask, noise=noise)


def golden_check(golden: Path) -> dict:
    """The CPU golden tests, rerun on the GPU: fp32 eager, then the fp32 fast path."""
    from vlaserve import Policy
    from vlaserve.golden import GoldenCase, case_dirs, compare_case

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    policy = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="float32", progress=False,
                                    fast_path=False)
    fast_policy = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="float32", progress=False)
    for case_dir in case_dirs(golden):
        case = GoldenCase.load(case_dir)
        exact, deltas = compare_case(policy, case)
        eager_worst = max(deltas.values())
        results = fast_policy.infer_batch(case.observations(), noise=list(case.tensors["input.noise"]),
                                          num_steps=case.meta["num_steps"], rtcs=case.rtcs())
        fast = max(float(abs(r.actions - e).max()) for r, e in zip(results, case.tensors["expected.actions"]))
        out[case_dir.name] = {"exact_ok": all(exact.values()), "eager_cuda_max_delta": eager_worst,
                              "fast_cuda_actions_max_delta": fast}
    return out


def policy_wall_time(model, engine) -> dict:
    """Policy.infer at batch 1 with host preprocessing (uint8 images, prompt, tokenizer) included."""
    import numpy as np

    from vlaserve import Policy
    from vlaserve.config import RuntimeConfig
    from vlaserve.processing.normalize import Normalization, QuantileNormalizer
    from vlaserve.processing.pipeline import ProcessorPipeline
    from vlaserve.processing.prepare import Preprocessor
    from vlaserve.processing.prompt import PromptTokenizer
    from vlaserve.family import PI05
    from vlaserve.runtime.runner import Runtime

    golden = Path(GOLDEN) / "checkpoint" / "tokenizer" / "tokenizer.json"
    cfg = engine.config
    q = QuantileNormalizer(-np.ones(32, np.float32), np.ones(32, np.float32))
    runtime = Runtime(model, cfg, RuntimeConfig(device="cuda", fast_path=False), torch.device("cuda"),
                      torch.bfloat16, "bench")
    runtime.runner, runtime.fast_path = engine, True
    policy = Policy(cfg, Preprocessor(cfg, ProcessorPipeline(Normalization(q, q, "bench")),
                                      PromptTokenizer.from_path(golden), PI05),
                    runtime, "bench", "bench", {})
    rng = np.random.default_rng(0)
    obs = {"images": {c: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for c in cfg.cameras},
           "state": rng.uniform(-1, 1, 14).astype(np.float32), "task": "pick up the red block"}
    for _ in range(3):
        policy.infer(obs, seed=0)
    walls, gpus = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        r = policy.infer(obs, seed=0)
        walls.append((time.perf_counter() - t0) * 1e3)
        gpus.append(r.timings["prefix_ms"] + r.timings["denoise_ms"])
    return {"wall_p50_ms": statistics.median(walls), "gpu_p50_ms": statistics.median(gpus),
            "preprocess_p50_ms": statistics.median([policy.infer(obs, seed=0).timings["preprocess_ms"]
                                                    for _ in range(5)])}


def tune_expert_kernels(model) -> dict:
    """Sweeps the expert-step kernels' launch configs at the batch-1 shapes (graph-timed) and
    keeps the fastest in kernels.TUNING for the rest of the run."""
    import itertools

    import triton.testing

    from vlaserve.runtime.fast import kernels

    e = model.expert.dims
    r, w, mlp, d = HORIZON, e.width, e.mlp_dim, e.head_dim
    hq = e.num_heads
    dev, bf = "cuda", torch.bfloat16
    x_w = torch.randn(r, w, device=dev, dtype=bf)
    x_attn = torch.randn(r, hq * d, device=dev, dtype=bf)
    x_act = torch.randn(r, mlp, device=dev, dtype=bf)
    h = torch.randn(r, w, device=dev, dtype=bf)
    # Every layer's weights in turn, as in a real step: a single layer's would sit in L2.
    layers = model.expert.layers
    w_qkv = [torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight]) for l in layers]
    w_gu = [torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]) for l in layers]
    w_o = [l.self_attn.o_proj.weight for l in layers]
    w_down = [l.mlp.down_proj.weight for l in layers]
    gate, ones, zeros = torch.ones(w, device=dev, dtype=bf), torch.ones(w, device=dev), torch.zeros(w, device=dev)
    cos, sin = torch.rand(r, d // 2, device=dev), torch.rand(r, d // 2, device=dev)
    t = 1024
    kc = [torch.randn(1, t, d, device=dev, dtype=bf) for _ in layers]
    vc = [torch.randn(1, t, d, device=dev, dtype=bf) for _ in layers]
    bias = torch.zeros(1, t, device=dev)
    bias[:, 900:] = -2.3819763e38
    q = torch.randn(1, hq * r, d, device=dev, dtype=bf)
    n_layers = len(layers)

    def bench(fn):
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=30) / n_layers

    families = {
        "splitk": ([{"block_r": 64, "block_n": bn, "block_k": bk, "max_waves": mw, "warps": 4, "stages": st}
                    for bn, bk, mw, st in itertools.product((32, 64), (128, 256), (1, 2, 4), (3, 4))],
                   lambda: [(kernels.linear_residual_norm(x_attn, wo, h, gate, ones, zeros, 1e-6),
                             kernels.linear_residual_norm(x_act, wd, h, gate, ones, zeros, 1e-6))
                            for wo, wd in zip(w_o, w_down)]),
        "geglu": ([{"block_r": 64, "block_n": bn, "block_k": bk, "warps": 4, "stages": st}
                   for bn, bk, st in itertools.product((16, 32), (64, 128, 256), (3, 4, 5))],
                  lambda: [kernels.geglu_linear(x_w, wgu) for wgu in w_gu]),
        "qkv": ([{"block_r": 64, "block_n": bn, "block_k": bk, "warps": wp, "stages": st}
                 for bn, bk, wp, st in itertools.product((16, 32), (64, 128, 256), (4,), (3, 4, 5))],
                lambda: [kernels.qkv_rope_into_cache(x_w, cos, sin, k[:, :r], v[:, :r], hq, r, w_qkv=wq)
                         for wq, k, v in zip(w_qkv, kc, vc)]),
        "attention": ([{"block_m": bm, "splits": sp, "block_t": bt, "warps": wp, "stages": 2}
                       for bm, sp, bt, wp in [(16, 8, 64, 4), (16, 16, 64, 4), (32, 4, 64, 8), (32, 8, 64, 4),
                                              (32, 8, 64, 8), (32, 16, 64, 4), (64, 8, 64, 8), (64, 16, 64, 8),
                                              (64, 4, 128, 8), (128, 8, 64, 8)]],
                      lambda: [kernels.mqa_attention(q, k, v, bias, hq, r, kernels.TUNING["attention"])
                               for k, v in zip(kc, vc)]),
    }
    report = {}
    for name, (configs, fn) in families.items():
        default = dict(kernels.TUNING[name])
        timed = []
        for cfg in configs:
            kernels.TUNING[name] = cfg
            try:
                timed.append((bench(fn) * 1e3, cfg))
            except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                log(f"tune {name} {cfg}: {type(exc).__name__}")
        kernels.TUNING[name] = default
        default_us = bench(fn) * 1e3
        best_us, best = min(timed, key=lambda tc: tc[0])
        kernels.TUNING[name] = best if best_us < default_us else default
        report[name] = {"default_us": default_us, "best_us": best_us, "best": best,
                        "all": [{"us": us, **cfg} for us, cfg in sorted(timed, key=lambda tc: tc[0])]}
        log(f"tune {name}: default {default_us:.2f} us -> best {best_us:.2f} us {best}")
    return report


def speed_options(engine, model, vocab: int) -> dict:
    """Options at batch 1: the exact prefix cache (hit vs miss), an absent camera."""
    inputs, noise = make_inputs(1, vocab, seed=123)
    miss, miss_t = engine.sample(inputs, noise, STEPS, None)
    cached = [engine.prefix_entry(0)]
    hit, _ = engine.sample(inputs, noise, STEPS, None, prefix=cached)
    hit_t = time_cuda(lambda: engine.sample(inputs, noise, STEPS, None, prefix=cached))
    full = time_cuda(lambda: engine.sample(inputs, noise, STEPS, None))
    # Two cameras present, the third absent (masked, last slot): the vision tower skips it.
    masks = inputs.image_masks.clone()
    masks[:, 2] = False
    two = ModelInputs(inputs.images, masks, inputs.tokens, inputs.token_mask)
    two_out, _ = engine.sample(two, noise, STEPS, None)
    two_t = time_cuda(lambda: engine.sample(two, noise, STEPS, None))
    two_eager = eager(model, two, noise)
    return {"two_cams_p50_ms": two_t["p50_ms"], "two_cams_vs_eager_bf16": maxdiff(two_out, two_eager),
            "full_p50_ms": full["p50_ms"], "prefix_cache_hit_p50_ms": hit_t["p50_ms"],
            "prefix_cache_hit_equals_miss": bool(torch.equal(hit, miss)), "miss_prefix_ms": miss_t["prefix_ms"]}


def profile_kernels(engine, inputs, noise, calls: int = 3) -> list:
    """Per-kernel GPU time inside the graph replays of one call (top 30 by total)."""
    from torch.profiler import ProfilerActivity, profile

    engine.sample(inputs, noise, STEPS, None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            engine.sample(inputs, noise, STEPS, None)
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total and e.count:
            rows.append({"kernel": e.key[:90], "per_call_us": total / calls, "count_per_call": e.count / calls,
                         "avg_us": total / e.count})
    rows.sort(key=lambda r: -r["per_call_us"])
    for r in rows[:30]:
        log(f"{r['per_call_us']:9.1f} us/call {r['count_per_call']:7.0f}x {r['avg_us']:7.2f} us  {r['kernel']}")
    return rows[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lerobot", action="store_true", help="also run LeRobot 0.6.1 (needs its wheels)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--golden", default=GOLDEN, help="golden fixture folder (default: unpacked from tests/data)")
    ap.add_argument("--tune", action="store_true", help="sweep the expert kernels' launch configs first")
    ap.add_argument("--gemm-library", default="cublas", choices=GEMM_LIBRARIES,
                    help="the Triton fast path's GEMM library (RuntimeConfig.gemm_library)")
    ap.add_argument("--attention-library", default="triton", choices=ATTENTION_LIBRARIES,
                    help="the prefix's attention library (RuntimeConfig.attention_library)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "gemm_library": args.gemm_library, "attention_library": args.attention_library, "workload": {
        "cameras": CAMERAS, "tokens": TOKENS, "valid_tokens": VALID_TOKENS, "prefix_len": CAMERAS * 256 + TOKENS,
        "horizon": HORIZON, "steps": STEPS}}
    started = time.time()

    def save():
        for d in filter(None, [ROOT / "bench" / "results", Path(args.out) if args.out else None]):
            d.mkdir(parents=True, exist_ok=True)
            (d / "bench_gpu.json").write_text(json.dumps(results, indent=1))

    if Path(args.golden).exists():
        results["golden_cuda"] = golden_check(Path(args.golden))
        log("golden on cuda:", json.dumps(results["golden_cuda"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    results["ceilings"] = ceilings()
    log("ceilings:", results["ceilings"])
    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    log(f"model built ({time.time() - started:.0f}s); params", sum(p.numel() for p in model.parameters()))
    if args.tune:
        results["tuning"] = tune_expert_kernels(model)
        save()
    flops = flops_per_call(model, CAMERAS, TOKENS, HORIZON, STEPS)
    results["flops"] = flops
    results["floor_ms_b1"] = math_floor_ms(flops, STEPS, results["ceilings"]["bf16_gemm_tflops"],
                                           results["ceilings"]["copy_tbps"])
    # The default bucket's prefix is shorter: its own floor (the work that is left).
    bucket = default_bucket()
    results["workload"]["default_bucket"] = bucket
    flops_bucket = flops_per_call(model, CAMERAS, bucket, HORIZON, STEPS)
    results["floor_ms_b1_default_bucket"] = math_floor_ms(flops_bucket, STEPS, results["ceilings"]["bf16_gemm_tflops"],
                                                          results["ceilings"]["copy_tbps"])
    results["floor_ms_b8_default_bucket"] = floor_ms_batched(flops_bucket, 8, STEPS, results["ceilings"])
    # At the sustained (power-limited) GEMM rate: the floor of a batch-8 call made only of GEMMs.
    results["floor_ms_b8_default_bucket_sustained"] = floor_ms_batched(flops_bucket, 8, STEPS,
                                                                       at_sustained(results["ceilings"]))

    policy_config = PolicyConfig(cfg, ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), 14, 14)
    variants = {
        "fast_triton_graphs": FastRunner(model, policy_config, use_graphs=True, use_triton=True,
                                         gemm_library=args.gemm_library, attention_library=args.attention_library),
        "fast_torch_graphs": FastRunner(model, policy_config, use_graphs=True, use_triton=False),
        "fast_torch_nographs": FastRunner(model, policy_config, use_graphs=False, use_triton=False),
    }
    # Peak memory of the default fast path at batch 1: weights + static buffers + graph pools.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    inputs, noise = make_inputs(1, cfg.vlm.vocab_size)
    variants["fast_triton_graphs"].sample(inputs, noise, STEPS, None)
    results["peak_mem_gib_b1_fast"] = torch.cuda.max_memory_allocated() / 2**30
    log("peak GiB (b1, fast):", results["peak_mem_gib_b1_fast"])

    # fp32 reference: the same weights, upcast exactly.
    model32 = copy.deepcopy(model).float()
    timings, accuracy = {}, {}
    for b in batches:
        inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=b)
        ref32 = eager(model32, inputs, noise)
        ref16 = eager(model, inputs, noise)
        accuracy[b] = {"eager_bf16_vs_fp32": maxdiff(ref16, ref32)}
        timings[b] = {"eager_bf16": time_cuda(lambda: eager(model, inputs, noise), warmup=2, iters=5)}
        for name, engine in variants.items():
            out, stages = engine.sample(inputs, noise, STEPS, None)
            accuracy[b][f"{name}_vs_eager_bf16"] = maxdiff(out, ref16)
            accuracy[b][f"{name}_vs_fp32"] = maxdiff(out, ref32)
            timings[b][name] = time_cuda(lambda: served_call(engine, inputs, noise))
            timings[b][name]["p50_ms_slots_read_on_device"] = time_cuda(
                lambda: engine.sample(inputs, noise, STEPS, None))["p50_ms"]
            stage_runs = [served_call(engine, inputs, noise)[1] for _ in range(10)]
            timings[b][name]["prefix_p50_ms"] = statistics.median(s["prefix_ms"] for s in stage_runs)
            timings[b][name]["denoise_p50_ms"] = statistics.median(s["denoise_ms"] for s in stage_runs)
        # What the server runs by default on CUDA: the same engine, the prompt in its "auto" bucket.
        engine, short = variants["fast_triton_graphs"], bucketed(inputs, bucket)
        out, _ = engine.sample(short, noise, STEPS, None)
        accuracy[b]["fast_default_bucket_vs_eager_bf16"] = maxdiff(out, ref16)
        accuracy[b]["fast_default_bucket_vs_fp32"] = maxdiff(out, ref32)
        with PowerSampler() as power:
            timings[b]["fast_default_bucket"] = time_cuda(lambda: served_call(engine, short, noise))
        timings[b]["fast_default_bucket"]["nvml"] = power.result
        timings[b]["fast_default_bucket"]["p50_ms_slots_read_on_device"] = time_cuda(
            lambda: engine.sample(short, noise, STEPS, None))["p50_ms"]
        stage_runs = [served_call(engine, short, noise)[1] for _ in range(10)]
        timings[b]["fast_default_bucket"]["prefix_p50_ms"] = statistics.median(s["prefix_ms"] for s in stage_runs)
        timings[b]["fast_default_bucket"]["denoise_p50_ms"] = statistics.median(s["denoise_ms"] for s in stage_runs)
        # Bit-reproducibility of the default path.
        a1, _ = variants["fast_triton_graphs"].sample(inputs, noise, STEPS, None)
        a2, _ = variants["fast_triton_graphs"].sample(inputs, noise, STEPS, None)
        accuracy[b]["fast_repeat_bit_identical"] = bool(torch.equal(a1, a2))
        log(f"b={b}:", json.dumps({k: round(v["p50_ms"], 2) for k, v in timings[b].items()}),
            json.dumps(accuracy[b]))
        results["timings"], results["accuracy"] = timings, accuracy
        save()

    # Stage split of the default path at batch 1: vision alone, in its own graph.
    inputs, _ = make_inputs(1, cfg.vlm.vocab_size)
    fast = variants["fast_triton_graphs"].fast
    g = torch.cuda.CUDAGraph()
    flat = inputs.images.flatten(0, 1)
    with torch.no_grad():
        fast.vision(flat)
        with torch.cuda.graph(g):
            fast.vision(flat)
    results["vision_b1_ms"] = time_cuda(g.replay)["p50_ms"]
    t1 = timings[1]["fast_triton_graphs"]
    prefix_tflops = (flops["vision_flop"] + flops["prefix_flop"]) / (t1["prefix_p50_ms"] * 1e-3) / 1e12
    expert_tbps = flops["expert_weight_bytes_per_step"] * STEPS / (t1["denoise_p50_ms"] * 1e-3) / 1e12
    results["achieved_b1"] = {"prefix_tflops": prefix_tflops, "expert_weight_tbps": expert_tbps}
    results["options_b1"] = speed_options(variants["fast_triton_graphs"], model, cfg.vlm.vocab_size)
    log("options b1:", results["options_b1"])
    results["profile_b1"] = profile_kernels(variants["fast_triton_graphs"], inputs, make_inputs(1, 10)[1])
    inputs8, noise8 = make_inputs(8, cfg.vlm.vocab_size, seed=8)
    results["profile_b8"] = profile_kernels(variants["fast_triton_graphs"], inputs8, noise8)
    t8 = timings[8]["fast_triton_graphs"] if 8 in timings else None
    if t8:
        results["achieved_b8"] = {
            "prefix_tflops": 8 * (flops["vision_flop"] + flops["prefix_flop"]) / (t8["prefix_p50_ms"] * 1e-3) / 1e12,
            "expert_tflops": 8 * flops["expert_flop_per_step"] * STEPS / (t8["denoise_p50_ms"] * 1e-3) / 1e12,
            "expert_weight_tbps": flops["expert_weight_bytes_per_step"] * STEPS / (t8["denoise_p50_ms"] * 1e-3) / 1e12}
        results["floor_ms_b8"] = floor_ms_batched(flops, 8, STEPS, results["ceilings"])
        results["floor_ms_b8_sustained"] = floor_ms_batched(flops, 8, STEPS, at_sustained(results["ceilings"]))
    # With PDL a kernel starts before its predecessor ends and waits: its time in the profile
    # includes that wait. The same graphs without PDL attribute time to kernels.
    from vlaserve.runtime.fast import kernels

    kernels.TUNING["pdl"] = False
    plain = FastRunner(model, policy_config, use_graphs=True, use_triton=True, gemm_library=args.gemm_library,
                       attention_library=args.attention_library)
    for b, (inp, noi) in ((1, (inputs, make_inputs(1, 10)[1])), (8, (inputs8, noise8))):
        plain.sample(inp, noi, STEPS, None)
        results[f"no_pdl_b{b}_p50_ms"] = time_cuda(lambda: served_call(plain, inp, noi))["p50_ms"]
        results[f"profile_b{b}_no_pdl"] = profile_kernels(plain, inp, noi)
    kernels.TUNING["pdl"] = None
    del plain
    torch.cuda.empty_cache()
    results["policy_b1"] = policy_wall_time(model, variants["fast_triton_graphs"])
    log("policy b1:", results["policy_b1"])
    save()

    if args.lerobot:
        del variants["fast_torch_nographs"]
        torch.cuda.empty_cache()
        lr16 = build_lerobot(model, "bfloat16")
        lr32 = build_lerobot(model32, "float32")
        results["lerobot"] = {}
        for b in batches:
            inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=b)
            t = time_cuda(lambda: lerobot_sample(lr16, inputs, noise), warmup=2, iters=5)
            entry = {"eager_bf16": t}
            if b in (1, 8):
                o16, o32 = lerobot_sample(lr16, inputs, noise), lerobot_sample(lr32, inputs, noise)
                ours32 = eager(model32, inputs, noise)
                ours_fast, _ = variants["fast_triton_graphs"].sample(inputs, noise, STEPS, None)
                ours_bucket, _ = variants["fast_triton_graphs"].sample(bucketed(inputs, bucket), noise, STEPS, None)
                entry.update({"ours_default_bucket_vs_fp32": maxdiff(ours_bucket, ours32),
                              "ours_default_bucket_vs_fp32_mean_item_max": per_item_max(ours_bucket, ours32),
                              "lerobot_bf16_vs_fp32": maxdiff(o16, o32), "ours_fp32_vs_lerobot_fp32": maxdiff(ours32, o32),
                              "ours_fast_vs_lerobot_bf16": maxdiff(ours_fast, o16),
                              "ours_fast_vs_fp32": maxdiff(ours_fast, ours32),
                              # per-sample max|Δ|, averaged: one sample's max is a noisy statistic
                              "lerobot_bf16_vs_fp32_mean_item_max": per_item_max(o16, o32),
                              "ours_fast_vs_fp32_mean_item_max": per_item_max(ours_fast, ours32)})
            entry["speedup_fast"] = t["p50_ms"] / timings[b]["fast_triton_graphs"]["p50_ms"]
            entry["speedup_default_bucket"] = t["p50_ms"] / timings[b]["fast_default_bucket"]["p50_ms"]
            results["lerobot"][b] = entry
            log(f"lerobot b={b}:", json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                for k, v in entry.items() if k != "eager_bf16"}),
                "p50", round(t["p50_ms"], 1))
            save()

    results["total_p50_ms"] = {b: timings[b]["fast_triton_graphs"]["p50_ms"] for b in batches}
    results["total_default_bucket_p50_ms"] = {b: timings[b]["fast_default_bucket"]["p50_ms"] for b in batches}
    results["elapsed_s"] = time.time() - started
    save()
    plot(results, args.out)
    print_table(results)


def plot(results, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted(results["timings"], key=int)
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results["timings"][batches[0]])
    for name in names:
        ax.plot(batches, [results["timings"][b][name]["p50_ms"] for b in batches], marker="o", label=name)
    if "lerobot" in results:
        ax.plot(batches, [results["lerobot"][b]["eager_bf16"]["p50_ms"] for b in batches], marker="s",
                label="lerobot 0.6.1 eager bf16")
    by_name = {str(b): b for b in batches}  # ints in the run, strings when re-plotted from its JSON
    for b, key, color, label in ((1, "floor_ms_b1_default_bucket", "black", "floor, default bucket"),
                                 (8, "floor_ms_b8_default_bucket", "black", None),
                                 (8, "floor_ms_b8_default_bucket_sustained", "gray", "floor at the sustained GEMM rate")):
        if results.get(key) and str(b) in by_name:
            ax.scatter([by_name[str(b)]], [results[key]], marker="_", s=300, color=color, label=label, zorder=3)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("GPU time per call, p50 (ms)")
    ax.set_title(f"Pi0.5 ALOHA-3 on {results['gpu']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(True, which="both", alpha=0.3)
    for d in filter(None, [ROOT / "bench" / "results", Path(out) if out else None]):
        fig.savefig(d / "bench_gpu.png", dpi=120, bbox_inches="tight")


def print_table(results):
    log("\n| batch | " + " | ".join(results["timings"][next(iter(results["timings"]))]) + " | lerobot |")
    for b, row in results["timings"].items():
        lr = results.get("lerobot", {}).get(b, {}).get("eager_bf16", {}).get("p50_ms", float("nan"))
        log(f"| {b} | " + " | ".join(f"{v['p50_ms']:.2f}" for v in row.values()) + f" | {lr:.1f} |")
    log("floor b8 ms:", round(results.get("floor_ms_b8", 0), 2), "achieved b8:", results.get("achieved_b8"))
    log(f"default bucket {results['workload']['default_bucket']} tokens: floor b1",
        round(results["floor_ms_b1_default_bucket"], 2), "b8", round(results["floor_ms_b8_default_bucket"], 2),
        "(at the sustained GEMM rate:", round(results["floor_ms_b8_default_bucket_sustained"], 2), ")")
    for b, row in results["timings"].items():
        log(f"b{b} default bucket, SM clock and power while timed:", row["fast_default_bucket"].get("nvml"))
    log("floor b1 ms:", round(results["floor_ms_b1"], 2), "achieved:", results.get("achieved_b1"),
        "vision b1 ms:", round(results.get("vision_b1_ms", 0), 3), "peak GiB:", round(results["peak_mem_gib_b1_fast"], 2))


if __name__ == "__main__":
    main()
