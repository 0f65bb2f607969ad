# Probe (issue 43, runs 221-222): per-thread CPU time of a `vlaserve.cli` process, sampled every 20 ms, with the
# Python stack each thread was in (4 s buckets), written to $VLASERVE_EXP_THREADS.<pid>.json once a second.
#   VLASERVE_EXP_THREADS=$OUT/x PYTHONPATH=$PYTHONPATH:bench/probes/thread_cpu \
#       python bench/bench_serve.py --startup --robots 0 --label x --out $OUT
#   python bench/probes/thread_cpu/report.py $OUT x
import os
if os.environ.get("VLASERVE_EXP_THREADS"):
    with open("/proc/self/cmdline", "rb") as f:
        _ours = b"vlaserve.cli" in f.read()
    if _ours:
        import json, sys, threading, time, traceback
        _t0 = time.monotonic()
        _path = "%s.%d.json" % (os.environ["VLASERVE_EXP_THREADS"], os.getpid())

        def _native():
            out = {}
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        s = f.read()
                    comm = s[s.index("(") + 1:s.rindex(")")]
                    rest = s[s.rindex(")") + 2:].split()
                    out[int(tid)] = (comm, (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK"))
                except (OSError, ValueError):
                    pass
            return out

        def _sample():
            me = threading.get_ident()
            last_py, last_native = {}, {}
            buckets, stacks, native_tot = {}, {}, {}
            n = 0
            while True:
                time.sleep(0.02)
                now = time.monotonic() - _t0
                b = "%.1f" % (int(now * 2) / 2)
                frames = sys._current_frames()
                for th in threading.enumerate():
                    if th.ident == me or th.ident is None:
                        continue
                    try:  # ns on the CPU, from the kernel: safe for a thread that has just exited
                        with open(f"/proc/self/task/{th.native_id}/schedstat") as f:
                            cpu = int(f.read().split()[0]) / 1e9
                    except (OSError, ValueError, TypeError):
                        continue
                    d = cpu - last_py.get(th.ident, cpu)
                    last_py[th.ident] = cpu
                    if d <= 0:
                        continue
                    name = th.name
                    buckets.setdefault(b, {}).setdefault(name, 0.0)
                    buckets[b][name] += d
                    fr = frames.get(th.ident)
                    if fr is not None:
                        st = traceback.extract_stack(fr)[-5:]
                        key = "%d | " % (int(now) // 4 * 4) + name + " | " + " < ".join("%s:%s:%d" % (os.path.basename(x.filename), x.name, x.lineno) for x in reversed(st))
                        stacks[key] = stacks.get(key, 0.0) + d
                n += 1
                if n % 50 == 0:
                    nat = _native()
                    for tid, (comm, cpu) in nat.items():
                        d = cpu - last_native.get(tid, cpu)
                        last_native[tid] = cpu
                        if d > 0:
                            native_tot.setdefault(b, {}).setdefault(comm, 0.0)
                            native_tot[b][comm] += d
                    top = dict(sorted(stacks.items(), key=lambda kv: -kv[1])[:400])
                    with open(_path + ".tmp", "w") as f:
                        json.dump({"buckets": buckets, "stacks": top, "native": native_tot, "t": now}, f)
                    os.replace(_path + ".tmp", _path)

        threading.Thread(target=_sample, name="exp-thread-sampler", daemon=True).start()
