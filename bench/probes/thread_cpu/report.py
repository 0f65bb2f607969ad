"""Probe report (issue 43): each start's threads' CPU between the first action and every graph, and where
imports, Triton's key and SigLIP's attention took the CPU (bench/probes/thread_cpu/sitecustomize.py)."""
import glob, json, sys
out, label = sys.argv[1], sys.argv[2]
s = json.load(open(f"{out}/bench_serve_startup_{label}.json"))["startup"]
files = sorted(glob.glob(f"{out}/{label}.*.json"), key=lambda p: int(p.split(".")[-2]))
for (label, st), path in zip(s.items(), files):
    g = st["graphs"]
    fa, ev = st["process_to_first_action_s"], st["process_to_every_graph_s"]
    print(label, "first %.2f every %.2f capture_s %.2f warmup_s %.2f" % (fa, ev, g["capture_s"], g["warmup_s"]))
    d = json.load(open(path))
    tot = {}
    for b, th in d["buckets"].items():
        if fa - 1 <= float(b) <= ev:
            for n, c in th.items():
                tot[n] = tot.get(n, 0) + c
    print("  python threads' CPU s between first action and every graph:", {k: round(v, 2) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])})
    nat = {}
    for b, th in d["native"].items():
        if fa - 1 <= float(b) <= ev + 1:
            for n, c in th.items():
                nat[n] = nat.get(n, 0) + c
    print("  all threads by name (10 ms ticks):", {k: round(v, 2) for k, v in sorted(nat.items(), key=lambda kv: -kv[1])[:12]})
    print("  weights_s etc:", {k: round(v, 2) for k, v in (st.get("policy_timings") or {}).items() if isinstance(v, float)})
    agg = {}
    for k, v in d["stacks"].items():
        t, name, stack = k.split(" | ", 2)
        top = stack.split(" < ")[0]
        if "triton_key" in stack or "importlib" in top or "_vision_attention" in top:
            kk = (t, name, "triton_key" if "triton_key" in stack else "import" if "importlib" in top else "sdpa")
            agg[kk] = agg.get(kk, 0) + v
    print("  ", {"%s %s %s" % k: round(v, 2) for k, v in sorted(agg.items())})
