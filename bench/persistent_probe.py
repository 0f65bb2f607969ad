"""Probe: what would a persistent expert kernel buy? (issue 14)

At batch 1 the expert streams 34.6 MB of weights per layer-step through four GEMMs (qkv 2560 x 1024,
o 1024 x 2048, gate_up 8192 x 1024, down 1024 x 4096; 50 rows), and today each is its own kernel
(plus norms, RoPE, attention and merges in between): 3.97 ms of the call's GEMM kernels against
1.5 ms of weight reads (run 65). A persistent kernel would run all of a step in one launch, its
programs resident for the whole step and separated only by grid barriers. This probe times exactly
that part, with one and the same split-K GEMM code in every variant, over the 10 x 18 layer-steps
of a call (18 layers of random weights, so the weights stream from HBM as in a real call):

- `launches`:     one kernel per GEMM and layer (one program per work item), 720 launches in a graph
- `launches_pdl`: the same with programmatic dependent launch, as the served kernels run
- `launches_pdl_tma`: the same with x and w tiles through TMA descriptors (run 74)
- `persistent_*`: one kernel per Euler step, the four GEMMs of each layer as phases with a grid
                  barrier after each (72 barriers a step), every work item looped over by a fixed set
                  of resident programs; two ways of polling the barrier's counter
- `no_barrier`:   the same persistent kernel without the barriers (not a valid kernel, since nothing
                  orders the phases: it bounds what the synchronization costs)

plus a barrier check (programs exchange values across 2,000 barriers, every read checked). Only
the GEMMs: no norm, RoPE, attention or merge, and each phase reads a fixed input (the barrier
orders it as a real data dependence would). The outputs of `persistent` and `launches` must be
bit-identical (the same code and sums) and match torch's fp32 product.

    python3 bench/persistent_probe.py [--out DIR]

Prints and saves JSON under bench/results/ (persistent_probe.json) and --out. Results: runs 68-69 in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_gpu import time_graphed

GEMMS = (("qkv", 2560, 1024), ("o", 1024, 2048), ("gate_up", 8192, 1024), ("down", 1024, 4096))  # N, K
LAYERS, STEPS, ROWS = 18, 10, 50
SPIN_LIMIT = 1 << 18  # a barrier that waits longer than this (~0.3 s) reports an error instead of hanging


@triton.jit
def _gemm_items(x_ptr, w_ptr, p_ptr, R, pid, nprog, N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Work item = (column tile, K split): fp32 partial sums [K / K_SPLIT, R, N]. Loads of x bypass
    # L1 (.cg): inside a persistent kernel another SM may have written it since this one last read.
    n_tiles: tl.constexpr = N // BLOCK_N
    items: tl.constexpr = n_tiles * (K // K_SPLIT)
    rows = tl.arange(0, BLOCK_R)
    for item in range(pid, items, nprog):
        cols = (item % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = item // n_tiles
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            ks = split * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < R, other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :])
            acc += tl.dot(x, tl.trans(w))
        tl.store(p_ptr + split * R * N + rows[:, None] * N + cols[None, :], acc, mask=rows[:, None] < R)


@triton.jit
def _grid_sync(bar_ptr, err_ptr, target, LIMIT: tl.constexpr, SPIN: tl.constexpr):
    # All of this program's stores issued (bar.sync), then one release increment; wait until every
    # program has arrived. The counter only grows: barrier i waits for i * nprog. SPIN 0 polls with
    # an acquire add of 0 (Triton emits it as ld.acquire.gpu), 1 with volatile (L1-bypassing) loads
    # and one acquire at the end.
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    if SPIN == 0:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.load(bar_ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < LIMIT):
        if SPIN == 0:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        else:
            seen = tl.load(bar_ptr, volatile=True)
        spins += 1
    if SPIN != 0:
        tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    if spins >= LIMIT:
        tl.atomic_max(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _one_gemm(x_ptr, w_ptr, p_ptr, R, N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # as the served kernels (kernels._await_inputs)
        gdc_wait()
        gdc_launch_dependents()
    _gemm_items(x_ptr, w_ptr, p_ptr, R, tl.program_id(0), tl.num_programs(0), N, K, K_SPLIT,
                BLOCK_R, BLOCK_N, BLOCK_K)


@triton.jit
def _one_gemm_tma(x_desc, w_desc, p_ptr, R, N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # `_one_gemm` with x and w tiles through TMA descriptors (rows past R come back zero).
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    n_tiles: tl.constexpr = N // BLOCK_N
    item = tl.program_id(0)
    col0, split = (item % n_tiles) * BLOCK_N, item // n_tiles
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        kk = split * K_SPLIT + k0
        acc += tl.dot(x_desc.load([0, kk]), tl.trans(w_desc.load([col0, kk])))
    rows, cols = tl.arange(0, BLOCK_R), col0 + tl.arange(0, BLOCK_N)
    tl.store(p_ptr + split * R * N + rows[:, None] * N + cols[None, :], acc, mask=rows[:, None] < R)


@triton.jit
def _step(x0, x1, x2, x3, w_ptr, p0, p1, p2, p3, bar_ptr, err_ptr, R, layer0, LAYERS: tl.constexpr,
          N0: tl.constexpr, K0: tl.constexpr, S0: tl.constexpr, N1: tl.constexpr, K1: tl.constexpr,
          S1: tl.constexpr, N2: tl.constexpr, K2: tl.constexpr, S2: tl.constexpr, N3: tl.constexpr,
          K3: tl.constexpr, S3: tl.constexpr, SYNC: tl.constexpr, LIMIT: tl.constexpr, SPIN: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One Euler step of the expert's GEMMs: LAYERS x four phases, a grid barrier after each.
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    layer_size: tl.constexpr = N0 * K0 + N1 * K1 + N2 * K2 + N3 * K3
    for layer in range(LAYERS):
        w = w_ptr + (layer0 + layer).to(tl.int64) * layer_size
        _phase(x0, w, p0, R, pid, nprog, N0, K0, S0, bar_ptr, err_ptr, (layer * 4 + 1) * nprog, SYNC, LIMIT, SPIN,
               BLOCK_R, BLOCK_N, BLOCK_K)
        w += N0 * K0
        _phase(x1, w, p1, R, pid, nprog, N1, K1, S1, bar_ptr, err_ptr, (layer * 4 + 2) * nprog, SYNC, LIMIT, SPIN,
               BLOCK_R, BLOCK_N, BLOCK_K)
        w += N1 * K1
        _phase(x2, w, p2, R, pid, nprog, N2, K2, S2, bar_ptr, err_ptr, (layer * 4 + 3) * nprog, SYNC, LIMIT, SPIN,
               BLOCK_R, BLOCK_N, BLOCK_K)
        w += N2 * K2
        _phase(x3, w, p3, R, pid, nprog, N3, K3, S3, bar_ptr, err_ptr, (layer * 4 + 4) * nprog, SYNC, LIMIT, SPIN,
               BLOCK_R, BLOCK_N, BLOCK_K)


@triton.jit
def _phase(x_ptr, w_ptr, p_ptr, R, pid, nprog, N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr, bar_ptr,
           err_ptr, target, SYNC: tl.constexpr, LIMIT: tl.constexpr, SPIN: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One GEMM of the step, then (SYNC) the grid barrier that a data dependence on it would need.
    _gemm_items(x_ptr, w_ptr, p_ptr, R, pid, nprog, N, K, K_SPLIT, BLOCK_R, BLOCK_N, BLOCK_K)
    if SYNC:
        _grid_sync(bar_ptr, err_ptr, target, LIMIT, SPIN)


@triton.jit
def _barrier_check(buf_ptr, bad_ptr, bar_ptr, err_ptr, ROUNDS: tl.constexpr, LIMIT: tl.constexpr,
                   SPIN: tl.constexpr):
    # Round r: program i writes r * nprog + i to slot [r % 2, i]; after the barrier it reads its
    # neighbour's slot and counts a mismatch (a barrier that lets a program through early, or a
    # stale read, shows up here).
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    bad = 0
    for r in range(ROUNDS):
        tl.store(buf_ptr + (r % 2) * nprog + pid, r * nprog + pid)
        _grid_sync(bar_ptr, err_ptr, (r + 1) * nprog, LIMIT, SPIN)
        other = (pid + 1) % nprog
        got = tl.load(buf_ptr + (r % 2) * nprog + other, cache_modifier=".cg")
        bad += (got != r * nprog + other).to(tl.int32)
    tl.atomic_add(bad_ptr, bad)


def split_for(n: int, k: int, block_n: int, block_k: int, nprog: int) -> int:
    """K_SPLIT for one GEMM: the split count (a power of two) whose items fill the programs best
    (items / (rounds * nprog)), the fewest splits on a tie."""
    best, best_fill = k, -1.0
    splits = 1
    while k // splits >= block_k and k % splits == 0:
        items = (n // block_n) * splits
        fill = items / (math.ceil(items / nprog) * nprog)
        if fill > best_fill + 1e-9:
            best, best_fill = k // splits, fill
        splits *= 2
    return best


class Problem:
    def __init__(self, gemms=GEMMS, layers=LAYERS, rows=ROWS, device="cuda", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.gemms, self.layers, self.rows, self.device = gemms, layers, rows, device
        self.layer_size = sum(n * k for _, n, k in gemms)
        self.w = (torch.randn(layers * self.layer_size, generator=g) * 0.02).to(torch.bfloat16).to(device)
        self.x = [torch.randn(rows, k, generator=g).to(torch.bfloat16).to(device) for _, _, k in gemms]
        self.bar = torch.zeros(1, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def weight(self, layer: int, j: int) -> torch.Tensor:
        offset = layer * self.layer_size + sum(n * k for _, n, k in self.gemms[:j])
        _, n, k = self.gemms[j]
        return self.w[offset:offset + n * k].view(n, k)

    def outputs(self, splits: list[int]) -> list[torch.Tensor]:
        return [torch.empty(k // s, self.rows, n, dtype=torch.float32, device=self.device)
                for (_, n, k), s in zip(self.gemms, splits)]

    def bytes_per_call(self, steps: int) -> int:
        return steps * self.layers * self.layer_size * 2


def run_launches(p: Problem, cfg: dict, outs, steps: int, pdl: bool) -> None:
    for step in range(steps):
        for layer in range(p.layers):
            for j, (_, n, k) in enumerate(p.gemms):
                s = cfg["splits"][j]
                _one_gemm[((n // cfg["block_n"]) * (k // s),)](
                    p.x[j], p.weight(layer, j), outs[j], p.rows, N=n, K=k, K_SPLIT=s, BLOCK_R=64,
                    BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], PDL=pdl, num_warps=cfg["warps"],
                    num_stages=cfg["stages"], **({"launch_pdl": True} if pdl else {}))


def run_launches_tma(p: Problem, cfg: dict, outs, steps: int, pdl: bool) -> None:
    bn, bk = cfg["block_n"], cfg["block_k"]
    xs = [TensorDescriptor.from_tensor(x, [64, bk]) for x in p.x]
    ws = [[TensorDescriptor.from_tensor(p.weight(layer, j), [bn, bk]) for j in range(len(p.gemms))]
          for layer in range(p.layers)]
    for step in range(steps):
        for layer in range(p.layers):
            for j, (_, n, k) in enumerate(p.gemms):
                s = cfg["splits"][j]
                _one_gemm_tma[((n // bn) * (k // s),)](
                    xs[j], ws[layer][j], outs[j], p.rows, N=n, K=k, K_SPLIT=s, BLOCK_R=64, BLOCK_N=bn, BLOCK_K=bk,
                    PDL=pdl, num_warps=cfg["warps"], num_stages=cfg["stages"], **({"launch_pdl": True} if pdl else {}))


def _step_args(p: Problem, cfg: dict, outs, sync: bool, spin: int):
    (n0, k0), (n1, k1), (n2, k2), (n3, k3) = [(n, k) for _, n, k in p.gemms]
    s0, s1, s2, s3 = cfg["splits"]
    return ((*p.x, p.w, *outs, p.bar, p.err, p.rows, 0),
            dict(LAYERS=p.layers, N0=n0, K0=k0, S0=s0, N1=n1, K1=k1, S1=s1, N2=n2, K2=k2, S2=s2, N3=n3, K3=k3,
                 S3=s3, SYNC=sync, LIMIT=SPIN_LIMIT, SPIN=spin, BLOCK_R=64, BLOCK_N=cfg["block_n"],
                 BLOCK_K=cfg["block_k"], num_warps=cfg["warps"], num_stages=cfg["stages"]))


def run_persistent(p: Problem, cfg: dict, outs, steps: int, sync: bool, spin: int = 0) -> None:
    args, kwargs = _step_args(p, cfg, outs, sync, spin)
    for step in range(steps):
        p.bar.zero_()
        _step[(cfg["nprog"],)](*args, **kwargs)


def resident_per_sm(kernel, warps: int) -> dict:
    """How many programs of a compiled kernel one SM holds at once (shared memory, registers,
    threads): a grid barrier needs every program resident, or it waits forever."""
    kernel._init_handles()  # loads the module: n_regs is known from then on
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = 32 * warps
    per_sm = min(smem // (kernel.metadata.shared + 1024), regs // max(kernel.n_regs * threads, 1), 2048 // threads)
    return {"per_sm": per_sm, "shared": kernel.metadata.shared, "regs": kernel.n_regs}


def barrier_check(nprog: int, rounds: int, spin: int, device="cuda", timed: bool = True) -> dict:
    """Every read across `rounds` barriers checked; with `timed`, the barrier's cost (the kernel's
    time over its rounds: a store, a barrier and a load each)."""
    buf = torch.full((2 * nprog,), -1, dtype=torch.int32, device=device)
    bad, bar, err = (torch.zeros(1, dtype=torch.int32, device=device) for _ in range(3))

    def launch():
        bar.zero_()
        _barrier_check[(nprog,)](buf, bad, bar, err, ROUNDS=rounds, LIMIT=SPIN_LIMIT, SPIN=spin, num_warps=4)

    launch()
    row = {"programs": nprog, "rounds": rounds, "spin": spin, "mismatches": int(bad.item()),
           "timed_out": int(err.item())}
    if timed:
        row["us_per_barrier"] = time_graph(launch) * 1e3 / rounds
        row["mismatches_after_timing"] = int(bad.item())
    return row


def reference(p: Problem, layer: int) -> list[torch.Tensor]:
    return [p.x[j].float() @ p.weight(layer, j).float().T for j in range(len(p.gemms))]


# Run 68 swept nprog x block_n x block_k x stages (16 configs); these are its best for each variant.
CONFIGS = ((132, 64, 128, 4), (264, 64, 128, 3), (264, 32, 128, 4), (132, 32, 256, 4), (132, 64, 256, 3))


# --launches-only (run 74): the separate-launch variants over a wider sweep.
LAUNCH_CONFIGS = tuple(itertools.product((132, 264), (16, 32, 64), (128, 256), (3, 4)))


def configs(launches_only: bool = False):
    for nprog_per_sm, block_n, block_k, stages in (LAUNCH_CONFIGS if launches_only else CONFIGS):
        yield {"nprog": nprog_per_sm, "block_n": block_n, "block_k": block_k, "warps": 4, "stages": stages}


def time_graph(fn) -> float:
    return time_graphed(fn)["p50_ms"]


VARIANTS = {  # name -> how one call's GEMMs run
    "launches": lambda p, cfg, outs: run_launches(p, cfg, outs, STEPS, pdl=False),
    "launches_pdl": lambda p, cfg, outs: run_launches(p, cfg, outs, STEPS, pdl=True),
    "launches_pdl_tma": lambda p, cfg, outs: run_launches_tma(p, cfg, outs, STEPS, pdl=True),
    "persistent_rmw_spin": lambda p, cfg, outs: run_persistent(p, cfg, outs, STEPS, True, spin=0),
    "persistent_load_spin": lambda p, cfg, outs: run_persistent(p, cfg, outs, STEPS, True, spin=1),
    "no_barrier": lambda p, cfg, outs: run_persistent(p, cfg, outs, STEPS, False),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--launches-only", action="store_true",
                        help="only the separate-launch variants (pointer and TMA loads), over LAUNCH_CONFIGS")
    args = parser.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if k.startswith("launches")} if args.launches_only else VARIANTS
    started = time.time()
    results = {"device": torch.cuda.get_device_name(), "gemms": GEMMS, "layers": LAYERS, "steps": STEPS,
               "rows": ROWS, "barrier_check": [], "variants": []}
    dests = [Path("bench/results")] + ([Path(args.out)] if args.out else [])

    def save():
        for d in dests:
            d.mkdir(parents=True, exist_ok=True)
            (d / "persistent_probe.json").write_text(json.dumps(results, indent=1))

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for nprog, spin in itertools.product((sms, 2 * sms), (0, 1)) if not args.launches_only else ():
        results["barrier_check"].append(barrier_check(nprog, 2000, spin))
        print("barrier check", results["barrier_check"][-1], flush=True)
    p = Problem()
    gb = p.bytes_per_call(STEPS) / 1e9
    ref = reference(p, LAYERS - 1)
    for cfg in configs(args.launches_only):
        cfg["nprog"] = sms * cfg["nprog"] // 132
        cfg["splits"] = [split_for(n, k, cfg["block_n"], cfg["block_k"], cfg["nprog"]) for _, n, k in GEMMS]
        row = {**cfg}
        try:
            outs = {name: p.outputs(cfg["splits"]) for name in variants}
            for spin in (0, 1) if not args.launches_only else ():
                a, kw = _step_args(p, cfg, outs["no_barrier"], True, spin)
                row[f"resources_spin{spin}"] = resident_per_sm(_step.warmup(*a, grid=(1,), **kw), cfg["warps"])
            if any(cfg["nprog"] > row[f"resources_spin{s}"]["per_sm"] * sms for s in (0, 1) if not args.launches_only):
                row["error"] = "not every program would be resident: skipped"
            else:
                p.err.zero_()
                for name, run in variants.items():
                    row[f"{name}_ms"] = time_graph(lambda: run(p, cfg, outs[name]))
                    row[f"{name}_tbps"] = gb / row[f"{name}_ms"]
                row["barrier_timeouts"] = int(p.err.item())
                sums = {name: [o.sum(0) for o in os_] for name, os_ in outs.items()}
                row["all_equal_launches"] = all(torch.equal(a, b) for name in variants
                                                for a, b in zip(sums[name], sums["launches"]))
                row["max_rel_vs_fp32"] = max(float((a - r).abs().max() / r.abs().max())
                                             for a, r in zip(sums["launches"], ref))
        except Exception as exc:  # a config Triton cannot build (shared memory): recorded, skipped
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results["variants"].append(row)
        print(json.dumps(row), flush=True)
        save()
    ok = [r for r in results["variants"] if "error" not in r]
    for name in variants:
        best = min(ok, key=lambda r: r[f"{name}_ms"])
        results[f"best_{name}"] = {k: best[k] for k in ("nprog", "block_n", "block_k", "stages", "splits",
                                                         f"{name}_ms", f"{name}_tbps")}
        print(f"best {name}: {results[f'best_{name}']}", flush=True)
    results["floor_ms_at_4.17_tbps"] = gb / 4.17
    results["elapsed_s"] = time.time() - started
    save()


if __name__ == "__main__":
    main()
