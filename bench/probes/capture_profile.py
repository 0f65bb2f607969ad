"""Where does a CUDA graph capture's time go? Times each graph's two warm-up runs, its capture and
its first replay while FastRunner.warmup captures batch 8 and 1 at prompt lengths 96 and 200
(20 graphs). Run twice with one TRITON_CACHE_DIR: empty, then warm. (A probe: its finding is in
docs/performance.md.)"""
import json, sys, time
sys.path.insert(0, "bench")
import torch
from common import bench_model
from vlaserve.runtime.fast import graphs as G
from vlaserve.runtime.fast.launch_tables import use_launch_table
from vlaserve.runtime.fast.targets import choose_target

rows = []
def timed_init(self, fn, pool, stream, lock):
    t0 = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(); torch.cuda.synchronize(); t1 = time.perf_counter()
        fn(); torch.cuda.synchronize(); t2 = time.perf_counter()
    torch.cuda.current_stream().wait_stream(stream)
    self.graph = torch.cuda.CUDAGraph()
    with lock, torch.cuda.graph(self.graph, pool=pool, stream=stream):
        self.output = fn()
    t3 = time.perf_counter()
    self.graph.replay(); torch.cuda.synchronize(); t4 = time.perf_counter()
    rows.append({"warm1": t1 - t0, "warm2": t2 - t1, "capture": t3 - t2, "first_replay": t4 - t3})
G._Graph.__init__ = timed_init

model, config = bench_model(False, "cuda")
use_launch_table(choose_target(torch.device("cuda")))
runner = G.FastRunner(model, config)
t0 = time.perf_counter()
runner.warmup((8, 1), config.num_inference_steps, (96, config.max_token_len))
total = time.perf_counter() - t0
summary = {k: sum(r[k] for r in rows) for k in rows[0]}
print(json.dumps({"graphs": len(rows), "total_s": total, "sum": summary, "first4": rows[:4], "last4": rows[-4:]}, indent=1))
