"""What each fast-path kernel change buys, rung by rung, measured in one run (issue 14's ladder).

    python3 bench/kernel_ladder.py [--out DIR]

Full-size Pi0.5 (random weights, bf16 + the fp32 set), ALOHA-3 inputs (bench_gpu.py's workload).
The denoise stage (10 Euler steps, one CUDA graph) at batch 1 and 8; each rung adds one change:
  0 legacy   fp32 action projections through cuBLAS + elementwise Euler update, no PDL, the launch
             configs of runs 6-25 (64-row tiles at every batch size, attention 32 x 8 splits)
  1 fused    action in/out + Euler update in one kernel per step (kernels.action_step)
  2 pdl      + programmatic dependent launch (each kernel waits at its start)
  3 tiles    + the committed launch configs: per-batch row tiles and attention splits (the
             defaults; bench/tune_batches.py sweeps them per batch size)
  4 cublas   + the expert's qkv and gate_up GEMMs through cuBLAS from batch 4 (kernels.TUNING
             "cublas_from_batch"; bench/expert_gemms.py measures every subset)
(Runs 26-28 also had rungs that loaded the first weight tile before the wait and prefetched the
rest into L2: both slower, removed; docs/benchmarks.md.)
Per rung: p50 ms, max|Δ| of actions vs rung 0 and vs the fp32 eager model; PDL on vs off must be
bit-identical. Then the prefix attention (Triton vs SDPA) at batch 1 and 8, full calls at 1/2/4/8
with the kept settings and per-kernel profiles at batch 1 and 8. JSON + PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import (STEPS, TOKENS, eager, log, make_inputs, maxdiff,  # noqa: E402
                       profile_kernels, time_cuda)

from vlaserve.checkpoint.weights import random_model  # noqa: E402
from vlaserve.config import ModelConfig, PolicyConfig  # noqa: E402
from vlaserve.model.gemma import MASK_VALUE  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

HORIZON_ROWS = 50
CAMERA_NAMES = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")

BATCHES = (1, 2, 4, 8)
# The launch configs before this ladder (runs 6-25).
LEGACY_TUNING = {
    "attention": {"block_m": 32, "splits": 8, "block_t": 64, "warps": 4, "stages": 2},
    "attention_batched": {},
    "batched": {65: {
        "splitk": {"block_r": 64, "block_n": 32, "block_k": 256, "max_waves": 1, "warps": 4, "stages": 4},
        "geglu": {"block_r": 64, "block_n": 32, "block_k": 128, "warps": 4, "stages": 5},
        "qkv": {"block_r": 64, "block_n": 16, "block_k": 128, "warps": 4, "stages": 5},
    }},
    "prefix_attention": {"block_m": 64, "splits": 1, "block_t": 64, "warps": 8, "stages": 2},
    "action": {"block_r": 2, "block_k": 64, "block_w": 64, "programs": 128, "max_rows": 64, "unroll": 1},
    "cublas_from_batch": {},
}


def capture(fn, stream: torch.cuda.Stream | None = None):
    """fn run twice on a side stream (compiles, allocates), then captured there -> (graph, its output).
    The graph gets a memory pool of its own, so a failed capture leaves no pool recording."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    return graph, out


def denoise_graph(fast, buf):
    """One CUDA graph over the 10 Euler steps on the runner's static buffers (prefix already run)."""
    sched = fast.schedule(STEPS)
    return capture(lambda: fast.denoise(buf["pad"], buf["noise"], sched, buf["k_cache"], buf["v_cache"], None))


def time_denoise(fast, buf) -> tuple[float, torch.Tensor]:
    graph, out = denoise_graph(fast, buf)
    t = time_cuda(graph.replay, warmup=3, iters=20)["p50_ms"]
    graph.replay()
    result = out.clone()
    del graph, out
    torch.cuda.empty_cache()
    return t, result


def prefix_attention(b: int, plen: int, heads: int, d: int, pads: int = 130) -> dict:
    """The prefix's attention alone (MQA, one KV head; the last `pads` keys masked): our Triton
    kernel vs SDPA in three layouts, one graph each."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, heads * plen, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = -(-plen // 64) * 64
    k = torch.randn(b, cache, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    valid = torch.zeros(b, cache, dtype=torch.bool, device="cuda")
    valid[:, :plen - pads] = True
    bias = torch.where(valid, 0.0, MASK_VALUE).float()

    def ours():
        return kernels.mqa_attention(q, k[:, :plen], v[:, :plen], bias[:, :plen].contiguous(), heads, plen,
                                     kernels.prefix_attention_config(b))

    def sdpa():
        qh = q.view(b, heads, plen, d)
        mask = bias[:, None, None, :plen].to(torch.bfloat16)
        o = F.scaled_dot_product_attention(qh, k[:, None, :plen], v[:, None, :plen], attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(b, plen, heads * d)

    # The layout model.py gives SDPA: q token-major [B, P, heads, D] (its output keeps it).
    q_tokens = q.view(b, heads, plen, d).transpose(1, 2).contiguous()
    mask_bf16 = bias[:, None, None, :plen].to(torch.bfloat16)

    def sdpa_token_major():
        o = F.scaled_dot_product_attention(q_tokens.transpose(1, 2), k[:, None, :plen], v[:, None, :plen],
                                           attn_mask=mask_bf16, enable_gqa=True)
        return o.transpose(1, 2).reshape(b, plen, heads * d)

    def sdpa_folded():  # MQA as one head with a heads-times longer query axis (row = token * heads + head)
        o = F.scaled_dot_product_attention(q_tokens.view(b, 1, plen * heads, d), k[:, None, :plen],
                                           v[:, None, :plen], attn_mask=mask_bf16)
        return o.view(b, plen, heads * d)

    out = {}
    for name, fn in (("triton", ours), ("sdpa", sdpa), ("sdpa_token_major", sdpa_token_major),
                     ("sdpa_folded", sdpa_folded)):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = fn()
        out[f"{name}_us"] = time_cuda(graph.replay)["p50_ms"] * 1e3
        out[f"{name}_out"] = res
    # Valid query rows only: padding queries are treated differently on purpose (model.py).
    rows = valid[:, :plen]
    reference = out.pop("triton_out")
    flop = 4 * b * heads * plen * plen * d
    out["triton_tflops"] = flop / out["triton_us"] / 1e6
    for name in ("sdpa", "sdpa_token_major", "sdpa_folded"):
        out[f"{name}_max_delta_valid_rows"] = float(((out.pop(f"{name}_out") - reference).float().abs()
                                                     * rows[:, :, None]).max())
        out[f"{name}_tflops"] = flop / out[f"{name}_us"] / 1e6
    return out


def action_step_bench(model, cfg) -> dict:
    """The 11 action in/out passes of a call alone, one graph each: the fused kernel (a few launch
    configs) against the eager ops (fp32 cuBLAS linears + elementwise update)."""
    out = {}
    w_in, b_in = model.action_in_proj.weight, model.action_in_proj.bias
    w_out, b_out = model.action_out_proj.weight, model.action_out_proj.bias
    width = w_in.shape[0]
    configs = {"default": dict(kernels.TUNING["action"]),
               "k128_w128": {"block_r": 2, "block_k": 128, "block_w": 128, "programs": 256},
               "r4": {"block_r": 4, "block_k": 64, "block_w": 64, "programs": 256},
               "p512": {"block_r": 2, "block_k": 64, "block_w": 64, "programs": 512},
               "p128": {"block_r": 2, "block_k": 64, "block_w": 64, "programs": 128}}
    configs = {name: {**c, "max_rows": 10**9} for name, c in configs.items()}
    for b in (1, 2, 4, 8):
        r = b * HORIZON_ROWS
        g = torch.Generator(device="cuda").manual_seed(b)
        x0 = torch.randn(r, 32, device="cuda", generator=g)
        y = torch.randn(r, width, device="cuda", generator=g).to(torch.bfloat16)
        xs = (x0.clone(), torch.empty_like(x0))
        h = torch.empty(r, width, device="cuda", dtype=torch.bfloat16)

        def fused():
            xs[0].copy_(x0)
            kernels.action_step(xs[0], h, w_in, b_in)
            for s in range(STEPS):
                kernels.action_step(xs[s % 2], h if s + 1 < STEPS else None, w_in, b_in, y=y, w_out=w_out,
                                    b_out=b_out, x_out=xs[(s + 1) % 2], dt=-0.1)
            return xs[STEPS % 2]

        def eager_ops():
            x = x0
            hh = F.linear(x, w_in, b_in).to(torch.bfloat16)
            for _ in range(STEPS):
                v = F.linear(y.float(), w_out, b_out)
                x = x + -0.1 * v
                hh = F.linear(x, w_in, b_in).to(torch.bfloat16)
            return x

        row = {}
        for name, fn in [("eager", eager_ops)] + [(n, fused) for n in configs]:
            if name in configs:
                kernels.TUNING["action"] = configs[name]
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = fn()
            row[f"{name}_us"] = time_cuda(graph.replay)["p50_ms"] * 1e3
            graph.replay()
            if name == "eager":
                ref = res.clone()
            else:
                row[f"{name}_vs_eager"] = maxdiff(res, ref)
        kernels.TUNING["action"] = configs["default"]
        out[b] = row
    batches = [b for b in out]
    best = min(configs, key=lambda n: sum(out[b][f"{n}_us"] for b in batches))
    # The fused kernel where it beats the eager ops, from batch 1 up.
    max_rows = 0
    for b in batches:
        if out[b][f"{best}_us"] >= out[b]["eager_us"]:
            break
        max_rows = b * HORIZON_ROWS
    kernels.TUNING["action"] = {**configs[best], "max_rows": max_rows}
    out["kept"] = kernels.TUNING["action"]
    return out


def bench_run(name: str, flags: dict[str, str] | None = None):
    """The run's command line (--out, and each of `flags`, {name: help}, as an on/off option), its
    results dict (device and versions filled in) and a `save` that writes it as <name>.json under
    bench/results and --out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    for flag, help_text in (flags or {}).items():
        ap.add_argument(f"--{flag}", action="store_true", help=help_text)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__}

    def save():
        for d in filter(None, [ROOT / "results", Path(args.out) if args.out else None]):
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    return args, results, save


def timed_call(runner, x, noise, ref32) -> tuple[torch.Tensor, dict]:
    """One call's actions and its row: p50 ms, median prefix / denoise stage ms of 10 calls, the
    first call's seconds (compiles and captures), max|Δ| vs `ref32`, and whether a repeat is
    bit-identical."""
    t0 = time.perf_counter()
    out, _ = runner.sample(x, noise, STEPS, None)
    first_s = time.perf_counter() - t0
    again, _ = runner.sample(x, noise, STEPS, None)
    stages = [runner.sample(x, noise, STEPS, None)[1] for _ in range(10)]
    return out, {"p50_ms": time_cuda(lambda: runner.sample(x, noise, STEPS, None))["p50_ms"],
                 "prefix_ms": sorted(s["prefix_ms"] for s in stages)[5],
                 "denoise_ms": sorted(s["denoise_ms"] for s in stages)[5], "first_call_s": first_s,
                 "vs_fp32": maxdiff(out, ref32), "repeat_bit_identical": bool(torch.equal(out, again))}


def full_size_models():
    """Full-size Pi0.5 with random weights (bf16 + the fp32 set), the same weights upcast to fp32 (the
    accuracy reference), and the ALOHA-3 policy config."""
    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    return cfg, model, copy.deepcopy(model).float(), PolicyConfig(cfg, CAMERA_NAMES, 14, 14)


def denoise_setup():
    """Full-size Pi0.5 (random weights, bf16 + the fp32 set), an ungraphed FastRunner, and per batch
    size its static buffers after one call (prefix K/V and pad filled) and that call's inputs."""
    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    policy_config = PolicyConfig(cfg, CAMERA_NAMES, 14, 14)
    runner = FastRunner(model, policy_config, use_graphs=False)
    bufs, calls = {}, {}
    for b in BATCHES:
        calls[b] = make_inputs(b, cfg.vlm.vocab_size, seed=b)
        runner.sample(*calls[b], STEPS, None)
        bufs[b] = runner.buffers(b, TOKENS)
    return cfg, model, policy_config, runner.fast, bufs, calls


def main():
    args, results, save = bench_run("kernel_ladder")
    results["rungs"] = {}
    started = time.time()
    cfg, model, policy_config, fast, bufs, calls = denoise_setup()
    model32 = copy.deepcopy(model).float()
    refs = {b: eager(model32, *calls[b]) for b in BATCHES}
    log(f"built ({time.time() - started:.0f}s)")

    legacy: dict = {}

    def rung(name: str, note: str):
        row, outs = {"note": note}, {}
        for b in BATCHES:
            t, outs[b] = time_denoise(fast, bufs[b])
            row[f"b{b}_denoise_ms"] = t
            row[f"b{b}_vs_fp32"] = maxdiff(outs[b], refs[b])
            row[f"b{b}_vs_legacy"] = maxdiff(outs[b], legacy.get(b, outs[b]))
        log(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        results["rungs"][name] = row
        return row, outs

    defaults = copy.deepcopy(kernels.TUNING)
    kernels.TUNING.update(copy.deepcopy(LEGACY_TUNING))
    kernels.TUNING["pdl"] = False
    fast.FUSED_ACTION_IO = False
    _, legacy_outs = rung("0 legacy", "cuBLAS fp32 action projections, elementwise Euler update, no PDL")
    legacy.update(legacy_outs)
    fast.FUSED_ACTION_IO = True
    _, fused = rung("1 fused", "+ action in/out + Euler update in one kernel per step")
    kernels.TUNING["pdl"] = True
    try:
        _, pdl = rung("2 pdl", "+ programmatic dependent launch")
        results["pdl_bit_identical"] = {b: bool(torch.equal(pdl[b], fused[b])) for b in BATCHES}
        log("PDL on vs off bit-identical:", results["pdl_bit_identical"])
    except Exception as exc:  # e.g. a driver that cannot capture PDL launches into a graph
        results["pdl_error"] = f"{type(exc).__name__}: {exc}"
        log("PDL failed:", results["pdl_error"])
        kernels.TUNING["pdl"] = False
    save()
    for key in ("attention", "attention_batched", "batched", "action", "prefix_attention"):
        kernels.TUNING[key] = copy.deepcopy(defaults[key])
    rung("3 tiles", "+ the committed launch configs (per-batch row tiles and attention splits)")
    kernels.TUNING["cublas_from_batch"] = copy.deepcopy(defaults["cublas_from_batch"])
    rung("4 cublas", "+ qkv and gate_up through cuBLAS from batch 4 (bench/expert_gemms.py)")
    results["kept_tuning"] = copy.deepcopy(kernels.TUNING)
    save()

    g = cfg.vlm
    results["action_step"] = action_step_bench(model, cfg)
    log("action step:", json.dumps(results["action_step"]))
    save()
    results["prefix_attention"] = {b: prefix_attention(b, 3 * 256 + TOKENS, g.num_heads, g.head_dim)
                                   for b in (1, 2, 4, 8)}
    log("prefix attention:", json.dumps(results["prefix_attention"]))
    save()

    # Full calls with the kept settings, and where the time goes.
    final = FastRunner(model, policy_config)
    results["calls"] = {}
    for b in (1, 2, 4, 8):
        inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=b)
        out, _ = final.sample(inputs, noise, STEPS, None)
        stages = [final.sample(inputs, noise, STEPS, None)[1] for _ in range(10)]
        results["calls"][b] = {"p50_ms": time_cuda(lambda: final.sample(inputs, noise, STEPS, None))["p50_ms"],
                               "prefix_ms": sorted(s["prefix_ms"] for s in stages)[5],
                               "denoise_ms": sorted(s["denoise_ms"] for s in stages)[5],
                               "vs_fp32": maxdiff(out, eager(model32, inputs, noise)),
                               "vs_eager_bf16": maxdiff(out, eager(model, inputs, noise))}
        log(f"call b={b}:", json.dumps(results["calls"][b]))
        save()
    for b in (1, 8):
        inputs, noise = make_inputs(b, cfg.vlm.vocab_size, seed=b)
        log(f"profile b={b}")
        results[f"profile_b{b}"] = profile_kernels(final, inputs, noise)
    results["elapsed_s"] = time.time() - started
    save()
    plot(results, args.out)


def plot(results, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results["rungs"])
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(4 * len(BATCHES), 3.5))
    for ax, b in zip(axes, BATCHES):
        ax.bar(range(len(names)), [results["rungs"][n][f"b{b}_denoise_ms"] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.set_ylabel("denoise, 10 steps (ms)")
        ax.set_title(f"batch {b}, {results['gpu']}", fontsize=9)
    for d in filter(None, [ROOT / "results", Path(out) if out else None]):
        fig.savefig(d / "kernel_ladder.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
