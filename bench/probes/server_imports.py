"""Probe (issue 43, run 222): the server's imports in a fresh process, self time summed by package
(-X importtime), before and after `python -m compileall` / `vlaserve warmup` wrote their bytecode."""
import subprocess, sys
code = ("import vlaserve.cli, uvicorn, vlaserve.server, vlaserve.server.lifecycle, vlaserve.policy, "
        "vlaserve.runtime.fast.graphs, vlaserve.runtime.fast.kernels, triton")
r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True)
rows = []
for line in r.stderr.splitlines():
    if line.startswith("import time:") and "|" in line and "self" not in line:
        _, self_us, cum_us, name = [x.strip() for x in line.replace("import time:", "").split("|")] [0:1] + [x.strip() for x in line.split("|")]
        rows.append((int(line.split("|")[0].split(":")[1]), int(line.split("|")[1]), line.split("|")[2].rstrip()))
top_level = sum(c for s, c, n in rows if not n.startswith(" " * 2) and n.strip() == n.lstrip() and not n.startswith("  "))
print("modules %d, sum of self %.2f s" % (len(rows), sum(s for s, c, n in rows) / 1e6))
by_pkg = {}
for s, c, n in rows:
    by_pkg[n.strip().split(".")[0]] = by_pkg.get(n.strip().split(".")[0], 0) + s
print("by package (s):", {k: round(v / 1e6, 2) for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])[:14]})
print(r.stderr[-300:] if r.returncode else "")
