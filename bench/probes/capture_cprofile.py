"""Probe (runs 182-184; removed in the next commit): cProfile of captures: a fewer-camera prefix graph right after the full layout's, and an Euler-steps graph."""
import sys, time, cProfile, pstats, io
sys.path.insert(0, "bench")
import torch
from common import bench_model
from vlaserve.runtime.capture import GraphKey
from vlaserve.runtime.fast.graphs import FastRunner

model, cfg = bench_model(False, "cuda")
runner = FastRunner(model, cfg)
L = cfg.max_token_len
for key in (GraphKey(1, L, 3), GraphKey(1, L)):
    print(key, runner.capture(key, 10))
for b in (4,):
    for key in (GraphKey(b, L, 3), GraphKey(b, L)):
        print(key, runner.capture(key, 10))
    for key in (GraphKey(b, L, 2), GraphKey(b, L, rtc=True)):
        prof = cProfile.Profile()
        prof.enable()
        w, c = runner.capture(key, 10)
        prof.disable()
        print("=====", key, "warm-up", round(w, 4), "capture", round(c, 4))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print("\n".join(l[:160] for l in s.getvalue().splitlines()[6:32]))
