"""Probe (runs 182-184; removed in the next commit): The disk's cold read rate of a checkpoint: page cache evicted, files read with 1, 4, 16 threads
(16 MiB preads, buffered), and with O_DIRECT at 16 threads."""
import os, sys, time, mmap, threading, json
from pathlib import Path
sys.path.insert(0, "bench")
from common import evict_from_page_cache

ck = Path(sys.argv[1])
files = sorted(p for p in ck.glob("*.safetensors"))
total = sum(p.stat().st_size for p in files)
CHUNK = 16 << 20

def read_all(threads, direct):
    evict_from_page_cache(ck)
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, CHUNK)]
    lock = threading.Lock()
    def worker():
        buf = mmap.mmap(-1, CHUNK)
        fds = {}
        while True:
            with lock:
                if not jobs: break
                p, off = jobs.pop(0)
            if p not in fds:
                fds[p] = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            os.preadv(fds[p], [buf], off)
        for fd in fds.values(): os.close(fd)
    t = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(threads)]
    [x.start() for x in ths]; [x.join() for x in ths]
    dt = time.perf_counter() - t
    return {"threads": threads, "direct": direct, "s": round(dt, 2), "GB_s": round(total / dt / 1e9, 2)}

res = [read_all(n, d) for n, d in ((1, False), (4, False), (16, False), (16, True), (64, True))]
print(json.dumps({"bytes": total, "files": len(files), "reads": res}, indent=1))
