"""GPU speed and accuracy of Pi0.5 on the ALOHA-3 workload, ours against LeRobot 0.6.1, in one run.

Full-size Pi0.5 with random weights (bf16 + the fp32 set), 3 cameras 224x224, prompts padded to 200
tokens (70 valid) -> 968 prefix tokens, chunk 50x32, 10 steps; batch 1, 2, 4, 8. First the golden
cases on the device; then checks (max|Δ| of actions between variants, against the same weights in
fp32), then CUDA-event times of each variant after warm-up: the fast path (Triton + graphs, torch +
graphs, torch alone) and the eager model, the served call at the default prompt bucket, its stage
split and per-kernel profile, the exact prefix cache, Policy.infer with host work, and with
--lerobot LeRobot's PI05 on the same weights. The GEMM ceiling is measured in a burst and sustained
at the power limit (the batch-8 floor is given at both); NVML's SM clock and board power are read
while each batch size's default path is timed. Writes bench_gpu.json and .png.

--golden-only: the golden cases of both families on the device (eager: every recorded tensor; fast
path: the actions), the prefix-cache hit against its miss, two batches enqueued back to back against
each alone, and a prompt bucket served from graphs captured at warm-up; writes golden_gpu.json.
--actions FILE saves the served actions of the full-size random model at batch 1, 2, 4, 8, without
and with RTC guidance (with p50 times; the same inputs sent from host memory, as the server sends them,
must give the same actions: `from_host_bit_identical`); --compare-actions FILE compares them bit for bit with a file
saved on another tree: the gate of a refactor that must not change what is computed. With
--through-plan the graphs are captured first through a plan, as the server captures them (against
each graph captured on its first call: the same graphs, bit for bit).
--precision fp8 adds the same model with SigLIP's and the prefix's linear layers in fp8 (per-token
activation scales), served by the fast path: time per call and per stage at the default bucket next
to bf16's, the prefix's TFLOP/s against the fp8 GEMM ceiling measured in the same run, weight bytes,
its max|Δ| vs fp32 next to bf16's over several inputs per batch size, and its cosine to bf16's actions.

    python bench/bench_gpu.py [--lerobot] [--batches 1,2,4,8] [--gemm-library quack] [--precision fp8] [--out DIR]
    python bench/bench_gpu.py --golden-only [--actions after.pt --compare-actions before.pt]
    python bench/bench_gpu.py --golden-only --launch-table sm89 --actions sm89.pt --compare-actions sm90.pt
    python bench/bench_gpu.py --golden-only --through-plan --actions new.pt --compare-actions before.pt
    python bench/bench_gpu.py --batch-invariant [--batches 1,2,4,8]

--batch-invariant: the batch-invariant fast path (RuntimeConfig.batch_invariant: its own GEMM and attention
backends, its launch table, prompts at the checkpoint's length) against the default one in the same run, at
each batch size: p50 of a served call, the cost against the default at its served prompt bucket and at the
same prompt length; then bit-identity: >= 8 random observations, each alone and in batches of every size at
every position (rotations), with graphs and without, and from prefix-cache entries; every item's actions must
equal its alone bits. Writes bench_gpu_invariant.json and .png. (--smoke: the eager model per item on the CPU.)
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from common import (HORIZON, STEPS, TOKENS, VALID_TOKENS, bench_model, golden_checkpoint, lerobot_policy, log,
                    make_inputs, maxdiff, parser, per_item_max, pyplot, sample, save_json, save_png, time_ms)
from vlaserve import Policy
from vlaserve.checkpoint.weights import to_lerobot_name
from vlaserve.config import ATTENTION_LIBRARIES, GEMM_LIBRARIES, RuntimeConfig
from vlaserve.golden import GoldenCase, beyond_tolerance, case_dirs, compare_case
from vlaserve.model.fp8 import E4M3, convert_to_fp8
from vlaserve.model.pi05 import Pi05Model
from vlaserve.model.rtc import RTCGuidance
from vlaserve.precision import cosines
from vlaserve.startup.capture import GraphCapture
from vlaserve.startup.plan import capture_plan
from vlaserve.runtime.runner import EagerRunner, PerItemRunner
from vlaserve.types import ModelInputs

CAMERAS = 3
TIMING = {"warmup": 3, "iters": 20}  # per time_ms; --smoke: 1 and 2


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


class PowerSampler:
    """The SM clock and board power, read by NVML every few ms while a block runs: whether it ran
    at the power limit (the H200 holds 700 W by lowering its clock; run 86). Empty without NVML."""

    def __init__(self, device: str = "cuda", interval_s: float = 0.005):
        self.interval_s, self.result, self._samples = interval_s, {}, []
        self._nvml = None
        if device != "cuda":
            return
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


def hold(fn, seconds: float, device: str):
    """Runs fn back to back for `seconds` (synchronizing every few calls): what follows is timed at
    the clock the GPU holds under that load (at its power limit for GEMMs)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()


def ceilings(device: str, n: int = 8192, copy_bytes: int = 2 * 1024**3, hold_s: float = 3.0):
    """The bf16 GEMM ceiling twice: a short burst (10 products of n^3 at full clock) and sustained
    (after `hold_s` of back-to-back products, at the power limit: the rate a batch-8 call made only
    of GEMMs would hold), and the device-to-device copy rate."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    flop = 2 * n**3
    if device == "cuda":
        torch.cuda.synchronize()
        time.sleep(2.0)  # start cool: the burst figure is the full-clock one
    t = time_ms(lambda: a @ b, device, warmup=3, iters=10)["p50_ms"]
    hold(lambda: a @ b, hold_s, device)
    with PowerSampler(device) as power:
        ts = time_ms(lambda: a @ b, device, warmup=0, iters=20)["p50_ms"]
    x = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    tc = time_ms(lambda: y.copy_(x), device, warmup=2, iters=10)["p50_ms"]
    return {"bf16_gemm_tflops": flop / (t * 1e-3) / 1e12, "bf16_gemm_tflops_sustained": flop / (ts * 1e-3) / 1e12,
            "sustained_nvml": power.result, "copy_tbps": 2 * x.numel() / (tc * 1e-3) / 1e12}


def at_sustained(ceiling: dict) -> dict:
    return {**ceiling, "bf16_gemm_tflops": ceiling["bf16_gemm_tflops_sustained"]}


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


def eager(model, inputs, noise):
    with torch.no_grad():
        return model.sample(inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask, noise, STEPS)


def served_call(engine, inputs, noise):
    """One call as the server makes it: Runtime.launch reads the camera slots in use from the host
    batch and passes them on, so nothing in the timed window waits on the device (a fast path call
    without them reads the masks back: a device round trip before the graphs are launched). Every
    camera of the bench's inputs is present."""
    return sample(engine, inputs, noise, STEPS, vision_slots=CAMERAS)


# --launch-table: the GPU family whose Triton launch table (and TMA / PDL) the fast path runs with;
# None: what the runtime chooses for this GPU. "sm89" on an H200 forces the portable path.
LAUNCH_TABLE_TARGETS = {"sm80": 80, "sm89": 89, "sm90": 90, "sm100": 100}
launch_table: str | None = None


def served_table(device: str):
    """The launch table the fast path runs with: --launch-table's, else the one start-up chooses for this GPU."""
    from vlaserve.runtime.fast.launch_tables import table_for
    from vlaserve.runtime.fast.targets import TARGETS, choose_target

    return table_for(TARGETS[LAUNCH_TABLE_TARGETS[launch_table]] if launch_table else choose_target(torch.device(device)))


def runners(model, policy_config, device: str, gemm_library: str, attention_library: str) -> dict:
    """The variants timed, the served one first: on CUDA the fast path with Triton kernels and
    graphs, with torch's kernels and graphs, with neither; on a CPU (--smoke) the eager runner."""
    if device != "cuda":
        return {"eager_runner": EagerRunner(model, torch.device(device))}
    from vlaserve.runtime.graphs import FastRunner

    return {"fast_triton_graphs": FastRunner(model, policy_config, use_graphs=True, use_triton=True,
                                             gemm_library=gemm_library, attention_library=attention_library,
                                             launch_table=served_table(device)),
            "fast_torch_graphs": FastRunner(model, policy_config, use_graphs=True, use_triton=False),
            "fast_torch_nographs": FastRunner(model, policy_config, use_graphs=False, use_triton=False)}


def build_lerobot(model, dtype: str, device: str):
    """LeRobot 0.6.1's PI05 (eager) holding exactly our weights."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    return lerobot_policy(PI05Policy, PI05Config, {to_lerobot_name(n): p for n, p in model.named_parameters()},
                          dtype, ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"), device)


def lerobot_sample(policy, inputs, noise):
    imgs = [inputs.images[:, i] for i in range(CAMERAS)]
    masks = [inputs.image_masks[:, i] for i in range(CAMERAS)]
    with torch.no_grad():
        return policy.model.sample_actions(imgs, masks, inputs.tokens, inputs.token_mask, noise=noise)


# ---- golden cases on the device ------------------------------------------------------------------
def golden_policy(golden: Path, device: str, **options) -> Policy:
    """The golden checkpoint in fp32, every CUDA graph captured before it returns: the checks compare
    calls on their own graphs, never on smaller ones standing in while the rest are captured."""
    return Policy.from_pretrained(golden / "checkpoint", device=device, dtype="float32", progress=False,
                                  warmup="blocking", **options)


def served_case(policy: Policy, case: GoldenCase) -> list:
    """A golden case's observations served as one batch with its recorded noise (and RTC): the results."""
    return policy.infer_batch(case.observations(), noise=list(case.tensors["input.noise"]),
                              num_steps=case.meta["num_steps"], rtcs=case.rtcs())


def golden_check(golden: Path, device: str, cases: int | None = None) -> dict:
    """The CPU golden tests, rerun on the device: fp32 eager (every recorded tensor), then the fp32
    fast path (the actions); the first `cases` cases, or all."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    policy = golden_policy(golden, device, fast_path=False)
    fast_policy = golden_policy(golden, device)
    for case_dir in case_dirs(golden)[:cases]:
        case = GoldenCase.load(case_dir)
        exact, deltas = compare_case(policy, case)
        results = served_case(fast_policy, case)
        fast = max(float(abs(r.actions - e).max()) for r, e in zip(results, case.tensors["expected.actions"]))
        out[case_dir.name] = {"exact_ok": all(exact.values()), "eager_max_delta": max(deltas.values()),
                              "eager_beyond_tolerance": beyond_tolerance(case, deltas),
                              "fast_actions_max_delta": fast, "fast_path": fast_policy.metadata["fast_path"]}
    return out


def cache_hit_equals_miss(golden: Path, device: str) -> bool:
    """A batch served twice with the prefix cache on: the second a hit (Pi0's state token recomputed
    after the restore), bitwise the first."""
    policy = golden_policy(golden, device, prefix_cache=4)
    case = GoldenCase.load(case_dirs(golden)[0])
    runs = [policy.infer_batch(case.observations(), noise=list(case.tensors["input.noise"]),
                               num_steps=case.meta["num_steps"]) for _ in range(2)]
    stats = policy.metadata["prefix_cache"]
    return stats["hits"] >= 1 and all(np.array_equal(a.actions, b.actions) for a, b in zip(*runs))


def overlapped_equals_serial(golden: Path, device: str) -> bool:
    """Two batches of one size enqueued back to back (the second's inputs copied into the graph's
    buffers while the first still runs), then waited for: bitwise the answers of running each alone."""
    policy = golden_policy(golden, device)
    batches = []
    for case_dir in case_dirs(golden)[:2]:
        case = GoldenCase.load(case_dir)
        batches.append([policy.request(o, noise=n) for o, n in zip(case.observations(), case.tensors["input.noise"])])
    batches = [b[:1] for b in batches]  # one size, so both use the same static buffers and graphs
    serial = [policy.run(b) for b in batches]
    launched = [policy.launch(b) for b in batches]
    overlapped = [b.finish() for b in launched]
    return all(np.array_equal(x.actions, y.actions) for s, o in zip(serial, overlapped) for x, y in zip(s, o))


def loaded_while_capturing_equals_loaded_first(golden: Path, device: str) -> dict | None:
    """The server's start (`capture_while_loading`: the engine built on parameters not filled yet, the weights
    loaded into them in place, Policy.from_pretrained) against the weights loaded first, in float32 and bfloat16,
    every graph captured: the golden cases' actions bit for bit -> {dtype: bit-identical}; None on a CPU, where
    the weights always load first (no graphs)."""
    if device != "cuda":
        return None

    out = {}
    for dtype in ("float32", "bfloat16"):
        first = Policy.from_pretrained(golden / "checkpoint", device=device, dtype=dtype, progress=False,
                                       warmup="blocking")
        early = Policy.from_pretrained(golden / "checkpoint", device=device, dtype=dtype, progress=False,
                                       warmup="background")
        assert early.load_timings["captured_while_loading"] and not first.load_timings["captured_while_loading"]
        deadline = time.perf_counter() + 300
        while early.runtime.state != "ready" and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert early.runtime.state == "ready", early.runtime.state
        same = True
        for case_dir in case_dirs(golden):
            case = GoldenCase.load(case_dir)
            same &= all(np.array_equal(x.actions, y.actions)
                        for x, y in zip(served_case(first, case), served_case(early, case)))
        out[dtype] = same
        del first, early
        torch.cuda.empty_cache()
    return out


def prompt_buckets_captured(golden: Path, device: str) -> dict:
    """A prompt bucket served from CUDA graphs captured at warm-up (on views of the full-length
    buffers): no capture and no ungraphed call once ready, and the actions of the full-length prompt
    (float32: the same function over other GEMM shapes)."""
    case = GoldenCase.load(case_dirs(golden)[0])
    observations, noise = case.observations(), list(case.tensors["input.noise"])
    plain = golden_policy(golden, device, prompt_buckets="none")
    longest = max(int(plain.prepare(o).token_mask.sum()) for o in observations)
    bucket = -(-(longest + 1) // 8) * 8
    bucketed_policy = golden_policy(golden, device, prompt_buckets=(bucket,))
    captured = bucketed_policy.metadata["graph_captures"]
    ours = bucketed_policy.infer_batch(observations, noise=noise, num_steps=case.meta["num_steps"])
    theirs = plain.infer_batch(observations, noise=noise, num_steps=case.meta["num_steps"])
    meta = bucketed_policy.metadata
    return {"bucket": bucket, "max_token_len": bucketed_policy.config.max_token_len, "graphs_at_ready": captured,
            "graphs_without_buckets": plain.metadata["graph_captures"],
            "captures_after_ready": meta["graph_captures"] - captured, "uncaptured_calls": meta["uncaptured_calls"],
            "max_delta_vs_full_length": float(max(np.abs(a.actions - b.actions).max() for a, b in zip(ours, theirs)))}


def golden_suite(device: str) -> dict:
    """--golden-only: every golden case of both families on the device, and the runtime's exactness checks."""
    out = {"device": device}
    for family in ("pi05", "pi0"):
        golden = golden_checkpoint(family).parent
        out[f"{family}_golden"] = {
            "cases": golden_check(golden, device), "prefix_cache_hit_equals_miss": cache_hit_equals_miss(golden, device),
            "overlapped_equals_serial": overlapped_equals_serial(golden, device),
            "loaded_while_capturing_equals_loaded_first": loaded_while_capturing_equals_loaded_first(golden, device),
            "prompt_buckets": prompt_buckets_captured(golden, device)}
        log(family, out[f"{family}_golden"])
    return out


def served_actions(smoke: bool, device: str, through_plan: bool = False) -> dict:
    """--actions: the served runner's actions on the random model (seed 0) for make_inputs(b, seed=b)
    at batch 1, 2, 4, 8 (--smoke: 1, 2), without and with RTC guidance (drawn from seed b), and
    their p50 ms: {"actions": {b: tensor}, "rtc_actions": {b: tensor}, "p50_ms": {b: ms}} (files
    saved before RTC was added, as bench/fast_path_actions.py's at 0bdbea4, compare their part).
    `through_plan` (CUDA): the graphs captured first, as the server does (GraphCapture
    (startup/capture.py) through a plan of these batch sizes at the bench's shape); else each on its first call."""
    model, policy_config = bench_model(smoke, device)
    batches = (1, 2) if smoke else (1, 2, 4, 8)
    runner = next(iter(runners(model, policy_config, device, "cublas", "triton").values()))
    planned = through_plan and device == "cuda"
    if planned:
        plan, capture = capture_plan(batches, (TOKENS,), len(policy_config.cameras)), GraphCapture(runner)
        for key in plan:
            capture.capture(key, STEPS)
        log(f"{len(plan)} graphs captured through the plan: "
            f"{capture.warm_ups_skipped} warm-ups skipped")
    out, rtc_out, times, from_host = {}, {}, {}, {}
    for b in batches:
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b, device=device)
        rtc = rtc_guidance(b, seed=b, device=device)
        out[b] = sample(runner, inputs, noise)[0].cpu()
        rtc_out[b] = sample(runner, inputs, noise, rtc=rtc)[0].cpu()
        # The server's way in: the same inputs and guidance from host memory (copied up by the runner).
        host = ModelInputs(*(t.cpu() for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_mask)))
        from_host[b] = (torch.equal(sample(runner, host, noise.cpu())[0].cpu(), out[b])
                        and torch.equal(sample(runner, host, noise.cpu(), rtc=rtc.to("cpu"))[0].cpu(), rtc_out[b]))
        times[b] = time_ms(lambda: sample(runner, inputs, noise), device, **TIMING)["p50_ms"]
        log(f"b={b}: p50 {times[b]:.2f} ms; from host memory bit-identical: {from_host[b]}")
    result = {"actions": out, "rtc_actions": rtc_out, "p50_ms": times, "from_host_bit_identical": from_host}
    if planned:  # every call ran on the plan's graphs
        assert runner.uncaptured_calls == 0 and runner.request_path_captures == 0, vars(runner)
        return {**result, "through_plan": True, "warm_ups_skipped": capture.warm_ups_skipped}
    return result


def rtc_guidance(b: int, seed: int, device: str) -> RTCGuidance:
    """RTC's inputs for a batch: a previous chunk, its per-step weights in [0, 1], a max weight of 5."""
    g = torch.Generator(device=device).manual_seed(seed)
    prev = torch.randn(b, HORIZON, 32, device=device, generator=g)
    weights = torch.rand(b, HORIZON, device=device, generator=g)
    return RTCGuidance(prev, weights, torch.full((b,), 5.0, device=device))


def compare_actions(now: dict, before: dict) -> dict:
    """Bit for bit, per batch size: the actions, and with RTC where the saved file has them."""
    def same(a: torch.Tensor, b: torch.Tensor) -> dict:
        return {"bit_identical": bool(torch.equal(a, b)), "max_abs_diff": maxdiff(a, b)}

    out = {}
    for b in now["actions"]:
        out[b] = {**same(now["actions"][b], before["actions"][b]),
                  "p50_ms_before": before["p50_ms"][b], "p50_ms_now": now["p50_ms"][b]}
        if b in before.get("rtc_actions", {}):
            out[b]["rtc"] = same(now["rtc_actions"][b], before["rtc_actions"][b])
    return out


def policy_wall_time(model, cfg, engine, device: str) -> dict:
    """Policy.infer at batch 1 with host preprocessing (uint8 images, prompt, tokenizer) included."""
    from vlaserve.family import PI05
    from vlaserve.processing.normalize import Normalization, QuantileNormalizer
    from vlaserve.processing.pipeline import ProcessorPipeline
    from vlaserve.processing.prepare import Preprocessor
    from vlaserve.processing.prompt import PromptTokenizer
    from vlaserve.runtime.runner import Runtime

    tokenizer = golden_checkpoint() / "tokenizer" / "tokenizer.json"
    q = QuantileNormalizer(-np.ones(32, np.float32), np.ones(32, np.float32))
    runtime = Runtime(model, cfg, RuntimeConfig(device=device, fast_path=False), torch.device(device),
                      torch.bfloat16, "bench")
    runtime.runner, runtime.fast_path = engine, device == "cuda"
    policy = Policy(cfg, Preprocessor(cfg, ProcessorPipeline(Normalization(q, q, "bench")),
                                      PromptTokenizer.from_path(tokenizer), PI05),
                    runtime, "bench", "bench", {})
    rng = np.random.default_rng(0)
    obs = {"images": {c: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for c in cfg.cameras},
           "state": rng.uniform(-1, 1, 14).astype(np.float32), "task": "pick up the red block"}
    for _ in range(TIMING["warmup"]):
        policy.infer(obs, seed=0)
    walls, device_ms = [], []
    for _ in range(TIMING["iters"]):
        t0 = time.perf_counter()
        r = policy.infer(obs, seed=0)
        walls.append((time.perf_counter() - t0) * 1e3)
        device_ms.append(r.timings["prefix_ms"] + r.timings["denoise_ms"])
    return {"wall_p50_ms": statistics.median(walls), "gpu_p50_ms": statistics.median(device_ms),
            "preprocess_p50_ms": statistics.median([policy.infer(obs, seed=0).timings["preprocess_ms"]
                                                    for _ in range(max(1, TIMING["iters"] // 4))])}


def speed_options(engine, model, vocab: int, device: str) -> dict:
    """Options at batch 1: the exact prefix cache (hit vs miss), an absent camera."""
    inputs, noise = make_inputs(1, vocab, seed=123, device=device)
    miss, miss_t = sample(engine, inputs, noise)
    cached = [engine.prefix_entry(0)]
    hit, _ = sample(engine, inputs, noise, prefix=cached)
    hit_t = time_ms(lambda: sample(engine, inputs, noise, prefix=cached), device, **TIMING)
    full = time_ms(lambda: sample(engine, inputs, noise), device, **TIMING)
    # Two cameras present, the third absent (masked, last slot): the vision tower skips it.
    masks = inputs.image_masks.clone()
    masks[:, 2] = False
    two = ModelInputs(inputs.images, masks, inputs.tokens, inputs.token_mask)
    two_out, _ = sample(engine, two, noise)
    two_t = time_ms(lambda: sample(engine, two, noise), device, **TIMING)
    two_eager = eager(model, two, noise)
    return {"two_cams_p50_ms": two_t["p50_ms"], "two_cams_vs_eager_bf16": maxdiff(two_out, two_eager),
            "full_p50_ms": full["p50_ms"], "prefix_cache_hit_p50_ms": hit_t["p50_ms"],
            "prefix_cache_hit_equals_miss": bool(torch.equal(hit, miss)), "miss_prefix_ms": miss_t["prefix_ms"]}


def profile_kernels(engine, inputs, noise, calls: int = 3) -> list:
    """Per-kernel GPU time inside the graph replays of one call (top 60 by total; the top 30 logged)."""
    from torch.profiler import ProfilerActivity, profile

    sample(engine, inputs, noise)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            sample(engine, inputs, noise)
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


def stage_medians(engine, inputs, noise) -> dict:
    runs = [served_call(engine, inputs, noise)[1] for _ in range(max(1, TIMING["iters"] // 2))]
    return {"prefix_p50_ms": statistics.median(s["prefix_ms"] for s in runs),
            "denoise_p50_ms": statistics.median(s["denoise_ms"] for s in runs)}


def main():
    ap = parser(__doc__)
    ap.add_argument("--lerobot", action="store_true", help="also run LeRobot 0.6.1 (needs its wheels)")
    ap.add_argument("--batches", default=None, help="batch sizes (default: 1,2,4,8; --smoke: 1)")
    ap.add_argument("--gemm-library", default="cublas", choices=GEMM_LIBRARIES,
                    help="the Triton fast path's GEMM library (RuntimeConfig.gemm_library)")
    ap.add_argument("--attention-library", default="triton", choices=ATTENTION_LIBRARIES,
                    help="the prefix's attention library (RuntimeConfig.attention_library)")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                    help="fp8: also the fast path with fp8 prefix and SigLIP GEMMs, beside bf16 (RuntimeConfig.precision)")
    ap.add_argument("--golden-only", action="store_true",
                    help="only the golden cases and exactness checks on the device (golden_gpu.json), seconds")
    ap.add_argument("--actions", metavar="FILE", help="save the served actions at batch 1, 2, 4, 8 (torch.save)")
    ap.add_argument("--compare-actions", metavar="FILE", help="compare them bit for bit with a saved FILE")
    ap.add_argument("--through-plan", action="store_true",
                    help="--actions: capture the graphs first, as the server does (default: each graph on "
                         "its first call)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="only the batch-invariant mode against the default: cost and bit-identity "
                         "(bench_gpu_invariant.json and .png)")
    ap.add_argument("--launch-table", choices=sorted(LAUNCH_TABLE_TARGETS),
                    help="run the fast path with this GPU family's launch table and features (default: this "
                         "GPU's; sm89 or sm80 on an H200: the portable path, no TMA, no PDL)")
    args = ap.parse_args()
    global launch_table
    launch_table = args.launch_table
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        TIMING.update(warmup=1, iters=2)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device (--smoke runs on the CPU)")
    started = time.time()

    if args.batch_invariant:
        batches = [int(b) for b in (args.batches or "1,2,4,8").split(",")]
        results = batch_invariant_run(args.smoke, device, batches)
        results["elapsed_s"] = time.time() - started
        save_json(results, args.out, "bench_gpu_invariant")
        plot_invariant(results, args.out)
        log("batch-invariant:", {b: results["timings"][b] for b in batches}, "identical:",
            results["bit_identity"]["identical"])
        return

    if args.golden_only or args.actions or args.compare_actions:
        golden = golden_suite(device)
        if args.actions or args.compare_actions:
            now = served_actions(args.smoke, device, args.through_plan)
            golden["launch_table"], golden["served_p50_ms"] = args.launch_table or "auto", now["p50_ms"]
            golden["through_plan"] = now.get("through_plan", False)
            golden["warm_ups_skipped"] = now.get("warm_ups_skipped")
            golden["from_host_bit_identical"] = now["from_host_bit_identical"]
            if args.actions:
                torch.save(now, args.actions)
            if args.compare_actions:
                golden["actions_vs_saved"] = compare_actions(now, torch.load(args.compare_actions))
                log("actions vs", args.compare_actions, golden["actions_vs_saved"])
        golden["elapsed_s"] = time.time() - started
        save_json(golden, args.out, "golden_gpu")
        if args.golden_only:
            return

    batches = [int(b) for b in (args.batches or ("1" if args.smoke else "1,2,4,8")).split(",")]
    results: dict = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "smoke": args.smoke, "gemm_library": args.gemm_library,
                     "attention_library": args.attention_library, "launch_table": args.launch_table or "auto",
                     "workload": {
        "cameras": CAMERAS, "tokens": TOKENS, "valid_tokens": VALID_TOKENS, "prefix_len": CAMERAS * 256 + TOKENS,
        "horizon": HORIZON, "steps": STEPS}}

    def save():
        save_json(results, args.out, "bench_gpu")

    results["golden"] = golden_check(golden_checkpoint().parent, device, cases=1 if args.smoke else None)
    log("golden:", results["golden"])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    results["ceilings"] = (ceilings(device, n=512, copy_bytes=64 * 1024**2, hold_s=0.2) if args.smoke
                           else ceilings(device))
    log("ceilings:", results["ceilings"])
    model, policy_config = bench_model(args.smoke, device)
    cfg = model.config
    vocab = cfg.vlm.vocab_size
    log(f"model built ({time.time() - started:.0f}s); params", sum(p.numel() for p in model.parameters()))
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

    variants = runners(model, policy_config, device, args.gemm_library, args.attention_library)
    served_name = next(iter(variants))
    served = variants[served_name]
    results["served_variant"] = served_name
    if device == "cuda":  # peak memory of the default fast path at batch 1: weights + static buffers + graph pools
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        sample(served, *make_inputs(1, vocab, device=device))
        results["peak_mem_gib_b1_fast"] = torch.cuda.max_memory_allocated() / 2**30
        log("peak GiB (b1, fast):", results["peak_mem_gib_b1_fast"])

    # fp32 reference: the same weights, upcast exactly.
    model32 = copy.deepcopy(model).float()
    timings, accuracy = {}, {}
    eager_iters = TIMING["iters"] if args.smoke else 5
    for b in batches:
        inputs, noise = make_inputs(b, vocab, seed=b, device=device)
        ref32 = eager(model32, inputs, noise)
        ref16 = eager(model, inputs, noise)
        accuracy[b] = {"eager_bf16_vs_fp32": maxdiff(ref16, ref32)}
        timings[b] = {"eager_bf16": time_ms(lambda: eager(model, inputs, noise), device, warmup=1, iters=eager_iters)}
        for name, engine in variants.items():
            out, _ = sample(engine, inputs, noise)
            accuracy[b][f"{name}_vs_eager_bf16"] = maxdiff(out, ref16)
            accuracy[b][f"{name}_vs_fp32"] = maxdiff(out, ref32)
            timings[b][name] = time_ms(lambda: served_call(engine, inputs, noise), device, **TIMING)
            timings[b][name]["p50_ms_slots_read_on_device"] = time_ms(
                lambda: sample(engine, inputs, noise), device, **TIMING)["p50_ms"]
            timings[b][name].update(stage_medians(engine, inputs, noise))
        # What the server runs by default on CUDA: the same engine, the prompt in its "auto" bucket.
        short = bucketed(inputs, bucket)
        out, _ = sample(served, short, noise)
        accuracy[b]["fast_default_bucket_vs_eager_bf16"] = maxdiff(out, ref16)
        accuracy[b]["fast_default_bucket_vs_fp32"] = maxdiff(out, ref32)
        with PowerSampler(device) as power:
            timings[b]["fast_default_bucket"] = time_ms(lambda: served_call(served, short, noise), device, **TIMING)
        timings[b]["fast_default_bucket"]["nvml"] = power.result
        timings[b]["fast_default_bucket"]["p50_ms_slots_read_on_device"] = time_ms(
            lambda: sample(served, short, noise), device, **TIMING)["p50_ms"]
        timings[b]["fast_default_bucket"].update(stage_medians(served, short, noise))
        # Bit-reproducibility of the default path.
        a1, _ = sample(served, inputs, noise)
        a2, _ = sample(served, inputs, noise)
        accuracy[b]["fast_repeat_bit_identical"] = bool(torch.equal(a1, a2))
        log(f"b={b}:", {k: round(v["p50_ms"], 2) for k, v in timings[b].items()}, accuracy[b])
        results["timings"], results["accuracy"] = timings, accuracy
        save()

    if args.precision == "fp8":
        results["fp8"] = fp8_section(model, model32, policy_config, served, batches, bucket, flops_bucket, timings,
                                     args, device)
        save()

    inputs, noise1 = make_inputs(1, vocab, device=device)
    t1 = timings[batches[0]][served_name]
    prefix_tflops = (flops["vision_flop"] + flops["prefix_flop"]) / (t1["prefix_p50_ms"] * 1e-3) / 1e12
    expert_tbps = flops["expert_weight_bytes_per_step"] * STEPS / (t1["denoise_p50_ms"] * 1e-3) / 1e12
    results["achieved_b1"] = {"prefix_tflops": prefix_tflops, "expert_weight_tbps": expert_tbps}
    results["options_b1"] = speed_options(served, model, vocab, device)
    log("options b1:", results["options_b1"])
    if device == "cuda":
        profiles(results, served, model, policy_config, inputs, noise1, timings, flops, args)
    results["policy_b1"] = policy_wall_time(model, policy_config, served, device)
    log("policy b1:", results["policy_b1"])
    save()

    if args.lerobot:
        variants.pop("fast_torch_nographs", None)
        if device == "cuda":
            torch.cuda.empty_cache()
        lr16 = build_lerobot(model, "bfloat16", device)
        lr32 = build_lerobot(model32, "float32", device)
        results["lerobot"] = {}
        for b in batches:
            inputs, noise = make_inputs(b, vocab, seed=b, device=device)
            t = time_ms(lambda: lerobot_sample(lr16, inputs, noise), device, warmup=2, iters=5)
            entry = {"eager_bf16": t}
            if b in (1, 8):
                o16, o32 = lerobot_sample(lr16, inputs, noise), lerobot_sample(lr32, inputs, noise)
                ours32 = eager(model32, inputs, noise)
                ours_fast, _ = sample(served, inputs, noise)
                ours_bucket, _ = sample(served, bucketed(inputs, bucket), noise)
                entry.update({"ours_default_bucket_vs_fp32": maxdiff(ours_bucket, ours32),
                              "ours_default_bucket_vs_fp32_mean_item_max": per_item_max(ours_bucket, ours32),
                              "lerobot_bf16_vs_fp32": maxdiff(o16, o32), "ours_fp32_vs_lerobot_fp32": maxdiff(ours32, o32),
                              "ours_fast_vs_lerobot_bf16": maxdiff(ours_fast, o16),
                              "ours_fast_vs_fp32": maxdiff(ours_fast, ours32),
                              "lerobot_bf16_vs_fp32_mean_item_max": per_item_max(o16, o32),
                              "ours_fast_vs_fp32_mean_item_max": per_item_max(ours_fast, ours32)})
            entry["speedup_fast"] = t["p50_ms"] / timings[b][served_name]["p50_ms"]
            entry["speedup_default_bucket"] = t["p50_ms"] / timings[b]["fast_default_bucket"]["p50_ms"]
            results["lerobot"][b] = entry
            log(f"lerobot b={b}:", {k: v for k, v in entry.items() if k != "eager_bf16"}, "p50", round(t["p50_ms"], 1))
            save()

    results["total_p50_ms"] = {b: timings[b][served_name]["p50_ms"] for b in batches}
    results["total_default_bucket_p50_ms"] = {b: timings[b]["fast_default_bucket"]["p50_ms"] for b in batches}
    results["elapsed_s"] = time.time() - started
    save()
    plot(results, args.out)
    print_table(results)


# ---- --batch-invariant ----------------------------------------------------------------------------------
INVARIANT_OBSERVATIONS = 8  # random observations checked (each at every position of a batch of every size)
SMOKE_OBSERVATIONS = 4  # --smoke: the CPU runs the eager model per item, in float32 (bf16 is slow there)


def invariant_runners(model, policy_config, device: str) -> dict:
    """The default engine and the batch-invariant one, as start-up builds them (startup/engine.py)."""
    if device != "cuda":
        return {"default": EagerRunner(model, torch.device(device)),
                "invariant": PerItemRunner(model, torch.device(device))}
    from vlaserve.runtime.graphs import FastRunner

    table = served_table(device)
    return {"default": FastRunner(model, policy_config, launch_table=table),
            "invariant": FastRunner(model, policy_config, gemm_library="invariant", attention_library="invariant",
                                    launch_table=table.batch_invariant_table())}


def rotations(n: int, b: int) -> list[list[int]]:
    """Batches of b of n observations in which each observation sits at every position: b consecutive
    observations (mod n) from every start."""
    return [[(start + j) % n for j in range(b)] for start in range(n)]


def bit_identity(alone: torch.Tensor, runs: list[tuple[str, list[int], torch.Tensor]]) -> dict:
    """Each batch run's items against the observations' alone actions (alone [N, H, A]; runs: (what, item
    indices, actions [B, H, A])): how many items were compared, the mismatches (what, batch size, position,
    observation, max|Δ|), and whether all were bit-identical."""
    mismatches, checked = [], 0
    for what, items, actions in runs:
        for position, item in enumerate(items):
            checked += 1
            if not torch.equal(actions[position].cpu(), alone[item].cpu()):
                mismatches.append({"run": what, "batch": len(items), "position": position, "observation": item,
                                   "max_abs": maxdiff(actions[position].cpu(), alone[item].cpu())})
    return {"checked": checked, "identical": not mismatches and checked > 0, "mismatches": mismatches[:20],
            "mismatched": len(mismatches)}


def batch_invariant_run(smoke: bool, device: str, batches: list[int]) -> dict:
    model, policy_config = bench_model(smoke, device, torch.float32 if smoke else torch.bfloat16)
    vocab = model.config.vlm.vocab_size
    engines = invariant_runners(model, policy_config, device)
    bucket = default_bucket()
    results: dict = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "smoke": smoke, "batches": batches,
                     "workload": {"cameras": CAMERAS, "tokens": TOKENS, "valid_tokens": VALID_TOKENS,
                                  "default_bucket": bucket, "horizon": HORIZON, "steps": STEPS},
                     "timings": {}}
    for b in batches:
        inputs, noise = make_inputs(b, vocab, seed=b, device=device)
        row = {}
        for name, length in (("default_served", bucket), ("default_full_length", TOKENS),
                             ("invariant", TOKENS)):
            engine = engines["invariant" if name == "invariant" else "default"]
            batch = bucketed(inputs, length)
            row[name] = time_ms(lambda: served_call(engine, batch, noise), device, **TIMING)
        p50 = {name: t["p50_ms"] for name, t in row.items()}
        row["cost_vs_default_served"] = p50["invariant"] / p50["default_served"] - 1
        row["cost_vs_default_same_length"] = p50["invariant"] / p50["default_full_length"] - 1
        results["timings"][b] = row
        log(f"b{b}:", p50, f"cost {row['cost_vs_default_served']:+.1%} (same length "
                           f"{row['cost_vs_default_same_length']:+.1%})")

    engine = engines["invariant"]
    n = max(SMOKE_OBSERVATIONS if smoke else INVARIANT_OBSERVATIONS, *batches)
    pool, pool_noise = make_inputs(n, vocab, seed=1000, device=device)

    def pick(items: list[int]) -> tuple[ModelInputs, torch.Tensor]:
        index = torch.tensor(items, device=pool.tokens.device)
        return ModelInputs(*(t[index] for t in (pool.images, pool.image_masks, pool.tokens, pool.token_mask))), \
            pool_noise[index]

    alone, entries = [], []
    for i in range(n):
        actions, _ = sample(engine, *pick([i]), vision_slots=CAMERAS)
        alone.append(actions[0])
        entries.append(engine.prefix_entry(0))
    alone = torch.stack(alone)
    runs = []
    for b in batches:
        for items in rotations(n, b):
            runs.append(("graphs", items, sample(engine, *pick(items), vision_slots=CAMERAS)[0]))
        items = list(range(b))
        runs.append(("prefix_cache", items, sample(engine, *pick(items), prefix=[entries[i] for i in items],
                                                   vision_slots=CAMERAS)[0]))
        inputs, noise = pick(items)
        actions, times = engine.dispatch(inputs, noise, STEPS, None, None, CAMERAS, graphs=False)
        times.read()
        runs.append(("no_graphs", items, actions.clone()))
    results["bit_identity"] = {"observations": n, **bit_identity(alone, runs)}
    return results


def plot_invariant(results: dict, out) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = list(results["timings"])
    for name in ("default_served", "default_full_length", "invariant"):
        ax.plot(batches, [results["timings"][b][name]["p50_ms"] for b in batches], marker="o", label=name)
    ax.set_xlabel("batch size")
    ax.set_ylabel("p50 ms per call")
    identical = results["bit_identity"]["identical"]
    ax.set_title(f"batch-invariant vs default ({results['gpu']}); bit-identical: {identical}")
    ax.legend()
    save_png(fig, out, "bench_gpu_invariant")


def fp8_gemm_tflops(device: str, n: int = 8192) -> float:
    """The fp8 GEMM ceiling, burst: torch._scaled_mm of two n x n e4m3 matrices with row-wise scales
    and bf16 out, the product the fp8 path runs."""
    a = torch.randn(n, n, device=device).to(E4M3)
    b = torch.randn(n, n, device=device).to(E4M3)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    t = time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device,
                warmup=3, iters=10)["p50_ms"]
    return 2 * n**3 / (t * 1e-3) / 1e12


def fp8_quantizer_check(device: str) -> dict:
    """The fast path's one-kernel activation quantization against torch's quantize_rows on a batch-8
    prefix's GEMM inputs (7744 tokens; width 2048 and the MLP's 16384): the same bits, and both times."""
    from vlaserve.model.fp8 import quantize_rows
    from vlaserve.runtime.fast import fp8_kernels

    out = {}
    for k in (2048, 16384):
        x = torch.randn(8 * (CAMERAS * 256 + TOKENS), k, device=device, dtype=torch.bfloat16)
        x[0] = 0
        q, s = fp8_kernels.quantize_rows(x)
        q_ref, s_ref = quantize_rows(x)
        out[k] = {"bits_equal": torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref),
                  "triton_us": 1e3 * time_ms(lambda: fp8_kernels.quantize_rows(x), device, **TIMING)["p50_ms"],
                  "torch_us": 1e3 * time_ms(lambda: quantize_rows(x), device, **TIMING)["p50_ms"]}
    return out


def fp8_section(model, model32, policy_config, served, batches, bucket: int, flops_bucket: dict, timings: dict,
                args, device: str) -> dict:
    """--precision fp8: a copy of the model with the prefix's and SigLIP's linear layers in fp8, served
    as bf16 is (the fast path on CUDA, the eager runner on a CPU), at the default prompt bucket."""
    fp8_model, _ = bench_model(args.smoke, device)  # the same seeded weights (a deep copy would carry the bf16 fusion)
    converted = convert_to_fp8(fp8_model)
    if device == "cuda":
        from vlaserve.runtime.graphs import FastRunner

        engine = FastRunner(fp8_model, policy_config, attention_library=args.attention_library,
                            launch_table=served_table(device))
    else:
        engine = EagerRunner(fp8_model, torch.device(device))
    vocab = model.config.vlm.vocab_size
    out = {"fp8_layers": len(converted),
           "weight_bytes": {name: sum(p.numel() * p.element_size() for p in m.parameters())
                            for name, m in (("bf16", model), ("fp8", fp8_model))},
           # the fp8 tensor cores' ceiling; a CPU has none (and torch 2.11's CPU _scaled_mm takes no row scales)
           "fp8_gemm_tflops": fp8_gemm_tflops(device) if device == "cuda" else None,
           "quantizer": fp8_quantizer_check(device) if device == "cuda" else None,
           "per_batch": {}}
    log("fp8:", {k: v for k, v in out.items() if k != "per_batch"})
    for b in batches:
        inputs, noise = make_inputs(b, vocab, seed=b, device=device)
        short = bucketed(inputs, bucket)
        t = time_ms(lambda: served_call(engine, short, noise), device, **TIMING)
        t.update(stage_medians(engine, short, noise))
        prefix_flop = b * (flops_bucket["vision_flop"] + flops_bucket["prefix_flop"])
        errors = {"fp8": [], "bf16": []}
        cos = []
        for seed in range(1, 3 if args.smoke else 9):  # one call's max is a noisy draw: several inputs
            inputs, noise = make_inputs(b, vocab, seed=100 * b + seed, device=device)
            short = bucketed(inputs, bucket)
            ref = eager(model32, inputs, noise)
            fp8_actions, _ = sample(engine, short, noise)
            bf16_actions, _ = sample(served, short, noise)
            errors["fp8"].append(per_item_max(fp8_actions, ref))
            errors["bf16"].append(per_item_max(bf16_actions, ref))
            cos.extend(cosines(bf16_actions.float().cpu().numpy(), fp8_actions.float().cpu().numpy()).tolist())
        out["per_batch"][b] = {
            "fp8": t, "bf16": timings[b]["fast_default_bucket"],
            "speedup": timings[b]["fast_default_bucket"]["p50_ms"] / t["p50_ms"],
            "prefix_tflops": prefix_flop / (t["prefix_p50_ms"] * 1e-3) / 1e12,
            "error_vs_fp32": {k: {"mean": statistics.mean(v), "max": max(v), "calls": len(v)} for k, v in errors.items()},
            "cosine_to_bf16": {"mean": statistics.mean(cos), "worst": min(cos), "samples": len(cos)}}
        row = out["per_batch"][b]
        ceiling = f" of {out['fp8_gemm_tflops']:.0f}" if out["fp8_gemm_tflops"] else ""
        log(f"fp8 b={b}: {t['p50_ms']:.2f} ms (bf16 {row['bf16']['p50_ms']:.2f}), prefix {t['prefix_p50_ms']:.2f} ms "
            f"at {row['prefix_tflops']:.0f} TFLOP/s{ceiling}; error vs fp32",
            row["error_vs_fp32"], "cosine to bf16", row["cosine_to_bf16"])
    return out


def profiles(results, served, model, policy_config, inputs, noise, timings, flops, args) -> None:
    """CUDA only: vision alone in its own graph, per-kernel profiles at batch 1 and 8 (with and
    without PDL), achieved rates and floors at batch 8."""
    from vlaserve.runtime.graphs import FastRunner

    g = torch.cuda.CUDAGraph()
    flat = inputs.images.flatten(0, 1)
    with torch.no_grad():
        served.fast.vision(flat)
        with torch.cuda.graph(g):
            served.fast.vision(flat)
    results["vision_b1_ms"] = time_ms(g.replay)["p50_ms"]
    results["profile_b1"] = profile_kernels(served, inputs, noise)
    inputs8, noise8 = make_inputs(8, model.config.vlm.vocab_size, seed=8)
    results["profile_b8"] = profile_kernels(served, inputs8, noise8)
    t8 = timings.get(8, {}).get("fast_triton_graphs")
    if t8:
        results["achieved_b8"] = {
            "prefix_tflops": 8 * (flops["vision_flop"] + flops["prefix_flop"]) / (t8["prefix_p50_ms"] * 1e-3) / 1e12,
            "expert_tflops": 8 * flops["expert_flop_per_step"] * STEPS / (t8["denoise_p50_ms"] * 1e-3) / 1e12,
            "expert_weight_tbps": flops["expert_weight_bytes_per_step"] * STEPS / (t8["denoise_p50_ms"] * 1e-3) / 1e12}
        results["floor_ms_b8"] = floor_ms_batched(flops, 8, STEPS, results["ceilings"])
        results["floor_ms_b8_sustained"] = floor_ms_batched(flops, 8, STEPS, at_sustained(results["ceilings"]))
    # With PDL a kernel starts before its predecessor ends and waits: its time in the profile
    # includes that wait. The same graphs without PDL attribute time to kernels.
    table = served_table(str(next(model.parameters()).device))
    plain = FastRunner(model, policy_config, use_graphs=True, use_triton=True, gemm_library=args.gemm_library,
                       attention_library=args.attention_library, launch_table=table.with_features(pdl=False, tma=table.tma))
    for b, (inp, noi) in ((1, (inputs, noise)), (8, (inputs8, noise8))):
        sample(plain, inp, noi)
        results[f"no_pdl_b{b}_p50_ms"] = time_ms(lambda: served_call(plain, inp, noi))["p50_ms"]
        results[f"profile_b{b}_no_pdl"] = profile_kernels(plain, inp, noi)
    plain = None  # its graphs and buffers go before the cache is emptied
    torch.cuda.empty_cache()


def plot(results, out):
    plt = pyplot()
    batches = sorted(results["timings"], key=int)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in results["timings"][batches[0]]:
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
    ax.set_ylabel("time per call, p50 (ms)")
    ax.set_title(f"Pi0.5 ALOHA-3 on {results['gpu']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(True, which="both", alpha=0.3)
    save_png(fig, out, "bench_gpu")


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
        "vision b1 ms:", round(results.get("vision_b1_ms", 0), 3), "peak GiB:", results.get("peak_mem_gib_b1_fast"))


if __name__ == "__main__":
    main()
