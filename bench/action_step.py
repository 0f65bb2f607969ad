"""The fused action step between expert passes (fp32 out-projection, Euler update, fp32
in-projection to the next step's bf16 input), as served (kernels.action_step: broadcast products
and tl.sum) against a variant whose two products are fp32 `tl.dot`s (input_precision="ieee": FMA,
no TF32) over 16-row tiles, and against torch's ops (cuBLAS sgemm + elementwise).

    python3 bench/action_step.py [--out DIR]

At 50 rows (batch 1) and 400 (batch 8): each candidate's 11 launches of one call (the in-projection
of the noise, then 10 out + Euler + in steps) captured in one CUDA graph, p50 of 50 replays. Each
candidate's x and h are compared with torch's fp32 ops (x: max |diff|; h: bf16 values that differ).
JSON + PNG in bench/results/action_step.json|png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vlaserve.runtime.fast import kernels  # noqa: E402

WIDTH, ACTION, STEPS = 1024, 32, 10


@triton.jit
def action_step_dot(y_ptr, x_ptr, x_out_ptr, h_ptr, w_out_ptr, b_out_ptr, w_in_ptr, b_in_ptr, R, dt,
                    W: tl.constexpr, A: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_W: tl.constexpr, W_PER: tl.constexpr, HAS_OUT: tl.constexpr, HAS_IN: tl.constexpr):
    pid_r, pid_w = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows[:, None] < R
    a = tl.arange(0, A)
    x = tl.load(x_ptr + rows[:, None] * A + a[None, :], mask=live, other=0.0)
    if HAS_OUT:
        v = tl.zeros((BLOCK_R, A), dtype=tl.float32)
        for k0 in range(0, W, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            y = tl.load(y_ptr + rows[:, None] * W + ks[None, :], mask=live, other=0.0).to(tl.float32)
            w_out_t = tl.load(w_out_ptr + a[None, :] * W + ks[:, None])  # [BLOCK_K, A]
            v = tl.dot(y, w_out_t, v, input_precision="ieee")
        v += tl.load(b_out_ptr + a)[None, :]
        x = x + dt * v
        if pid_w == 0:
            tl.store(x_out_ptr + rows[:, None] * A + a[None, :], x, mask=live)
    if HAS_IN:
        for w0 in range(pid_w * W_PER, (pid_w + 1) * W_PER, BLOCK_W):
            ws = w0 + tl.arange(0, BLOCK_W)
            w_in_t = tl.load(w_in_ptr + ws[None, :] * A + a[:, None])  # [A, BLOCK_W]
            h = tl.dot(x, w_in_t, input_precision="ieee") + tl.load(b_in_ptr + ws)[None, :]
            tl.store(h_ptr + rows[:, None] * W + ws[None, :], h.to(h_ptr.dtype.element_ty), mask=live)


def dot_step(cfg):
    def step(x, h, w_in, b_in, y=None, w_out=None, b_out=None, x_out=None, dt=0.0):
        r = x.shape[0]
        row_blocks = triton.cdiv(r, cfg["block_r"])
        chunks = 1
        while chunks * 2 * cfg["block_w"] <= WIDTH and row_blocks * chunks * 2 <= cfg["programs"]:
            chunks *= 2
        action_step_dot[(row_blocks, chunks)](
            x if y is None else y, x, x if x_out is None else x_out, x if h is None else h,
            x if w_out is None else w_out, x if b_out is None else b_out, w_in, b_in, r, dt,
            W=WIDTH, A=ACTION, BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"], BLOCK_W=cfg["block_w"],
            W_PER=WIDTH // chunks, HAS_OUT=y is not None, HAS_IN=h is not None, num_warps=cfg["warps"])
    return step


def served_step(x, h, w_in, b_in, y=None, w_out=None, b_out=None, x_out=None, dt=0.0):
    kernels.action_step(x, h, w_in, b_in, y=y, w_out=w_out, b_out=b_out, x_out=x_out, dt=dt)


def torch_step(x, h, w_in, b_in, y=None, w_out=None, b_out=None, x_out=None, dt=0.0):
    if y is not None:
        x_out.copy_(x + dt * F.linear(y.float(), w_out, b_out))
        x = x_out
    if h is not None:
        h.copy_(F.linear(x, w_in, b_in))


def one_call(step, noise, ys, weights, dt):
    """11 launches as the fast path's denoise makes them; ys[i] stands for step i's expert output."""
    w_in, b_in, w_out, b_out = weights
    r = noise.shape[0]
    xs = (noise.clone(), torch.empty_like(noise))
    h = torch.empty(r, WIDTH, dtype=torch.bfloat16, device=noise.device)
    hs = []
    step(xs[0], h, w_in, b_in)
    hs.append(h.clone())
    for i in range(STEPS):
        step(xs[i % 2], h if i + 1 < STEPS else None, w_in, b_in, y=ys[i], w_out=w_out, b_out=b_out,
             x_out=xs[(i + 1) % 2], dt=dt)
        if i + 1 < STEPS:
            hs.append(h.clone())
    return xs[STEPS % 2], hs


def timed(step, noise, ys, weights, dt) -> float:
    w_in, b_in, w_out, b_out = weights
    r = noise.shape[0]
    xs = (noise.clone(), torch.empty_like(noise))
    h = torch.empty(r, WIDTH, dtype=torch.bfloat16, device=noise.device)

    def launches():
        step(xs[0], h, w_in, b_in)
        for i in range(STEPS):
            step(xs[i % 2], h if i + 1 < STEPS else None, w_in, b_in, y=ys[i], w_out=w_out, b_out=b_out,
                 x_out=xs[(i + 1) % 2], dt=dt)

    launches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    weights = (torch.randn(WIDTH, ACTION, device=dev) * 0.1, torch.randn(WIDTH, device=dev) * 0.02,
               torch.randn(ACTION, WIDTH, device=dev) * 0.03, torch.randn(ACTION, device=dev) * 0.02)
    dt = -1.0 / STEPS
    configs = [dict(block_r=r, block_k=k, block_w=w, warps=n, programs=p)
               for r, k, w, n, p in itertools.product((16, 32), (128, 256), (32, 64), (2, 4), (64, 128))]
    results = {}
    for batch in (1, 8):
        r = batch * 50
        noise = torch.randn(r, ACTION, device=dev)
        ys = [torch.randn(r, WIDTH, device=dev).to(torch.bfloat16) for _ in range(STEPS)]
        ref_x, ref_hs = one_call(torch_step, noise, ys, weights, dt)

        def check(step):
            x, hs = one_call(step, noise, ys, weights, dt)
            return {"x_max_diff": (x - ref_x).abs().max().item(),
                    "h_bf16_values_differing": int(sum((a != b).sum().item() for a, b in zip(hs, ref_hs))),
                    "h_max_diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(hs, ref_hs))}

        rows = [{"candidate": "torch (cuBLAS sgemm + elementwise)", "us": timed(torch_step, noise, ys, weights, dt)}]
        if r <= kernels.TUNING["action"]["max_rows"]:
            rows.append({"candidate": "served (kernels.action_step)", "us": timed(served_step, noise, ys, weights, dt),
                         **check(served_step)})
        for cfg in configs:
            step = dot_step(cfg)
            try:
                rows.append({"candidate": f"dot {cfg}", "config": cfg, "us": timed(step, noise, ys, weights, dt),
                             **check(step)})
            except Exception as error:  # a config the compiler rejects
                print(f"b{batch} dot {cfg}: {type(error).__name__}: {str(error)[:120]}", flush=True)
        for row in rows[:2]:
            print(f"b{batch} {row['candidate']:40s} {row['us']:7.1f} us/call", flush=True)
        best = sorted((row for row in rows if "config" in row), key=lambda row: row["us"])[:5]
        for row in best:
            print(f"b{batch} {row['candidate']:40s} {row['us']:7.1f} us/call  x {row['x_max_diff']:.1e}  "
                  f"h differing {row['h_bf16_values_differing']} (max {row['h_max_diff']:.1e})", flush=True)
        results[batch] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "action_step.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, (batch, rows) in zip(axes, results.items()):
        shown = rows[:2] + sorted((row for row in rows if "config" in row), key=lambda row: row["us"])[:3]
        ax.barh([row["candidate"][:38] for row in shown], [row["us"] for row in shown])
        ax.set_title(f"action steps of one call, batch {batch}", fontsize=8)
        ax.set_xlabel("us per call")
        ax.tick_params(axis="y", labelsize=5)
    fig.savefig(args.out / "action_step.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
