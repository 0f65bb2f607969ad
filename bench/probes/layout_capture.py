"""Probe (runs 182-184; removed in the next commit): Where a fewer-camera prefix graph's capture time goes: first eager run at a layout vs second, and
the capture after such a run, against the capture without it."""
import sys, time, json
sys.path.insert(0, "bench")
import torch
from common import bench_model
from vlaserve.runtime.capture import GraphKey
from vlaserve.runtime.fast.graphs import FastRunner

model, cfg = bench_model(False, "cuda")
out = {}
for variant in ("plain", "pre_run"):
    runner = FastRunner(model, cfg)
    L = cfg.max_token_len
    for b in (2, 8):
        row = {}
        t = time.perf_counter(); runner.capture(GraphKey(b, L, 3), 10); row["cams3_total"] = time.perf_counter() - t
        for slots in (2, 1):
            if variant == "pre_run":
                buf, _ = runner._scratch_of(b, L, 10)
                for i in range(2):
                    torch.cuda.synchronize(); t = time.perf_counter()
                    with torch.cuda.stream(runner._capture_stream):
                        runner._prefix_fn(buf, slots)()
                    torch.cuda.synchronize(); row[f"cams{slots}_eager{i}"] = time.perf_counter() - t
            w, c = runner.capture(GraphKey(b, L, slots), 10)
            row[f"cams{slots}_capture"] = c
        t = time.perf_counter(); w, c = runner.capture(GraphKey(b, L), 10); row["denoise"] = (w, c)
        w, c = runner.capture(GraphKey(b, L, rtc=True), 10); row["rtc"] = (w, c)
        out[f"{variant} b{b}"] = row
        print(variant, b, json.dumps(row), flush=True)
    del runner
    torch.cuda.empty_cache()
