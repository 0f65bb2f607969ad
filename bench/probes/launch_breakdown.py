"""Where Runtime.launch's ~1.1 ms goes for a lone batch-1 request (H200, in one process, warm): host time of
each step, and on the GPU the time from the launch's first operation to the prefix graph's start, and from the
Euler steps' end to the actions copied back (the device's own time outside prefix + denoise). MEMSET_KERNELS=0
serves with RuntimeConfig(graph_memset_kernels=False), to compare (run 210).

    MEMSET_KERNELS=1|0 python bench/probes/launch_breakdown.py CHECKPOINT OUT.json [CALLS]
"""
import sys, time, json
import numpy as np, torch
sys.path.insert(0, "bench")
from common import robot_observation
from vlaserve import Policy
import vlaserve.runtime.runner as runner_mod
import vlaserve.runtime.fast.graphs as graphs_mod

import os
MEMSET_KERNELS = os.environ.get("MEMSET_KERNELS", "1") == "1"
policy = Policy.from_pretrained(sys.argv[1], device="cuda", max_batch_size=1, warmup="blocking", progress=False,
                                **({} if MEMSET_KERNELS else {"graph_memset_kernels": False}))
policy.runtime.limit_host_threads()
rt = policy.runtime
fast = rt.runner
marks = {}
def mark(k): marks[k] = time.perf_counter()
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def f(*a, **k):
        mark(key + "0"); r = orig(*a, **k); mark(key + "1"); return r
    setattr(obj, name, f)

if hasattr(fast, "_inputs_in"):  # the staged tree: the inputs (noise included) through the staged block
    wrap(fast, "_inputs_in", "into")
else:
    wrap(graphs_mod, "into_buffers", "into")
wrap(fast, "_prefix", "prefix")
wrap(fast, "_denoise", "denoise")
wrap(fast, "_events", "events")
wrap(runner_mod.Launched, "enqueue", "enqueue")
wrap(fast, "launch", "runner")
orig_rt = rt.launch
gpu = {}
def rt_launch(*a, **k):
    mark("rt0")
    e0 = torch.cuda.Event(enable_timing=True); e0.record()
    r = orig_rt(*a, **k)
    e1 = torch.cuda.Event(enable_timing=True); e1.record()
    gpu["e"] = (e0, e1, r._stages)
    mark("rt1"); return r
rt.launch = rt_launch

obs = robot_observation(0, policy.config.state_dim, policy.config.action_horizon, policy.config.model.max_action_dim)
RTC = {"prev_chunk": np.random.default_rng(0).uniform(-1, 1, (40, 32)).astype(np.float32), "space": "model",
       "inference_delay": 3, "execution_horizon": 10}
for with_rtc in (False, True):
    rows = []
    for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 300):
        request = policy.request(obs, rtc=RTC if with_rtc else None)
        policy.prepare(request)
        time.sleep(0.002)
        launched = policy.launch([request])
        results = launched.finish()
        e0, e1, st = gpu["e"]
        m = marks
        rows.append({
            "rt_to_runner": m["runner0"] - m["rt0"],
            "runner_to_into": m["into0"] - m["runner0"],
            "into_buffers": m["into1"] - m["into0"],
            "into_to_events": m["events0"] - m["into1"],
            "events": m["events1"] - m["events0"],
            "events_to_prefix": m["prefix0"] - m["events1"],
            "prefix_graph_launch": m["prefix1"] - m["prefix0"],
            "denoise_graph_launch": m["denoise1"] - m["denoise0"],
            "denoise_to_runner_end": m["runner1"] - m["denoise1"],
            "runner_to_enqueue": m["enqueue0"] - m["runner1"],
            "enqueue": m["enqueue1"] - m["enqueue0"],
            "rt_launch_total": m["rt1"] - m["rt0"],
            "gpu_first_op_to_prefix_start": e0.elapsed_time(st.start) / 1e3,
            "gpu_denoise_end_to_copied": st.end.elapsed_time(e1) / 1e3,
            "gpu_prefix": st.start.elapsed_time(st.mid) / 1e3,
        })
    out = {k: [float(np.percentile([r[k] for r in rows[30:]], q)) * 1e6 for q in (50, 99)] for k in rows[0]}
    for k, (p50, p99) in out.items():
        print(f"{'rtc ' if with_rtc else ''}{k:32s} p50 {p50:9.1f} us   p99 {p99:9.1f} us")
    json.dump(out, open(sys.argv[2].replace(".json", "_rtc.json") if with_rtc else sys.argv[2], "w"), indent=1)

# Why the prefix graph's launch took 169 us (run 203) and the Euler steps' 38: its replay alone, with the device
# idle (2 ms asleep before, synchronized) and busy (a 5 ms sleep kernel ahead of it), and the Euler steps' the same.
b1 = fast.buffers(1, policy.preprocessor.prompt_buckets[0] if policy.preprocessor.prompt_buckets else policy.config.max_token_len)
pg = next(g for k, g in fast._prefix_graphs.items() if k[0] == 1 and k[2] == 3)
dg = next(g for k, g in fast._denoise_graphs.items() if k[0] == 1 and not k[3])
for name, g in (("prefix", pg), ("denoise", dg)):
    for state in ("idle", "busy"):
        ts = []
        for i in range(60):
            torch.cuda.synchronize(); time.sleep(0.002)
            if state == "busy":
                torch.cuda._sleep(5_000_000)
            t = time.perf_counter(); g.replay(); ts.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        print(f"{name} graph replay, device {state}: p50 {np.percentile(ts[10:], 50):.1f} us p99 {np.percentile(ts[10:], 99):.1f} us")
# Launched.enqueue's 101 us (run 203): its pinned allocation alone, after 2 ms idle, as a batch's.
ts = []
for i in range(60):
    time.sleep(0.002)
    t = time.perf_counter(); host = torch.empty((1, 50, 32), dtype=torch.float32, pin_memory=True); ts.append((time.perf_counter() - t) * 1e6)
    del host
print(f"pinned [1, 50, 32] allocation: p50 {np.percentile(ts[10:], 50):.1f} us p99 {np.percentile(ts[10:], 99):.1f} us")

# The graphs' topology: node types (cudaGraphNodeGetType) and edges (the DOT dump), prefix against denoise.
import ctypes, os, re, collections
lib = None
for line in open("/proc/self/maps"):
    if "libcudart" in line:
        lib = ctypes.CDLL(line.split()[-1]); break
TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event", 7: "event_record",
         10: "mem_alloc", 11: "mem_free", 12: "batch_memop", 13: "conditional"}
topology = {}
for name, g in ((("prefix", pg), ("denoise", dg)) if MEMSET_KERNELS else ()):
    print(name, 'memsets replaced', g.memsets_replaced, 'left', g.memsets_left)
    raw = ctypes.c_void_p(g.graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    assert lib.cudaGraphGetNodes(raw, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert lib.cudaGraphGetNodes(raw, nodes, ctypes.byref(n)) == 0
    types = collections.Counter()
    for node in nodes:
        t = ctypes.c_int(-1); lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)); types[TYPES.get(t.value, t.value)] += 1
    roots = ctypes.c_size_t(0); lib.cudaGraphGetRootNodes(raw, None, ctypes.byref(roots))
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"{name}_graph.dot")
    rc = lib.cudaGraphDebugDotPrint(raw, path.encode(), 0)
    dot = open(path).read() if rc == 0 else ""
    edges = len(re.findall(r"->", dot))
    topology[name] = {"nodes": n.value, "types": dict(types), "roots": roots.value, "edges": edges}
    print(f"{name} graph: {n.value} nodes {dict(types)}, {roots.value} roots, {edges} edges")
json.dump(topology, open(sys.argv[2].replace(".json", "_topology.json"), "w"), indent=1)
