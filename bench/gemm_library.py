"""`--gemm-library quack` against the default on the served path (issue 14).

    python3 bench/gemm_library.py [--calls_only] [--out DIR]   # needs `pip install 'vlaserve[cute]'`
                                                                # (bench/prepare_cute.sh)

1. Each GEMM the option can move, at the rows of batch 1, 2, 4 and 8 (ALOHA-3, the 96-token bucket:
   864 prefix and 768 SigLIP rows a sample): what the default serves (cuBLAS, and our GELU / GeGLU
   pass after fc1 / gate_up) against cute.py's kernel, each over its layers' weights in turn in one
   CUDA graph (so they stream from HBM as in a call), two rounds alternating. Every output element is
   compared with the served one. From these, per GEMM, the fewest rows from which quack wins at that
   batch and every larger one: cute.FROM_ROWS as this run measures it.
2. Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 calls, FastRunners in
   CUDA graphs as the server runs them: the default, quack for the gate/up only (the step before),
   quack with cute.FROM_ROWS as committed and, when part 1 measured other thresholds, with those.
   Their actions (which must be bit-identical), max|Δ| vs the fp32 eager model, p50 ms of a call
   and its prefix and denoise stages.
3. As a user loads it: the golden (tiny) checkpoint through Policy.from_pretrained in bf16 with each
   library, its first case's observations repeated to batch 1, 2 and 8 (warm-up captures the graphs,
   quack compiles): whether the actions are bit-identical.
JSON under bench/results/ (gemm_library.json) and --out.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_gpu import bucketed, eager, log, make_inputs, maxdiff, time_graphed
from cute_probe import BUCKET, IMAGE
from cute_probe import GEMMS as PROBED_GEMMS
from kernel_ladder import BATCHES, bench_run, full_size_models, timed_call

from vlaserve.runtime.fast import cute, kernels
from vlaserve.runtime.fast.graphs import FastRunner

PREFIX_ROWS, VISION_ROWS = IMAGE + BUCKET, IMAGE  # a sample's rows (ALOHA-3: 3 cameras of 256 patches)
# name: (rows a sample, K, N, bias, layers a call), for the GEMMs the option may move: cute_probe's
# table without prefix down and SigLIP fc2, which quack lost at every size (runs 102-104)
GEMMS = {name: (PREFIX_ROWS if name.startswith("prefix") else VISION_ROWS, k, n, bias, layers)
         for name, k, n, bias, layers in PROBED_GEMMS if name not in ("prefix_down", "vision_fc2")}
# Timed, not served: fc1 with integer rounding (register_int_rounding); gate/up with its rows
# interleaved (gate_i, up_i adjacent: what runs 109-112 served, before quack's concat layout read the
# halves as fast, run 113); the expert's qkv and gate/up (50 rows a sample, 10 steps a call) where the
# default serves them through cuBLAS (batch 4+).
VARIANTS = {"vision_fc1_int": GEMMS["vision_fc1"], "prefix_gate_up_pairs": GEMMS["prefix_gate_up"],
            "expert_qkv": (50, 1024, 2560, False, 18), "expert_gate_up": (50, 1024, 8192, False, 18),
            "expert_gate_up_pairs": (50, 1024, 8192, False, 18)}
STEPS = {"expert_qkv": 10, "expert_gate_up": 10, "expert_gate_up_pairs": 10}
EXPERT_BATCHES = (4, 8)


def register_int_rounding() -> str:
    """A variant of cute.GELU for SigLIP's fc1: quack's non-gated epilogue hands over one value at a
    time on sm90, so cute.py rounds each with a cvt of its own; this one rounds in integer ops (RNE
    on the fp32 bits: add 0x7fff plus the kept lowest bit, clear the low 16; the same bits for
    finite values and infinities)."""
    from cutlass import Float32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from quack import activation

    @dsl_user_op
    def round_bits(x, *, loc=None, ip=None):
        return Float32(llvm.inline_asm(
            T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
            "{.reg .b32 u, t; mov.b32 u, $1; shr.u32 t, u, 16; and.b32 t, t, 1; add.u32 t, t, u; "
            "add.u32 t, t, 0x7fff; and.b32 t, t, 0xffff0000; mov.b32 $0, t;}",
            "=f,f", has_side_effects=False, loc=loc, ip=ip))

    gelu = cute.epilogue_ops().gelu_served

    @dsl_user_op
    def fn(x, *, loc=None, ip=None):
        if const_expr(isinstance(x, tuple)):
            return (round_bits(gelu(round_bits(x[0]))), round_bits(gelu(round_bits(x[1]))))
        return round_bits(gelu(round_bits(x)))

    activation.act_fn_map["vlaserve_gelu_int"] = fn
    return "vlaserve_gelu_int"


def gemm_row(name: str, b: int) -> dict:
    per_sample, k, n, with_bias, layers = {**GEMMS, **VARIANTS}[name]
    rows = b * per_sample
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(layers)]
    bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if with_bias else None for _ in ws]
    if "gate_up" in name:  # [gate; up] halves, as served
        served = lambda i: kernels.geglu(F.linear(x, ws[i]))  # noqa: E731
        quack = lambda i: cute.geglu_linear(x, ws[i])  # noqa: E731
        if name.endswith("_pairs"):
            from quack.gemm_interface import gemm_act
            pairs = [w.view(2, n // 2, k).transpose(0, 1).reshape(n, k) for w in ws]
            quack = lambda i: gemm_act(x, pairs[i].t(), activation=cute.GEGLU, store_preact=False,  # noqa: E731
                                       tuned=False)[1]
    elif name in ("vision_fc1", "vision_fc1_int"):
        served = lambda i: kernels.gelu(F.linear(x, ws[i], bs[i]))  # noqa: E731
        quack = lambda i: cute.linear_gelu(x, ws[i], bs[i])  # noqa: E731
        if name == "vision_fc1_int":
            from quack.gemm_interface import gemm_act
            quack = lambda i: gemm_act(x, ws[i].t(), bias=bs[i], activation="vlaserve_gelu_int",  # noqa: E731
                                       store_preact=False, tuned=False)[1]
    else:
        served = lambda i: F.linear(x, ws[i], bs[i])  # noqa: E731
        quack = lambda i: cute.linear(x, ws[i], bs[i])  # noqa: E731
    t0 = time.perf_counter()
    quack_out = quack(0)
    torch.cuda.synchronize()
    row = {"name": name, "batch": b, "rows": rows, "k": k, "n": n, "layers": layers,
           "quack_first_call_s": time.perf_counter() - t0}
    served_out = served(0)
    row["elements"] = served_out.numel()
    row["differing_from_served"] = int((quack_out != served_out).sum())
    for r in (0, 1):  # alternating rounds: the GPU's clock drifts with its temperature
        for kind, fn in (("served", served), ("quack", quack)):
            row[f"{kind}_us_{r}"] = time_graphed(lambda fn=fn: [fn(i) for i in range(layers)])["p50_ms"] * 1e3 / layers
    row["served_us"] = (row["served_us_0"] + row["served_us_1"]) / 2
    row["quack_us"] = (row["quack_us_0"] + row["quack_us_1"]) / 2
    row["saved_per_call_us"] = (row["served_us"] - row["quack_us"]) * layers * STEPS.get(name, 1)
    log(f"{name} b{b}: {json.dumps(row)}")
    return row


def measured_from_rows(rows: list[dict]) -> dict[str, int]:
    """Per GEMM, the rows of the smallest batch from which quack is faster at every larger batch too."""
    out = {}
    for name in GEMMS:
        wins = {r["batch"]: r.get("saved_per_call_us", -1) > 0 for r in rows if r["name"] == name}
        from_batch = next((b for b in BATCHES if all(wins.get(c, False) for c in BATCHES if c >= b)), None)
        if from_batch is not None:
            out[name] = from_batch * GEMMS[name][0]
    return out


def policy_check() -> dict:
    import numpy as np

    from bench_gpu import GOLDEN
    from vlaserve import Policy
    from vlaserve.golden import GoldenCase, case_dirs

    golden = Path(GOLDEN)
    case = GoldenCase.load(case_dirs(golden)[0])
    obs, noise = case.observations(), list(case.tensors["input.noise"])
    out: dict = {"case": case.name}
    policies = {}
    for library in ("cublas", "quack"):
        t0 = time.perf_counter()
        policies[library] = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="bfloat16",
                                                   progress=False, gemm_library=library)
        out[f"{library}_load_s"] = time.perf_counter() - t0
    for b in (1, 2, 8):
        batch, z = [obs[i % len(obs)] for i in range(b)], [noise[i % len(noise)] for i in range(b)]
        actions = {lib: [r.actions for r in p.infer_batch(batch, noise=z, num_steps=case.meta["num_steps"])]
                   for lib, p in policies.items()}
        out[f"b{b}_bit_identical"] = all(np.array_equal(a, c) for a, c in zip(actions["cublas"], actions["quack"]))
    out["metadata_quack"] = {k: v for k, v in policies["quack"].metadata.items() if isinstance(v, (str, int, bool))}
    log("policy check:", json.dumps(out, default=str))
    return out


def main():
    args, results, save = bench_run("gemm_library", {"calls_only": "skip part 1 (the GEMMs alone)"})
    started = time.time()
    cute.require(torch.device("cuda"))
    cute.register()
    try:
        register_int_rounding()
    except Exception:
        traceback.print_exc()
    results["committed_from_rows"] = dict(cute.FROM_ROWS)
    results["gemms"] = []
    if not args.calls_only:
        for b in reversed(BATCHES):  # batch 8 first: run 104 timed quack slower after a smaller first compile
            for name in (*GEMMS, *VARIANTS):
                if name.startswith("expert") and b not in EXPERT_BATCHES:
                    continue
                try:
                    results["gemms"].append(gemm_row(name, b))
                except Exception as exc:  # a variant that fails to compile must not cost the run
                    traceback.print_exc()
                    results["gemms"].append({"name": name, "batch": b, "error": f"{type(exc).__name__}: {exc}"[:500]})
                save()
        results["measured_from_rows"] = measured_from_rows(results["gemms"])
        for b in BATCHES:
            results[f"gemms_saved_per_call_us_b{b}"] = sum(r.get("saved_per_call_us", 0.0) for r in results["gemms"]
                                                           if r["batch"] == b and r["name"] in GEMMS)
        log("measured FROM_ROWS:", results["measured_from_rows"])
        torch.cuda.empty_cache()
    variants = {"quack_gate_up_only": {"prefix_gate_up": 2 * PREFIX_ROWS}, "quack": dict(cute.FROM_ROWS)}
    measured = results.get("measured_from_rows")
    if measured is not None and measured != cute.FROM_ROWS:
        variants["quack_measured"] = measured
    results["variants"] = variants

    cfg, model, model32, policy_config = full_size_models()
    calls = {b: make_inputs(b, cfg.vlm.vocab_size, seed=b) for b in BATCHES}
    refs32 = {b: eager(model32, *calls[b]) for b in BATCHES}
    del model32
    runners = {"cublas": FastRunner(model, policy_config)}
    runners.update({name: FastRunner(model, policy_config, gemm_library="quack") for name in variants})
    log(f"built ({time.time() - started:.0f}s)")
    results["calls"] = {}
    committed = dict(cute.FROM_ROWS)
    for b in BATCHES:
        inputs, noise = calls[b]
        x = bucketed(inputs, BUCKET)
        row, outs = {}, {}
        for name, runner in runners.items():  # the first call compiles (quack) and captures this size's graphs
            cute.FROM_ROWS.clear()
            cute.FROM_ROWS.update(variants.get(name, committed))
            outs[name], row[name] = timed_call(runner, x, noise, refs32[b])
        cute.FROM_ROWS.clear()
        cute.FROM_ROWS.update(committed)
        for name in variants:
            row[name]["bit_identical_to_cublas"] = bool(torch.equal(outs["cublas"], outs[name]))
            row[name]["vs_cublas"] = maxdiff(outs[name], outs["cublas"])
            row[name]["saved_ms"] = row["cublas"]["p50_ms"] - row[name]["p50_ms"]
        log(f"b={b}:", json.dumps(row))
        results["calls"][b], results["elapsed_s"] = row, time.time() - started
        save()  # after each batch size: a run cut short keeps what it measured
    del runners
    torch.cuda.empty_cache()
    try:
        results["policy"] = policy_check()
    except Exception as exc:
        traceback.print_exc()
        results["policy"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    save()


if __name__ == "__main__":
    main()
