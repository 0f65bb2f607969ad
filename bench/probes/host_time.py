"""Where a lone robot's host time goes at batch 1, in-process (device idle between calls): run 163. Not maintained."""
import sys, time, statistics, tempfile, json, os
from pathlib import Path
sys.path.insert(0, "bench")
import torch
from common import bench_checkpoint, robot_observation
from vlaserve import Policy
import vlaserve.runtime.runner as rr

ckpt = bench_checkpoint(False, "cuda", Path(tempfile.mkdtemp()))
policy = Policy.from_pretrained(ckpt, device="cuda", warmup="blocking", progress=False)
rt = policy.runtime
rt.limit_host_threads()
c = policy.config
obs = robot_observation(0, c.state_dim, c.action_horizon, c.model.max_action_dim)

seg = {}
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); seg.setdefault(name, []).append((time.perf_counter() - t) * 1e3); return r
    return w
rr.to_device = timed("to_device", rr.to_device)
runner = rt.runner
runner.launch = timed("runner.launch", runner.launch)
rr.Launched.enqueue = staticmethod(timed("enqueue", rr.Launched.enqueue))
orig_launch = rt.launch
marks = []
def rt_launch(*a, **k):
    e0 = torch.cuda.Event(enable_timing=True); e0.record()
    t = time.perf_counter(); r = orig_launch(*a, **k); seg.setdefault("runtime.launch", []).append((time.perf_counter() - t) * 1e3)
    marks.append((e0, r)); return r
rt.launch = rt_launch
orig_wait = rr.Launched.wait
def wait(self):
    t = time.perf_counter(); r = orig_wait(self); seg.setdefault("wait", []).append((time.perf_counter() - t) * 1e3); return r
rr.Launched.wait = wait

tot = {k: [] for k in ("request", "policy.launch", "finish", "total", "device")}
gaps = {"e0_to_graph_start": [], "graph_end_to_ready": []}
for i in range(300):
    time.sleep(0.005)
    t0 = time.perf_counter(); req = policy.request(obs); t1 = time.perf_counter()
    b = policy.launch([req]); t2 = time.perf_counter()
    res = b.finish(); t3 = time.perf_counter()
    if i < 50: continue
    tot["request"].append((t1 - t0) * 1e3); tot["policy.launch"].append((t2 - t1) * 1e3)
    tot["finish"].append((t3 - t2) * 1e3); tot["total"].append((t3 - t0) * 1e3)
    tot["device"].append(res[0].timings["device_ms"])
    e0, launched = marks[-1]
    st = launched._stages
    gaps["e0_to_graph_start"].append(e0.elapsed_time(st.start))
print({k: len(v) for k, v in seg.items()})
out = {k: round(statistics.median(v), 4) for k, v in {**tot, **gaps, **{k: v[50:] for k, v in seg.items()}}.items() if v}
print(json.dumps(out, indent=1))
print("timings keys", res[0].timings)
import cProfile, pstats, io
pr = cProfile.Profile()
for i in range(100):
    time.sleep(0.005)
    pr.enable(); req = policy.request(obs); b = policy.launch([req]); pr.disable(); b.finish()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:6000])
