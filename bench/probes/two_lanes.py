"""Two robots on one GPU: alternate at batch 1 on one stream (today), batch 2 on one stream, or two
batch-1 lanes on two streams (each lane its own static buffers and graphs, weights shared) so one
call's compute-bound prefix can run beside the other's latency-bound denoise. Checks each lane's
actions are bit-identical to the serial ones; prints obs/s. (A probe: finding in docs/performance.md.)"""
import json, sys, time
sys.path.insert(0, "bench")
import torch
from common import bench_model, make_inputs
from vlaserve.runtime.fast.graphs import FastRunner
from vlaserve.runtime.fast.launch_tables import use_launch_table
from vlaserve.runtime.fast.targets import choose_target

model, config = bench_model(False, "cuda")
use_launch_table(choose_target(torch.device("cuda")))
steps = config.num_inference_steps
one = FastRunner(model, config)
two = FastRunner.__new__(FastRunner)
two.__dict__.update(one.__dict__)  # the same fused weights and kernels; its own buffers, graphs and pool
two._buffers, two._rtc, two._prefix_graphs, two._denoise_graphs = {}, {}, {}, {}
two._pool, two._capture_stream, two.frozen, two.captures = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), False, 0
one.warmup((2, 1), steps)
two.warmup((1,), steps)
(a, na), (b, nb) = make_inputs(1, 1000, seed=1), make_inputs(1, 1000, seed=2)
pair = make_inputs(2, 1000, seed=3)
ref_a = one.launch(a, na, steps)[0].clone(); ref_b = one.launch(b, nb, steps)[0].clone()
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
N = 200

def serial():
    for _ in range(N // 2):
        one.launch(a, na, steps); one.launch(b, nb, steps)

def batch2():
    for _ in range(N // 2):
        one.launch(pair[0], pair[1], steps)

def lanes():
    for _ in range(N // 2):
        with torch.cuda.stream(s1):
            one.launch(a, na, steps)
        with torch.cuda.stream(s2):
            two.launch(b, nb, steps)

out = {}
for name, fn in (("serial_b1", serial), ("batch2", batch2), ("two_lanes", lanes), ("serial_b1_again", serial)):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    out[name] = {"obs_per_s": N / (time.perf_counter() - t0)}
with torch.cuda.stream(s1):
    got_a = one.launch(a, na, steps)[0].clone()
with torch.cuda.stream(s2):
    got_b = two.launch(b, nb, steps)[0].clone()
torch.cuda.synchronize()
out["lanes_bit_identical"] = bool(torch.equal(got_a, ref_a) and torch.equal(got_b, ref_b))
print(json.dumps(out, indent=1))
