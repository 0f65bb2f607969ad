"""The prefix's and SigLIP's GEMMs under every algorithm cuBLASLt's heuristic offers, and under
sustained load. The bench's floors took the GEMM ceiling from a short burst (ten 8192^3 products);
a fleet at batch 8 keeps the GPU multiplying for seconds. What rate does the H200 hold then (it
lowers its clock to stay at its power limit), and does another cuBLAS algorithm do better than the
one torch's F.linear gets, in a burst or at the limit? (Runs 86-88, docs/benchmarks.md.)

    python3 bench/gemm_algos.py [--algos 16] [--out DIR]

Part 1 (clocks): an 8192^3 product and the prefix's gate_up at batch 8, timed right after 2 s idle
(burst) and after 3 s of back-to-back products (sustained), with the SM clock and board power that
NVML reads at each point.
Part 2 (algorithms, burst): every F.linear shape of the prefix (M = 864 / 6912: batch 1 / 8 at the default
96-token bucket) and of SigLIP (M = 768 / 6144, without the bias) through cuBLASLt directly (ctypes),
under each algorithm its heuristic returns (up to --algos), against torch's own F.linear. Each time
is the mean of 20 back-to-back products after 3 warm-ups (as in a graph: the weights stream from HBM
when they exceed L2). Each algorithm's output is checked against F.linear's (max |diff| relative to
the output's scale: fp32 sums in another order, one bf16 rounding) and against itself run again
(bit-identical: no atomics).
Part 3 (algorithms, sustained): the batch-8 prefix's gate_up and down under each candidate after
--sustained-seconds of back-to-back products, at the power limit. JSON + PNG in bench/results/gemm_algos.json|png.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_gpu import PowerSampler, hold

ROOT = Path(__file__).resolve().parents[1]

PREFIX = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (32768, 2048), "down": (2048, 16384)}  # (N, K)
VISION = {"qkv": (3456, 1152), "out": (1152, 1152), "fc1": (4304, 1152), "fc2": (1152, 4304)}
# Per call: the prefix's 18 layers (the last projects only k and v: counted as 17 + a fifth), SigLIP's 27.
PER_CALL = {"prefix": {"qkv": 17.2, "o": 17, "gate_up": 17, "down": 17}, "vision": {n: 27 for n in VISION}}
ROWS = {"prefix": {1: 864, 8: 6912}, "vision": {1: 768, 8: 6144}}

# cuBLAS / cuBLASLt enums (cublas_api.h, cublasLt.h, library_types.h).
COMPUTE_32F, R_32F, R_16BF, OP_N, OP_T = 68, 0, 14, 0, 1
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "stages": 6, "cluster": 8}
WORKSPACE = 64 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _load_cublaslt() -> ctypes.CDLL:
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import nvidia  # the pip CUDA libraries torch depends on
    for base in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(base, "**", "libcublasLt.so*"), recursive=True)):
            return ctypes.CDLL(path)
    raise OSError("libcublasLt not found")


P, I32, U64, I64, SZ = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
SIGNATURES = {  # argument types, so that ctypes passes 64-bit values where the C API takes them
    "cublasLtCreate": [P],
    "cublasLtMatrixLayoutCreate": [P, I32, U64, U64, I64],
    "cublasLtMatmulDescCreate": [P, I32, I32],
    "cublasLtMatmulDescSetAttribute": [P, I32, P, SZ],
    "cublasLtMatmulPreferenceCreate": [P],
    "cublasLtMatmulPreferenceSetAttribute": [P, I32, P, SZ],
    "cublasLtMatmulAlgoGetHeuristic": [P, P, P, P, P, P, P, I32, P, P],
    "cublasLtMatmulAlgoConfigGetAttribute": [P, I32, P, SZ, P],
    "cublasLtMatmul": [P, P, P, P, P, P, P, P, P, P, P, P, P, P, SZ, P],
}


class CublasLt:
    """y[M, N] = x[M, K] @ w[N, K]^T in bf16 with fp32 accumulation, as F.linear, with the algorithm chosen."""

    def __init__(self):
        self.lib = _load_cublaslt()
        for name, argtypes in SIGNATURES.items():
            getattr(self.lib, name).argtypes = argtypes
            getattr(self.lib, name).restype = ctypes.c_int
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str):
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), R_16BF, ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return layout

    def plan(self, m: int, n: int, k: int, count: int) -> dict:
        """Column-major: D[N, M] = op_T(W as K x N) @ X (K x M)."""
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "desc")
        for attr, value in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(value)
            self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4), "desc attr")
        a, b, c = self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n)
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE)
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8),
                    "preference attr")
        results = (Heuristic * count)()
        returned = ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                            ctypes.byref(returned)), "heuristic")
        algos = [results[i] for i in range(returned.value) if results[i].state == 0]
        return {"desc": desc, "a": a, "b": b, "c": c, "algos": algos}

    def describe(self, algo: Algo) -> dict:
        out = {}
        for name, attr in CONFIG_ATTRS.items():
            value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                                   ctypes.byref(written))
            out[name] = value.value if status == 0 else None
        return out

    def linear(self, plan: dict, heuristic: Heuristic, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cublasLtMatmul(
            self.handle, plan["desc"], ctypes.byref(self.one), ctypes.c_void_p(w.data_ptr()), plan["a"],
            ctypes.c_void_p(x.data_ptr()), plan["b"], ctypes.byref(self.zero), ctypes.c_void_p(y.data_ptr()),
            plan["c"], ctypes.c_void_p(y.data_ptr()), plan["c"], ctypes.byref(heuristic.algo),
            ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE), stream), "matmul")


def mean_us(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def clocks(read) -> dict:
    out = {}
    for name, (m, n, k) in {"8192^3": (8192, 8192, 8192), "gate_up_b8": (6912, 32768, 2048)}.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        flop = 2 * m * n * k
        run = lambda: F.linear(x, w)  # noqa: E731
        mean_us(run, reps=3)
        torch.cuda.synchronize()
        time.sleep(2.0)
        burst = mean_us(run, reps=5, warmup=0)
        at_burst = read()
        hold(run, 3.0)
        sustained = mean_us(run, reps=10, warmup=0)
        at_sustained = read()
        out[name] = {"burst_us": burst, "burst_tflops": flop / burst / 1e6, "burst_nvml": at_burst,
                     "sustained_us": sustained, "sustained_tflops": flop / sustained / 1e6,
                     "sustained_nvml": at_sustained}
        print(f"{name}: burst {burst:.1f} us ({flop / burst / 1e6:.0f} TF/s, {at_burst}), sustained "
              f"{sustained:.1f} us ({flop / sustained / 1e6:.0f} TF/s, {at_sustained})", flush=True)
    return out


def algorithms(lt: CublasLt, count: int) -> dict:
    out = {}
    for family, shapes in (("prefix", PREFIX), ("vision", VISION)):
        for batch, m in ROWS[family].items():
            for name, (n, k) in shapes.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                flop = 2 * m * n * k
                reference = F.linear(x, w)
                scale = reference.abs().max().item()
                torch_us = mean_us(lambda: F.linear(x, w))
                plan = lt.plan(m, n, k, count)
                rows = []
                for i, heuristic in enumerate(plan["algos"]):
                    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                    try:
                        lt.linear(plan, heuristic, x, w, y)
                        again = torch.empty_like(y)
                        lt.linear(plan, heuristic, x, w, again)
                        us = mean_us(lambda: lt.linear(plan, heuristic, x, w, y))
                    except RuntimeError as error:
                        rows.append({"index": i, "error": str(error)})
                        continue
                    rows.append({"index": i, "us": us, "tflops": flop / us / 1e6, "workspace": heuristic.workspace,
                                 "waves": heuristic.waves, "config": lt.describe(heuristic.algo),
                                 "rel_diff_vs_torch": (y.float() - reference.float()).abs().max().item() / scale,
                                 "repeat_identical": bool(torch.equal(y, again))})
                timed = [r for r in rows if "us" in r]
                best = min(timed, key=lambda r: r["us"]) if timed else None
                key = f"{family}_{name}_b{batch}"
                out[key] = {"m": m, "n": n, "k": k, "torch_us": torch_us, "torch_tflops": flop / torch_us / 1e6,
                            "algos": rows, "best_index": best["index"] if best else None}
                if best:
                    print(f"{key:22s} M={m:5d} torch {torch_us:8.1f} us ({flop / torch_us / 1e6:4.0f} TF/s)  "
                          f"heuristic[0] {timed[0]['us']:8.1f}  best[{best['index']}] {best['us']:8.1f} us "
                          f"({best['tflops']:4.0f} TF/s) cfg {best['config']} diff {best['rel_diff_vs_torch']:.1e} "
                          f"of {len(timed)} algos", flush=True)
                del x, w, reference
    return out


def sustained(lt: CublasLt, read, count: int, seconds: float) -> dict:
    """The batch-8 prefix's two largest GEMMs, each candidate (torch's F.linear, then every heuristic
    algorithm) run back to back for `seconds` before it is timed: all at the power limit, where a
    call made only of GEMMs would run them (a served batch-8 call is there only in part). A burst
    comparison depends on how hot the GPU is from the last shape: the algorithms part does not
    control that."""
    out = {}
    for name in ("gate_up", "down"):
        n, k = PREFIX[name]
        m = ROWS["prefix"][8]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        flop = 2 * m * n * k
        plan = lt.plan(m, n, k, count)
        candidates = [("torch", lambda: F.linear(x, w))]
        candidates += [(f"algo{i}", (lambda h: lambda: lt.linear(plan, h, x, w, y))(h)) for i, h in enumerate(plan["algos"])]
        rows = []
        for label, run in candidates:
            hold(run, seconds)
            us = mean_us(run, reps=10, warmup=0)
            rows.append({"candidate": label, "us": us, "tflops": flop / us / 1e6, **read()})
            print(f"sustained {name}_b8 {label:6s} {us:8.1f} us ({flop / us / 1e6:4.0f} TF/s) {rows[-1]}", flush=True)
        out[f"prefix_{name}_b8"] = rows
    return out


def per_call(results: dict) -> dict:
    """ms per call: torch's choice against the best algorithm of each shape, per family and batch."""
    out = {}
    for family, counts in PER_CALL.items():
        for batch in ROWS[family]:
            torch_ms = best_ms = 0.0
            for name, count in counts.items():
                r = results[f"{family}_{name}_b{batch}"]
                timed = [a["us"] for a in r["algos"] if "us" in a]
                torch_ms += count * r["torch_us"] / 1e3
                best_ms += count * min([r["torch_us"], *timed]) / 1e3
            out[f"{family}_b{batch}"] = {"torch_ms": torch_ms, "best_ms": best_ms, "saved_ms": torch_ms - best_ms}
            print(f"{family} b{batch}: torch {torch_ms:.2f} ms, best algorithms {best_ms:.2f} ms "
                  f"(-{torch_ms - best_ms:.2f})", flush=True)
    return out


def plot(result: dict, out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [("clocks", "8192^3 and gate_up b8: burst vs sustained")] if "clocks" in result else []
    panels += [(key, f"{key}, sustained") for key in result.get("sustained", {})]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        if key == "clocks":
            labels = [f"{name}\n{when}" for name in result["clocks"] for when in ("burst", "sustained")]
            values = [result["clocks"][name][f"{when}_tflops"] for name in result["clocks"] for when in ("burst", "sustained")]
        else:
            labels = [row["candidate"] for row in result["sustained"][key]]
            values = [row["tflops"] for row in result["sustained"][key]]
        ax.bar(labels, values)
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.tick_params(axis="x", labelsize=6, rotation=45)
    fig.savefig(out / "gemm_algos.png", dpi=120, bbox_inches="tight")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", type=int, default=16, help="algorithms to ask the heuristic for")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--skip-clocks", action="store_true")
    parser.add_argument("--sustained-seconds", type=float, default=2.0,
                        help="per candidate in the sustained comparison (0: skip it)")
    args = parser.parse_args()
    torch.manual_seed(0)
    read = PowerSampler().read
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_clocks:
        result["clocks"] = clocks(read)
    F.linear(torch.ones(8, 8, device="cuda", dtype=torch.bfloat16), torch.ones(8, 8, device="cuda", dtype=torch.bfloat16))
    lt = CublasLt()
    result["algorithms"] = algorithms(lt, args.algos)
    result["per_call"] = per_call(result["algorithms"])
    if args.sustained_seconds > 0:
        result["sustained"] = sustained(lt, read, args.algos, args.sustained_seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_algos.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out)


if __name__ == "__main__":
    main()
