"""Which launch configuration of each expert-step Triton kernel is fastest on this GPU: the sweep that
regenerates a launch table (src/vlaserve/runtime/fast/launch_tables.py).

For the single-tile families at batch 1 (50 rows) — the split-K GEMM (o and down, with their residual
norm), the fused gate/up GeGLU GEMM, the q/k/v GEMM with RoPE — and the expert's attention, every
candidate config is timed in a CUDA graph over every layer's weights in turn (one layer's would sit in
L2, which a real step never sees), against the starting table's config. Each candidate also runs once
against the starting config's output: a config is kept only if it computes the same function (split-K
sums in another order: within bf16's rounding of the output, 2e-2 relative). Writes
tune_launch_tables.json (per family: default and best µs, every candidate; "table": the starting table
with each family's winner, to paste into launch_tables.py) and a PNG of default against best.

The batched rows (65, 200, 400 rows), the attention at batch 2-8 and the prefix's attention are chosen
from the denoise graph at each batch size (bench_gpu.py's timings, one table against another with
--launch-table), not here.

    python bench/tune_launch_tables.py [--table sm90] [--out DIR]
    python bench/tune_launch_tables.py --smoke   # the same sweep on the CPU in Triton's interpreter, tiny sizes
"""

from __future__ import annotations

import itertools
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch

from common import HORIZON, bench_model, log, parser, pyplot, save_json, save_png

from vlaserve.config import GemmaDims, ModelConfig, VisionDims  # noqa: E402
from vlaserve.demo import random_model  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.launch_tables import LAUNCH_TABLES, _thawed  # noqa: E402


def candidates(smoke: bool) -> dict[str, list[dict]]:
    """Each family's configs to try (--smoke: two each, that the interpreter runs in seconds)."""
    if smoke:
        return {"splitk": [{"block_r": 64, "block_n": 32, "block_k": 128, "max_waves": mw, "warps": 4, "stages": 2}
                           for mw in (1, 2)],
                "geglu": [{"block_r": 64, "block_n": bn, "block_k": 128, "warps": 4, "stages": 2} for bn in (16, 32)],
                "qkv": [{"block_r": 64, "block_n": bn, "block_k": 128, "warps": 4, "stages": 2} for bn in (16, 32)],
                "attention": [{"block_m": 64, "splits": sp, "block_t": 64, "warps": 4, "stages": 2} for sp in (1, 2)]}
    return {
        "splitk": [{"block_r": 64, "block_n": bn, "block_k": bk, "max_waves": mw, "warps": 4, "stages": st}
                   for bn, bk, mw, st in itertools.product((32, 64), (128, 256), (1, 2, 4), (3, 4))],
        "geglu": [{"block_r": 64, "block_n": bn, "block_k": bk, "warps": 4, "stages": st}
                  for bn, bk, st in itertools.product((16, 32), (64, 128, 256), (3, 4, 5))],
        "qkv": [{"block_r": 64, "block_n": bn, "block_k": bk, "warps": 4, "stages": st}
                for bn, bk, st in itertools.product((16, 32), (64, 128, 256), (3, 4, 5))],
        "attention": [{"block_m": bm, "splits": sp, "block_t": bt, "warps": wp, "stages": 2}
                      for bm, sp, bt, wp in [(16, 8, 64, 4), (16, 16, 64, 4), (32, 4, 64, 8), (32, 8, 64, 4),
                                             (32, 8, 64, 8), (32, 16, 64, 4), (64, 8, 64, 8), (64, 16, 64, 4),
                                             (64, 16, 64, 8), (64, 4, 128, 8), (128, 8, 64, 8)]],
    }


def family_calls(model, device: str, dtype: torch.dtype):
    """{family: fn(table) -> outputs}: one batch-1 expert step's launches of each family over every layer."""
    e = model.expert.dims
    r, w, mlp, d, hq = HORIZON, e.width, e.mlp_dim, e.head_dim, e.num_heads
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x_w, x_attn, x_act = rand(r, w), rand(r, hq * d), rand(r, mlp)
    layers = model.expert.layers
    w_qkv = [torch.cat([lyr.self_attn.q_proj.weight, lyr.self_attn.k_proj.weight, lyr.self_attn.v_proj.weight])
             for lyr in layers]
    w_gu = [torch.cat([lyr.mlp.gate_proj.weight, lyr.mlp.up_proj.weight]) for lyr in layers]
    w_o = [lyr.self_attn.o_proj.weight for lyr in layers]
    w_down = [lyr.mlp.down_proj.weight for lyr in layers]
    gate = torch.ones(w, device=device, dtype=dtype)
    ones, zeros = torch.ones(w, device=device), torch.zeros(w, device=device)
    cos = torch.rand(r, d // 2, generator=g).to(device)
    sin = torch.rand(r, d // 2, generator=g).to(device)
    keys = 1024 if device == "cuda" else 128
    kc, vc = [rand(1, keys, d) for _ in layers], [rand(1, keys, d) for _ in layers]
    bias = torch.zeros(1, keys, device=device)
    bias[:, keys * 7 // 8:] = -2.3819763e38
    q = rand(1, hq * r, d)

    h0 = rand(r, w)

    def splitk(table):
        h = h0.clone()  # the residual stream the kernel adds into, the same at each call
        return [kernels.linear_residual_norm(x, wt, h, gate, ones, zeros, 1e-6, table)
                for wo, wd in zip(w_o, w_down) for x, wt in ((x_attn, wo), (x_act, wd))]

    def qkv(table):
        outs = []
        for wq, k, v in zip(w_qkv, kc, vc):
            k_tail, v_tail = k[:, :r].clone(), v[:, :r].clone()
            outs += [kernels.qkv_rope_into_cache(x_w, cos, sin, k_tail, v_tail, hq, r, w_qkv=wq, table=table), k_tail]
        return outs

    return {"splitk": splitk, "geglu": lambda table: [kernels.geglu_linear(x_w, wgu, table) for wgu in w_gu],
            "qkv": qkv,
            "attention": lambda table: [kernels.mqa_attention(q, k, v, bias, hq, r, table["attention"], table)
                                        for k, v in zip(kc, vc)]}


def timer(device: str, layers: int):
    """fn -> µs a layer: a CUDA graph's replays on the GPU; --smoke, the interpreter's wall time."""
    if device == "cuda":
        import triton.testing

        def cuda_us(fn):
            fn()
            return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3 / layers
        return cuda_us

    def wall_us(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6 / layers
    return wall_us


def same_function(outs, reference) -> bool:
    """Every output within 2e-2 of the reference's scale (bf16 keeps 8 bits: a reordered sum moves a
    value by a few of its last bits; a wrong tile or index moves it by its own size)."""
    return all(torch.allclose(o.float(), r.float(), rtol=2e-2, atol=2e-2 * float(r.float().abs().max()) + 1e-6)
               for o, r in zip(outs, reference))


def main():
    ap = parser(__doc__)
    ap.add_argument("--table", choices=sorted(LAUNCH_TABLES), default="sm90", help="the table to start from")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tune_launch_tables needs a CUDA device (--smoke runs on the CPU)")
    if args.smoke:  # the smallest expert the kernels take (K a multiple of 256), in float16: the interpreter has no bf16
        gemma = GemmaDims(width=256, depth=1, mlp_dim=512, num_heads=2, num_kv_heads=1, head_dim=128, vocab_size=64)
        vision = VisionDims(width=64, depth=1, mlp_dim=128, num_heads=2, head_dim=32, image_size=28)
        model, dtype = random_model(ModelConfig(vision, gemma, gemma), torch.float16, device, seed=0, std=0.05), torch.float16
    else:
        model, dtype = bench_model(False, device)[0], torch.bfloat16
    start = LAUNCH_TABLES[args.table]
    calls = family_calls(model, device, dtype)
    us = timer(device, len(model.expert.layers))
    report, best_configs = {}, {}
    with torch.no_grad():
        for family, configs in candidates(args.smoke).items():
            reference = calls[family](start)
            default_us = us(lambda: calls[family](start))
            timed = []
            for cfg in configs:
                table = start.with_configs(**{family: cfg})
                try:
                    if not same_function(calls[family](table), reference):
                        log(f"{family} {cfg}: a different function, dropped")
                        continue
                    timed.append((us(lambda: calls[family](table)), cfg))
                except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                    log(f"{family} {cfg}: {type(exc).__name__}")
            best_us, best = min(timed, key=lambda tc: tc[0], default=(None, None))
            if best is not None and best_us < default_us:
                best_configs[family] = best
            report[family] = {"default": dict(start[family]), "default_us": default_us, "best_us": best_us,
                              "best": best, "tried": len(configs), "kept": len(timed),
                              "all": [{"us": t, **cfg} for t, cfg in sorted(timed, key=lambda tc: tc[0])]}
            log(f"{family}: {default_us:.2f} us; best of {len(timed)} kept: {best_us} us {best}")
    tuned = start.with_configs(**best_configs)
    results = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "smoke": args.smoke, "start": args.table, "families": report, "table": _thawed(tuned.configs)}
    save_json(results, args.out, "tune_launch_tables")
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    names = list(report)
    ax.bar([i - 0.2 for i in range(len(names))], [report[n]["default_us"] for n in names], 0.4, label=args.table)
    ax.bar([i + 0.2 for i in range(len(names))], [report[n]["best_us"] for n in names], 0.4, label="best")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("µs a layer")
    ax.legend()
    save_png(fig, args.out, "tune_launch_tables")


if __name__ == "__main__":
    main()
