"""`--prefix-mlp quack` against the default on the served path (issue 14).

    python3 bench/prefix_mlp.py [--out DIR]      # needs `pip install 'vlaserve[cute]'` (bench/prepare_cute.sh)

Full-size Pi0.5 (random weights, bf16 + the fp32 set), bench_gpu.py's ALOHA-3 calls with the default
96-token prompt bucket. Two FastRunners (CUDA graphs, as the server runs them) on the same model: the
prefix's gate/up through cuBLAS and then our GeGLU pass, or through quack's GEMM with the GeGLU in
its epilogue (vlaserve.runtime.fast.cute). Per batch size:
- their actions, which must be bit-identical (the epilogue rounds where the eager path does);
- both against the fp32 eager model;
- p50 ms of a call, and its prefix and denoise stages.
JSON under bench/results/ (prefix_mlp.json) and --out.
"""

from __future__ import annotations

import json
import time

import torch

from bench_gpu import bucketed, eager, log, make_inputs, maxdiff
from kernel_ladder import BATCHES, bench_run, full_size_models, timed_call

from vlaserve.runtime.fast.graphs import FastRunner

BUCKET = 96


def main():
    args, results, save = bench_run("prefix_mlp")
    started = time.time()
    cfg, model, model32, policy_config = full_size_models()
    calls = {b: make_inputs(b, cfg.vlm.vocab_size, seed=b) for b in BATCHES}
    refs32 = {b: eager(model32, *calls[b]) for b in BATCHES}
    del model32
    t0 = time.perf_counter()
    runners = {"cublas": FastRunner(model, policy_config)}
    runners["quack"] = FastRunner(model, policy_config, prefix_mlp="quack")
    results["build_s"] = time.perf_counter() - t0
    log(f"built ({time.time() - started:.0f}s)")
    results["calls"] = {}
    for b in BATCHES:
        inputs, noise = calls[b]
        x = bucketed(inputs, BUCKET)
        row, outs = {}, {}
        for name, runner in runners.items():  # the first call compiles (quack's GEMM) and captures
            outs[name], row[name] = timed_call(runner, x, noise, refs32[b])
        row["actions_bit_identical"] = bool(torch.equal(outs["cublas"], outs["quack"]))
        row["quack_vs_cublas"] = maxdiff(outs["quack"], outs["cublas"])
        row["saved_ms"] = row["cublas"]["p50_ms"] - row["quack"]["p50_ms"]
        log(f"b={b}:", json.dumps(row))
        results["calls"][b], results["elapsed_s"] = row, time.time() - started
        save()  # after each batch size: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
