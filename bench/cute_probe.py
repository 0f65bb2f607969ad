"""Probe (issue 14): CuTe-DSL kernels against what we serve, on our shapes (runs 101-104).

    python3 bench/cute_probe.py [--gemms_only] [--tuned] [--geglu_only] [--out DIR]

Needs FlashAttention-4 (`flash-attn-4`, its Hopper forward takes head_dim 256) and `quack-kernels`
(GEMMs with a gated-activation epilogue), both on NVIDIA's CUTLASS Python DSL; none is in .whl
(100 MB, mostly the DSL's MLIR library): `bash bench/prepare_cute.sh` packs them for the device.

1. Attention, ALOHA-3 shapes (8 query heads on one K/V head, head_dim 256, the 96-token bucket:
   768 image + 96 prompt tokens of which 26 are padding): the prefix's (864 queries a head) and
   the expert's (50 queries a head against the prefix and the chunk: 914 keys), at batch 1 and 8.
   Ours is the served Triton kernel with its committed config; FA4 runs on the same q/k/v with
   the valid keys as `seqused_k` (it masks the tail: for the expert the chunk's keys are moved
   next to the prompt's valid ones, a layout the cache would then have to keep), at several key
   splits. Each graph calls 18 layers' caches in turn, so that K/V stream from HBM as in a call.
2. The prefix's gate_up + GeGLU at batch 1 and 8 (864 / 6912 rows, 2048 -> 2 x 16384): cuBLAS then
   our GeGLU pass (served), quack's plain GEMM, and quack's GEMM with the GeGLU in its epilogue
   (that applies GELU to the fp32 sums, where the served path rounds gate and up to bf16 first:
   not the eager path's rounding points, so this measures what such an epilogue could buy), and
   the served `--gemm-library quack` epilogue, which rounds where the eager path does, and variants
   of it (`register_variants`).
3. The prefix's and SigLIP's other GEMMs, cuBLAS against quack's (default or autotuned config).
Every output is compared with fp32 math on the same bf16 inputs. JSON: cute_probe.json.
"""

from __future__ import annotations

import math
import time
import traceback

import torch
import torch.nn.functional as F

from bench_gpu import log, time_graphed
from kernel_ladder import bench_run

from vlaserve.model.gemma import MASK_VALUE
from vlaserve.runtime.fast import kernels

HEADS, D, IMAGE, BUCKET, PROMPT, CHUNK, LAYERS = 8, 256, 768, 96, 70, 50, 18
WIDTH, FFN = 2048, 16384


def graphed_us(fn, calls: int = 1) -> float:
    return time_graphed(fn, iters=20)["p50_ms"] * 1e3 / calls


def attention_reference(q, k, v, valid):
    """fp32 softmax(q k^T / sqrt(D) + mask) v; q [B, Q, H, D], k/v [B, T, D], valid [B, T]."""
    s = torch.einsum("bqhd,btd->bhqt", q.float(), k.float()) / math.sqrt(D)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.einsum("bhqt,btd->bqhd", s.softmax(-1), v.float())


def attention_case(b: int, queries: int, keys: int, valid_keys: int, committed: dict, expert: bool) -> dict:
    from flash_attn.cute.interface import _flash_attn_fwd

    g = torch.Generator(device="cuda").manual_seed(b * 1000 + queries)
    qs = [torch.randn(b, queries, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    ks = [torch.randn(b, keys, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    vs = [torch.randn(b, keys, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    # Ours: padding in the middle for the expert (prompt padding, then the chunk), at the end for the prefix
    ours_valid = torch.zeros(b, keys, dtype=torch.bool, device="cuda")
    ours_valid[:, :IMAGE + PROMPT] = True
    if expert:
        ours_valid[:, keys - CHUNK:] = True
    bias = torch.where(ours_valid, 0.0, MASK_VALUE).float()
    q_heads = [q.permute(0, 2, 1, 3).reshape(b, HEADS * queries, D).contiguous() for q in qs]
    # FA4: the same valid keys first (a permutation of the keys: the softmax's sum is over the same set)
    order = torch.cat([ours_valid[0].nonzero().flatten(), (~ours_valid[0]).nonzero().flatten()])
    fa_ks = [k[:, order].unsqueeze(2).contiguous() for k in ks]
    fa_vs = [v[:, order].unsqueeze(2).contiguous() for v in vs]
    used = torch.full((b,), valid_keys, dtype=torch.int32, device="cuda")
    ref = attention_reference(qs[0], ks[0], vs[0], ours_valid).reshape(b, queries, HEADS * D)
    scale = ref.abs().max().item()
    flop = 4 * b * HEADS * queries * valid_keys * D
    row: dict = {"batch": b, "queries": queries, "keys": keys, "valid_keys": valid_keys, "flop": flop,
                 "committed": committed, "ref_scale": scale}

    def ours(layer):
        return kernels.mqa_attention(q_heads[layer], ks[layer], vs[layer], bias, HEADS, queries, committed)

    row["ours_vs_fp32"] = float((ours(0).float() - ref).abs().max())
    row["ours_us"] = graphed_us(lambda: [ours(i) for i in range(LAYERS)], LAYERS)
    row["ours_tflops"] = flop / row["ours_us"] / 1e6
    row["fa4"] = []
    for splits in ((1, 4, 16) if expert else (1,)):
        entry: dict = {"num_splits": splits}

        def fa4(layer, splits=splits):
            return _flash_attn_fwd(qs[layer], fa_ks[layer], fa_vs[layer], seqused_k=used, softmax_scale=D**-0.5,
                                   num_splits=splits, pack_gqa=True)[0]
        try:
            t0 = time.perf_counter()
            out = fa4(0)
            torch.cuda.synchronize()
            entry["first_call_s"] = time.perf_counter() - t0
            entry["vs_fp32"] = float((out.reshape(b, queries, HEADS * D).float() - ref).abs().max())
            entry["us"] = graphed_us(lambda: [fa4(i) for i in range(LAYERS)], LAYERS)
            entry["tflops"] = flop / entry["us"] / 1e6
        except Exception as exc:  # an unsupported shape or split: recorded, the probe goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        row["fa4"].append(entry)
        log(f"  b{b} q{queries} fa4 {entry}")
    log(f"attention b{b} {'expert' if expert else 'prefix'}: ours {row['ours_us']:.1f} us "
        f"({row['ours_tflops']:.0f} TFLOP/s, vs fp32 {row['ours_vs_fp32']:.2e})")
    return row


# (name, K, N, bias, layers a call): the prefix's (Gemma 2B) and SigLIP's GEMMs as the fast path
# runs them (fused q/k/v; the prefix's last layer computes only its K/V)
GEMMS = [("prefix_qkv", WIDTH, 2560, False, 18), ("prefix_o", WIDTH, WIDTH, False, 17),
         ("prefix_gate_up", WIDTH, 2 * FFN, False, 17), ("prefix_down", FFN, WIDTH, False, 17),
         ("vision_qkv", 1152, 3456, True, 27), ("vision_o", 1152, 1152, True, 27),
         ("vision_fc1", 1152, 4304, True, 27), ("vision_fc2", 4304, 1152, True, 27)]


def gemm_case(name: str, rows: int, k: int, n: int, with_bias: bool, layers: int, tuned: bool = False) -> dict:
    """cuBLAS (F.linear, served) against quack's GEMM with its default config (tuned=False), each
    over `layers` weight matrices in turn in one graph (weights stream from HBM as in a call)."""
    from quack.gemm_interface import gemm

    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(layers)]
    bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if with_bias else None
          for _ in range(layers)]
    row: dict = {"name": name, "rows": rows, "k": k, "n": n, "bias": with_bias, "layers": layers,
                 "flop_per_layer": 2 * rows * k * n}
    row["cublas_us"] = graphed_us(lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)], layers)
    try:
        row["quack_vs_cublas"] = float((gemm(x, ws[0].t(), bias=bs[0], tuned=False).float()
                                        - F.linear(x, ws[0], bs[0]).float()).abs().max())
        row["quack_us"] = graphed_us(lambda: [gemm(x, w.t(), bias=b, tuned=False) for w, b in zip(ws, bs)], layers)
        row["saved_per_call_us"] = (row["cublas_us"] - row["quack_us"]) * layers
        if tuned:  # quack's autotuner picks a config for this shape (it times its candidates once)
            t0 = time.perf_counter()
            out = gemm(x, ws[0].t(), bias=bs[0], tuned=True)
            torch.cuda.synchronize()
            row["quack_tuned_first_call_s"] = time.perf_counter() - t0
            row["quack_tuned_vs_cublas"] = float((out.float() - F.linear(x, ws[0], bs[0]).float()).abs().max())
            row["quack_tuned_us"] = graphed_us(lambda: [gemm(x, w.t(), bias=b, tuned=True) for w, b in zip(ws, bs)],
                                               layers)
            row["tuned_saved_per_call_us"] = (row["cublas_us"] - row["quack_tuned_us"]) * layers
    except Exception as exc:
        row["quack_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc()
    for key in ("cublas", "quack", "quack_tuned"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = row["flop_per_layer"] / row[f"{key}_us"] / 1e6
    log(f"gemm {name} {rows} rows: {row}")
    return row


def register_variants():
    """The served epilogue (vlaserve.runtime.fast.cute, "vlaserve_geglu"), and from the same pieces:
    "geglu_eager" (tanh as torch takes it: accurate tanhf), "geglu_fast_rounded" (quack's
    tanh.approx: a bound on what the rounding costs) and "geglu_served_unrounded" (no rounding:
    what GELU alone costs). Runs 105-106 also timed a cvt per value (commit 1fcc633's script)."""
    import cutlass.cute as cute_dsl
    from quack import activation, gemm_interface

    from vlaserve.runtime.fast import cute

    cute.register()
    ops = cute.epilogue_ops()

    def gelu_accurate(x):
        z = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        return 0.5 * x * (1.0 + cute_dsl.math.tanh(z, fastmath=False))

    def gelu_fast(x):
        return activation.gelu_tanh_approx(x)

    gates = {"geglu_eager": ops.gated(gelu_accurate, rounded=True),
             "geglu_fast_rounded": ops.gated(gelu_fast, rounded=True),
             "geglu_served_unrounded": ops.gated(ops.gelu_served, rounded=False)}
    for name, gate in gates.items():
        activation.gate_fn_map[name] = gate
        gemm_interface.gated_to_pytorch_fn_map[name] = gemm_interface.gated_to_pytorch_fn_map["geglu"]


def geglu_case(rows: int, tuned: bool) -> dict:
    from quack.gemm_interface import gemm, gemm_act

    from vlaserve.runtime.fast import cute

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(2 * FFN, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g) * WIDTH**-0.5)
    # quack's gated epilogue pairs adjacent columns (gate_i, up_i): the fused [gate; up] rows interleaved
    w_pairs = w.view(2, FFN, WIDTH).transpose(0, 1).reshape(2 * FFN, WIDTH)
    gate_up32 = x.float() @ w.float().t()
    ref = F.gelu(gate_up32[:, :FFN], approximate="tanh") * gate_up32[:, FFN:]
    scale = ref.abs().max().item()
    flop = 2 * rows * WIDTH * 2 * FFN
    row: dict = {"rows": rows, "flop": flop, "ref_scale": scale}

    def served():
        return kernels.geglu(F.linear(x, w))

    gate_up = F.linear(x, w)
    eager_out = F.gelu(gate_up[:, :FFN], approximate="tanh") * gate_up[:, FFN:]  # torch's eager ops on bf16
    row["served_vs_fp32"] = float((served().float() - ref).abs().max())
    row["served_differing_from_eager"] = int((served() != eager_out).sum())
    row["served_us"] = graphed_us(served)
    row["cublas_gemm_us"] = graphed_us(lambda: F.linear(x, w))
    variants = {
        "quack_gemm": lambda: gemm(x, w.t(), tuned=False),
        "quack_gemm_geglu": lambda: gemm_act(x, w_pairs.t(), activation="geglu", store_preact=False, tuned=False)[1],
    }
    for name in ("geglu_eager", "geglu_fast_rounded", "geglu_served_unrounded"):
        variants[f"quack_gemm_{name}"] = lambda name=name: gemm_act(x, w_pairs.t(), activation=name,
                                                                    store_preact=False, tuned=False)[1]
    variants["served_quack"] = lambda: cute.geglu_linear(x, w)  # --gemm-library quack: the halves, concat layout
    if tuned:
        variants["served_quack_tuned"] = lambda: gemm_act(x, w_pairs.t(), activation=cute.GEGLU,
                                                          store_preact=False, tuned=True)[1]
    served_out = served()
    for name, fn in variants.items():
        try:
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - t0
            if name == "quack_gemm":
                row[f"{name}_vs_cublas"] = float((out.float() - F.linear(x, w).float()).abs().max())
            else:
                row[f"{name}_vs_fp32"] = float((out.float() - ref).abs().max())
                row[f"{name}_vs_served"] = float((out.float() - served_out.float()).abs().max())
                row[f"{name}_differing_from_served"] = int((out != served_out).sum())
                row[f"{name}_differing_from_eager"] = int((out != eager_out).sum())
            row[f"{name}_us"] = graphed_us(fn)
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    for key in [k for k in row if k.endswith("_us")]:
        row[key.replace("_us", "_tflops")] = flop / row[key] / 1e6
    log(f"gate_up+geglu {rows} rows: {row}")
    return row


def main():
    args, results, save = bench_run("cute_probe", {
        "gemms_only": "skip the attention (run 101 measured it)",
        "tuned": "batch 8 only: quack's autotuned GEMMs too (the shapes its default config lost, run 102; the GeGLU epilogue)",
        "geglu_only": "only the gate_up + GeGLU (the eager-rounding epilogues)"})
    try:
        import cutlass
        results["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception as exc:
        results["cutlass_dsl"] = f"{type(exc).__name__}: {exc}"
    results["attention"], results["geglu"], results["gemms"] = [], [], []
    try:
        register_variants()
    except Exception as exc:
        results["register_variants"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    for b in () if args.gemms_only or args.geglu_only else (1, 8):
        prefix = IMAGE + BUCKET
        results["attention"].append(attention_case(b, prefix, prefix, IMAGE + PROMPT,
                                                   kernels.prefix_attention_config(b), expert=False))
        save()
        results["attention"].append(attention_case(b, CHUNK, prefix + CHUNK, IMAGE + PROMPT + CHUNK,
                                                   kernels.attention_config(b), expert=True))
        save()
    # batch 8 first: run 104 timed quack's GeGLU GEMM at 6912 rows slower after its 864-row call
    for rows in (8 * (IMAGE + BUCKET),) if args.tuned else (8 * (IMAGE + BUCKET), IMAGE + BUCKET):
        results["geglu"].append(geglu_case(rows, tuned=args.tuned))
        save()
    if args.geglu_only:
        return
    for b in (8,) if args.tuned else (1, 8):
        for name, k, n, with_bias, layers in GEMMS:
            if args.tuned and name not in ("prefix_gate_up", "prefix_down", "vision_fc2"):
                continue
            rows = b * (IMAGE + BUCKET) if name.startswith("prefix") else b * IMAGE
            results["gemms"].append(gemm_case(name, rows, k, n, with_bias, layers, tuned=args.tuned))
            save()
        saved = [r.get("saved_per_call_us", 0.0) for r in results["gemms"] if r["rows"] in (IMAGE * b, (IMAGE + BUCKET) * b)]
        results[f"gemms_saved_per_call_us_b{b}"] = sum(saved)
        log(f"b{b}: quack instead of cuBLAS saves {sum(saved):.0f} us a call over these GEMMs")
        save()


if __name__ == "__main__":
    main()
