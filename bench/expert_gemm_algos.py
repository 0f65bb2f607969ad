"""Probe (issue 14): the expert's GEMMs at batch 4 and 8 (200 / 400 rows) under every algorithm
cuBLASLt's heuristic offers, and under quack's GEMM where it is installed, against what we serve.

    python3 bench/expert_gemm_algos.py [--algos 32] [--out DIR]

At batch 8 the expert's four GEMMs take ~10 ms of a call against ~3.5 at the GPU's rate (run 122:
cuBLAS gate_up 15.9 us, qkv 8.7 us, our split-K o + down 25 us a layer-step). gemm_algos.py (runs
86-90) raced cuBLASLt's algorithms only on the prefix's and SigLIP's shapes, where torch's choice
was within 1-4% of the best. These shapes are small (400 x 1024 outputs for o and down): tile,
split and cluster choices matter more there.

Each candidate runs the 18 layers' weights in turn inside one CUDA graph (the weights stream from
HBM as in a call; one layer's largest, gate_up, is 16.8 MB), p50 of 20 replays, per layer. Its
output is compared with F.linear's (max |diff| relative to the output's scale: sums in another
order, one bf16 rounding) and with itself run again (bit-identical: no atomics). Per call: 180
products a family (18 layers x 10 steps). The served row is F.linear for qkv and gate_up from
batch 4 (kernels.TUNING["cublas_from_batch"]), our split-K partials for o and down (their sum is
read by the residual-norm kernel that follows, as cuBLAS's bf16 output would be).
JSON: bench/results/expert_gemm_algos.json.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_gpu import log
from cute_probe import graphed_us
from gemm_algos import CublasLt

from vlaserve.runtime.fast import kernels

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (2560, 1024), "o": (1024, 2048), "gate_up": (8192, 1024), "down": (1024, 4096)}  # (N, K)
LAYERS, STEPS, CHUNK = 18, 10, 50


def served(family: str, batch: int, x, ws):
    if family in ("o", "down") and not kernels.through_cublas(family, batch):
        return "split-K partials", lambda i: kernels.splitk_partials(x, ws[i])
    return "F.linear", lambda i: F.linear(x, ws[i])


def product(fn, out: torch.Tensor) -> torch.Tensor:
    """Layer 0's product in fp32: what fn returns, or `out` where it writes there (cuBLASLt); the
    sum of split-K partials [splits, R, N]."""
    y = fn(0)
    y = out if y is None else y
    return y.sum(0) if y.dim() == 3 else y.float()


def quack_candidates(x, ws) -> list:
    try:
        from quack.gemm_interface import gemm
    except ImportError:
        return []
    return [("quack", lambda i: gemm(x, ws[i].t(), tuned=False)),
            ("quack tuned", lambda i: gemm(x, ws[i].t(), tuned=True))]


def case(lt: CublasLt, family: str, batch: int, count: int) -> dict:
    n, k = SHAPES[family]
    m = CHUNK * batch
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(LAYERS)]
    reference = F.linear(x, ws[0]).float()
    scale = reference.abs().max().item()
    flop = 2 * m * n * k
    label, served_fn = served(family, batch, x, ws)
    plan = lt.plan(m, n, k, count)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    candidates = [("served: " + label, served_fn)]
    if label != "F.linear":
        candidates.append(("F.linear", lambda i: F.linear(x, ws[i])))
    candidates += [(f"lt{j}", (lambda h: lambda i: lt.linear(plan, h, x, ws[i], outs[i]))(h))
                   for j, h in enumerate(plan["algos"])]
    candidates += quack_candidates(x, ws)
    rows = []
    for name, fn in candidates:
        row: dict = {"candidate": name}
        try:
            first = product(fn, outs[0]).clone()
            row["repeat_identical"] = bool(torch.equal(first, product(fn, outs[0])))
            row["rel_diff_vs_flinear"] = (first - reference).abs().max().item() / scale
            row["us"] = graphed_us(lambda: [fn(i) for i in range(LAYERS)], LAYERS)
            row["tflops"] = flop / row["us"] / 1e6
        except Exception as exc:  # an algorithm the shape does not take: recorded, the probe goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        if name.startswith("lt"):
            row["config"] = lt.describe(plan["algos"][int(name[2:])].algo)
        rows.append(row)
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    result = {"family": family, "batch": batch, "m": m, "n": n, "k": k, "flop": flop, "candidates": rows,
              "served_us": rows[0].get("us"), "best": best["candidate"], "best_us": best["us"]}
    log(f"b{batch} {family:7s} M={m} N={n} K={k}: served ({label}) {result['served_us']:.1f} us, "
        f"F.linear {next(r['us'] for r in rows if r['candidate'].endswith('F.linear')):.1f}, best {best['candidate']} "
        f"{best['us']:.1f} us ({best['tflops']:.0f} TFLOP/s, diff {best['rel_diff_vs_flinear']:.1e}, "
        f"repeat {best['repeat_identical']}) of {len(timed)}")
    for r in sorted(timed, key=lambda r: r["us"])[:5]:
        log(f"    {r['candidate']:22s} {r['us']:7.1f} us {r.get('config', '')}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", type=int, default=32, help="algorithms to ask cuBLASLt's heuristic for")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    F.linear(torch.ones(8, 8, device="cuda", dtype=torch.bfloat16), torch.ones(8, 8, device="cuda", dtype=torch.bfloat16))
    lt = CublasLt()
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": [], "per_call": {}}
    for batch in (8, 4):
        served_ms = best_ms = 0.0
        for family in SHAPES:
            r = case(lt, family, batch, args.algos)
            results["cases"].append(r)
            served_ms += LAYERS * STEPS * r["served_us"] / 1e3
            best_ms += LAYERS * STEPS * r["best_us"] / 1e3
        results["per_call"][batch] = {"served_ms": served_ms, "best_ms": best_ms, "saved_ms": served_ms - best_ms}
        log(f"b{batch}: the expert's GEMMs served {served_ms:.2f} ms a call, best per family {best_ms:.2f} "
            f"(-{served_ms - best_ms:.2f})")
    for d in filter(None, [ROOT / "bench" / "results", args.out]):
        d.mkdir(parents=True, exist_ok=True)
        (d / "expert_gemm_algos.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
