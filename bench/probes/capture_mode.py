"""Probe (issue 43, run 219): a graph's recording time in torch's global vs thread-local capture mode, the same
process, the same graphs (full-size random Pi0.5, batch 1 and 8 at the default bucket, prefix and Euler steps),
interleaved rounds; also the memset edit's share.

    python bench/probes/capture_mode.py   (CUDA; writes /tmp/ck)
"""
import json, statistics as st, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "bench")
from common import bench_checkpoint
from vlaserve import Policy
from vlaserve.runtime.capture import GraphKey
from vlaserve.runtime.fast import graphs as G



def main():
    ck = bench_checkpoint(False, "cuda", Path("/tmp/ck"))
    t = time.perf_counter()
    policy = Policy.from_pretrained(ck, device="cuda", warmup="blocking", progress=False)
    print("loaded + captured in %.1f s" % (time.perf_counter() - t), flush=True)
    runner = policy.runtime.runner
    steps = policy.config.num_inference_steps
    L = min(policy.runtime._graphs.plan, key=lambda k: k.length).length
    keys = [GraphKey(1, L, 3), GraphKey(1, L, rtc=False), GraphKey(8, L, 3), GraphKey(8, L, rtc=False)]
    orig = torch.cuda.CUDAGraph.capture_begin
    mode_now = {"m": "thread_local"}
    def patched(self, pool=None, capture_error_mode="global", **kw):
        return orig(self, pool, capture_error_mode=mode_now["m"], **kw)
    torch.cuda.CUDAGraph.capture_begin = patched
    res = {}
    for rnd in range(4):
        for mode in ("global", "thread_local"):
            for edit in (True, False):
                mode_now["m"] = mode
                for key in keys:
                    graphs, gk, sig, make = runner._call_of(key, steps)
                    fn = make(runner.buffers(key.batch, L), runner._rtc_buffers(key.batch, L, steps))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    g = G._Graph(fn, runner._pool, runner._capture_stream, edit)
                    t1 = time.perf_counter()
                    res.setdefault(f"{key} {mode} edit={edit}", []).append((t1 - t0) * 1e3)
                    res.setdefault(f"{key} {mode} edit_s", []).append(g.edit_s * 1e3)
                    del g
    for k, v in res.items():
        print(k, "p50 %.1f ms  min %.1f  (%s)" % (st.median(v), min(v), " ".join("%.1f" % x for x in v)), flush=True)


if __name__ == "__main__":  # the compile workers, spawned, import this module again
    main()
