"""python bench/probes/memset_graph_launch.py OUT.json

Does a CUDA graph's launch cost grow with its memset nodes? Host time of graph.replay() for chains of small
kernels, with and without memset / memcpy nodes among them (cudaMemsetAsync / cudaMemcpyAsync recorded in the
capture, as cuDNN's SDPA and cuBLASLt's split-K GEMMs record theirs in the prefix graph)."""
import ctypes, json, sys, time
import numpy as np, torch

lib = None
torch.zeros(1, device="cuda")
for line in open("/proc/self/maps"):
    if "libcudart" in line:
        lib = ctypes.CDLL(line.split()[-1]); break
x = torch.zeros(1024, device="cuda")
scratch = torch.zeros(1024, device="cuda")

def build(kernels, memsets, memcpys):
    every_m = kernels // memsets if memsets else 0
    every_c = kernels // memcpys if memcpys else 0
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=s):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for i in range(kernels):
            x.add_(1)
            if every_m and i % every_m == 0:
                assert lib.cudaMemsetAsync(ctypes.c_void_p(scratch.data_ptr()), 0, ctypes.c_size_t(4), stream) == 0
            if every_c and i % every_c == 0:
                assert lib.cudaMemcpyAsync(ctypes.c_void_p(scratch.data_ptr() + 64), ctypes.c_void_p(scratch.data_ptr()),
                                           ctypes.c_size_t(4), 3, stream) == 0
    torch.cuda.synchronize()
    return g

out = {}
for name, (k, m, c) in {"440 kernels": (440, 0, 0), "440 kernels + 44 memsets": (440, 44, 0),
                        "440 kernels + 4 memsets": (440, 4, 0), "440 kernels + 1 memset": (440, 1, 0),
                        "440 kernels + 44 memcpys": (440, 0, 44), "1500 kernels": (1500, 0, 0),
                        "1500 kernels + 44 memsets": (1500, 44, 0), "100 kernels + 10 memsets": (100, 10, 0)}.items():
    g = build(k, m, c)
    for state in ("idle", "busy"):
        ts = []
        for i in range(60):
            torch.cuda.synchronize(); time.sleep(0.002)
            if state == "busy":
                torch.cuda._sleep(5_000_000)
            t = time.perf_counter(); g.replay(); ts.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        out[f"{name}, {state}"] = [float(np.percentile(ts[10:], 50)), float(np.percentile(ts[10:], 99))]
        print(f"{name:28s} device {state}: replay p50 {out[f'{name}, {state}'][0]:7.1f} us p99 {out[f'{name}, {state}'][1]:7.1f} us")
json.dump(out, open(sys.argv[1], "w"), indent=1)
