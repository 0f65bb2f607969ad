"""The expert's GEMMs at batch 1 with their weights loaded before the PDL wait (issue 14).

At batch 1 every expert kernel waits (`griddepcontrol.wait`) for the one before it, then starts
reading its weights from HBM: 2-8 us kernels, each far from its weight-streaming floor. Weights are
written by no kernel, so they may be read before the wait, while the previous kernel still runs.
Runs 27-28 tried that inside the GEMM's K loop (the first tile peeled off) and lost Triton's
software pipelining. Here a program covers exactly one K tile (`TUNING["splitk"]["preload"]`:
K / block_k splits), so there is no loop to pipeline: its whole weight tile is loaded before the
wait and only x waits. o and down are split-K already; qkv and gate_up can become split-K too
(`TUNING["splitk_epilogue"]`), their RoPE / GeGLU then in the pass that reduces the partials
(one more kernel each, against the fused GEMM that reads its weights only after the wait).

In the denoise graph at batch 1 (full-size Pi0.5, random weights, bench_gpu.py's workload):
1. the committed configs, and qkv / gate_up as plain (looped, after-the-wait) split-K;
2. preloaded split-K for o and down over column tile x K tile x warps;
3. the two best of 2 with qkv, gate_up or both as preloaded split-K + a reducing pass;
4. the best of 2 with gate_up + GeGLU, then also qkv + RoPE, preloaded in one kernel each (the
   column tile's last program sums the partials and applies the epilogue);
5. at batch 8 (128-row tiles), o and down preloaded over column tile x K tile x warps;
then full calls (prefix + denoise graphs) at batch 1 with the committed and the best settings:
p50 ms, max|Δ| vs the fp32 eager model and vs eager bf16, repeats bit-identical.

    python3 bench/splitk_preload.py [--out DIR] [--control]

--control: each kept grid with its weights loaded before the wait and after it (run 92).

JSON under bench/results/ (splitk_preload.json) and --out.
"""

from __future__ import annotations

import copy
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from bench_gpu import STEPS, TOKENS, eager, log, make_inputs, maxdiff, time_cuda  # noqa: E402
from kernel_ladder import CAMERA_NAMES, bench_run, time_denoise  # noqa: E402

from vlaserve.checkpoint.weights import random_model  # noqa: E402
from vlaserve.config import ModelConfig, PolicyConfig  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

PRELOADED = [dict(block_r=64, block_n=n, block_k=k, preload=True, warps=w, stages=1)
             for n, k, w in itertools.product((16, 32, 64), (128, 256), (4, 8))]
EPILOGUES = (("qkv",), ("gate_up",), ("qkv", "gate_up"))


def control(fast, buf, buf8, committed, measure, measure8):
    """--control (run 92): each kept shape with its weights loaded before the wait and after it
    (the same grid, the same sums), so that the load order alone is what differs."""
    best_splitk = dict(block_r=64, block_n=64, block_k=256, warps=4, stages=1)
    for n, k, w in ((64, 256, 4), (32, 256, 4), (64, 128, 8), (16, 128, 4)):
        for pre in (True, False):
            measure(f"one tile o/down {n}x{k} w{w} preload={pre}",
                    {"splitk": dict(block_r=64, block_n=n, block_k=k, warps=w, stages=1, preload=pre)})
    for n, k, w in ((32, 256, 8), (16, 256, 4)):
        for pre in (True, False):
            measure(f"one tile o/down + last-program geglu {n}x{k} w{w} preload={pre}",
                    {"splitk": {**best_splitk, "preload": pre},
                     "geglu": dict(block_r=64, block_n=n, block_k=k, warps=w, stages=1, preload=pre)})
    for pre in (True, False):
        measure(f"one tile o/down + last-program qkv 32x256 w4 preload={pre}",
                {"splitk": {**best_splitk, "preload": pre},
                 "qkv": dict(block_r=64, block_n=32, block_k=256, warps=4, stages=1, preload=pre)})
    for n in (64, 128):
        for pre in (True, False):
            batched = copy.deepcopy(committed["batched"])
            batched[400]["splitk"] = dict(block_r=128, block_n=n, block_k=256, warps=8, stages=1, preload=pre)
            measure8(f"b8 one tile o/down {n}x256 w8 preload={pre}", {"batched": batched})


def main():
    control_only = "--control" in sys.argv
    if control_only:
        sys.argv.remove("--control")
    args, results, save = bench_run("splitk_preload_control" if control_only else "splitk_preload")
    started = time.time()
    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    policy_config = PolicyConfig(cfg, CAMERA_NAMES, 14, 14)
    runner = FastRunner(model, policy_config, use_graphs=False)
    inputs, noise = make_inputs(1, cfg.vlm.vocab_size, seed=1)
    runner.sample(inputs, noise, STEPS, None)
    fast, buf = runner.fast, runner.buffers(1, TOKENS)
    committed = copy.deepcopy(kernels.TUNING)
    results["committed"] = {k: committed[k] for k in ("splitk", "splitk_epilogue", "pdl")}
    results["pdl"] = kernels.pdl_enabled()
    base_ms, base_out = time_denoise(fast, buf)
    rows = results["denoise_b1"] = [{"label": "committed", "ms": base_ms, "vs_committed": 0.0}]
    log(f"built ({time.time() - started:.0f}s); committed denoise b1 {base_ms:.3f} ms")

    def measure(label: str, tuning: dict) -> dict | None:
        kernels.TUNING.clear()
        kernels.TUNING.update(copy.deepcopy(committed), **copy.deepcopy(tuning))
        try:
            ms, out = time_denoise(fast, buf)
        except Exception as exc:  # a config the compiler rejects (shared memory, registers)
            log(f"{label}: {type(exc).__name__}: {str(exc)[:160]}")
            rows.append({"label": label, "tuning": tuning, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            return None
        row = {"label": label, "tuning": tuning, "ms": ms, "vs_committed": maxdiff(out, base_out)}
        rows.append(row)
        log(f"{label}: {ms:.3f} ms (committed {base_ms:.3f}), vs committed {row['vs_committed']:.2e}")
        save()
        return row

    if control_only:
        inputs8, noise8 = make_inputs(8, cfg.vlm.vocab_size, seed=8)
        runner.sample(inputs8, noise8, STEPS, None)
        buf8 = runner.buffers(8, TOKENS)
        kernels.TUNING.clear()
        kernels.TUNING.update(copy.deepcopy(committed))
        base8_ms, base8_out = time_denoise(fast, buf8)
        rows8 = results["denoise_b8"] = [{"label": "committed", "ms": base8_ms}]

        def measure8(label, tuning):
            kernels.TUNING.clear()
            kernels.TUNING.update(copy.deepcopy(committed), **copy.deepcopy(tuning))
            ms, out = time_denoise(fast, buf8)
            rows8.append({"label": label, "ms": ms, "vs_committed": maxdiff(out, base8_out)})
            log(f"{label}: {ms:.3f} ms (committed {base8_ms:.3f})")
            save()

        control(fast, buf, buf8, committed, measure, measure8)
        measure("committed again", {})
        kernels.TUNING.clear()
        kernels.TUNING.update(committed)
        results["elapsed_s"] = time.time() - started
        save()
        return
    for ep in EPILOGUES:
        measure(f"plain split-K + {'/'.join(ep)}", {"splitk_epilogue": ep})
    preloaded = [r for c in PRELOADED if (r := measure(f"preload o/down {c}", {"splitk": c}))]
    preloaded.sort(key=lambda r: r["ms"])
    for r, ep in itertools.product(preloaded[:2], EPILOGUES):
        measure(f"preload {r['tuning']['splitk']} + {'/'.join(ep)}", {**r["tuning"], "splitk_epilogue": ep})
    # The fused kernels preloaded: gate_up + GeGLU, then qkv + RoPE with the best GeGLU.
    best_splitk = preloaded[0]["tuning"]
    fused = [r for n, k, w in itertools.product((16, 32), (128, 256), (4, 8))
             if (r := measure(f"preload o/down + fused geglu {n}x{k} w{w}",
                              {**best_splitk, "geglu": dict(block_r=64, block_n=n, block_k=k, preload=True, warps=w,
                                                            stages=1)}))]
    best_geglu = min(fused, key=lambda r: r["ms"])["tuning"] if fused else best_splitk
    for n, k, w in itertools.product((16, 32), (128, 256), (4, 8)):
        measure(f"preload o/down + fused geglu + fused qkv {n}x{k} w{w}",
                {**best_geglu, "qkv": dict(block_r=64, block_n=n, block_k=k, preload=True, warps=w, stages=1)})
    again = measure("committed again", {})

    # Batch 8 (400 rows: 128-row tiles, so each weight tile is read by four programs): o and down
    # preloaded, against the committed batched config.
    inputs8, noise8 = make_inputs(8, cfg.vlm.vocab_size, seed=8)
    runner.sample(inputs8, noise8, STEPS, None)
    buf8 = runner.buffers(8, TOKENS)
    kernels.TUNING.clear()
    kernels.TUNING.update(copy.deepcopy(committed))
    base8_ms, base8_out = time_denoise(fast, buf8)
    results["denoise_b8"] = rows8 = [{"label": "committed", "ms": base8_ms}]
    for n, k, w in itertools.product((64, 128), (128, 256), (4, 8)):
        c = dict(block_r=128, block_n=n, block_k=k, preload=True, warps=w, stages=1)
        batched = copy.deepcopy(committed["batched"])
        batched[400]["splitk"] = c
        kernels.TUNING.clear()
        kernels.TUNING.update(copy.deepcopy(committed), batched=batched)
        try:
            ms, out = time_denoise(fast, buf8)
            rows8.append({"label": f"preload o/down {c}", "ms": ms, "vs_committed": maxdiff(out, base8_out)})
        except Exception as exc:
            rows8.append({"label": f"preload o/down {c}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        log(f"b8: {rows8[-1]} (committed {base8_ms:.3f})")
        save()
    ok = [r for r in rows if "ms" in r and r["label"] not in ("committed", "committed again")]
    best = min(ok, key=lambda r: r["ms"])
    results["best"] = best
    log(f"best: {best['label']} {best['ms']:.3f} ms vs committed {base_ms:.3f} / {again['ms']:.3f}")

    # Full calls at batch 1: committed vs best, with the accuracy lines.
    model32 = copy.deepcopy(model).float()
    ref32, ref16 = eager(model32, inputs, noise), eager(model, inputs, noise)
    del model32
    results["calls_b1"] = {}
    outs = {}
    for label, tuning in (("committed", {}), ("best", best["tuning"]), ("best, PDL off", {**best["tuning"], "pdl": False}),
                          ("committed again", {})):
        kernels.TUNING.clear()
        kernels.TUNING.update(copy.deepcopy(committed), **copy.deepcopy(tuning))
        final = FastRunner(model, policy_config)
        out, _ = final.sample(inputs, noise, STEPS, None)
        repeat, _ = final.sample(inputs, noise, STEPS, None)
        stages = sorted((final.sample(inputs, noise, STEPS, None)[1] for _ in range(11)),
                        key=lambda s: s["denoise_ms"])
        row = {"p50_ms": time_cuda(lambda: final.sample(inputs, noise, STEPS, None))["p50_ms"],
               "denoise_ms": stages[5]["denoise_ms"], "prefix_ms": stages[5]["prefix_ms"],
               "vs_fp32": maxdiff(out, ref32), "vs_eager_bf16": maxdiff(out, ref16),
               "repeat_bit_identical": bool(torch.equal(out, repeat))}
        outs[label] = out
        if label == "best, PDL off":  # PDL only moves where a kernel waits: the same bits
            row["equal_to_best_with_pdl"] = bool(torch.equal(out, outs["best"]))
        results["calls_b1"][label] = row
        log(f"call b1 {label}: {row}")
        del final
        torch.cuda.empty_cache()
        save()
    kernels.TUNING.clear()
    kernels.TUNING.update(committed)
    results["elapsed_s"] = time.time() - started
    save()
    log(f"done in {results['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
