"""Run 51 (issue 14): where the fused norms of bench/expert_fusion.py lose. The denoise graph at batch
1, 2, 8 with norm kernels, with the norms inside the GEMMs, and with only the split-K residual
epilogue (each NormedRows materialized by a norm kernel before the next GEMM); then per-kernel
profiles at batch 1 and 2, both ways. Prints only (log in bench/results/expert_fusion_probe_run51.txt).

    python3 bench/expert_fusion_probe.py
"""
import sys, json, copy
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch
from bench_gpu import STEPS, log, profile_kernels, maxdiff
from kernel_ladder import denoise_setup, time_denoise
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.graphs import FastRunner

cfg, model, pc, fast, bufs, calls = denoise_setup()
orig_geglu, orig_qkv = kernels.geglu_linear, kernels.qkv_rope_into_cache
def mat(x):
    return kernels.residual_norm(x.h, x.scale, x.shift, eps=x.eps) if isinstance(x, kernels.NormedRows) else x
res = {}
for name in ("unfused", "fused", "epilogue_only"):
    kernels.TUNING["fused_norms"] = name != "unfused"
    if name == "epilogue_only":
        kernels.geglu_linear = lambda x, w: orig_geglu(mat(x), w)
        kernels.qkv_rope_into_cache = lambda x, *a, **k: orig_qkv(mat(x), *a, **k)
    res[name] = {b: time_denoise(fast, bufs[b])[0] for b in (1, 2, 8)}
    kernels.geglu_linear, kernels.qkv_rope_into_cache = orig_geglu, orig_qkv
    log(name, res[name])
for fused in (False, True):
    kernels.TUNING["fused_norms"] = fused
    r = FastRunner(model, pc)
    for b in (1, 2):
        log(f"profile fused={fused} b={b}")
        profile_kernels(r, *calls[b])
    del r
