"""Probe (issue 43, session 17; leaves the tree in the next commit): the host time of our own Python in one
Euler step of the expert (`FastPi05._expert_triton`) with every kernel it launches stubbed out, so what a
CUDA graph's recording spends in vlaserve's code apart from Triton's launcher and the driver.

    python bench/probes/expert_python_overhead.py   # CPU, the golden checkpoint, bf16
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from fixtures import fixture_dir  # noqa: E402

from vlaserve import Policy  # noqa: E402
from vlaserve.runtime.fast import kernels  # noqa: E402
from vlaserve.runtime.fast.model import FastPi05  # noqa: E402

policy = Policy.from_pretrained(fixture_dir("pi05_golden") / "checkpoint", device="cpu", dtype="bfloat16",
                                progress=False)
fast = FastPi05(policy.model, use_triton=False)
fast.use_triton = True
launches = [0]


def counted(result):
    def launch(*args, **kwargs):
        launches[0] += 1
        return result(*args, **kwargs)
    return launch


kernels.supported = lambda dims: True
kernels.through_cublas = lambda family, b: False
kernels.attention_config = lambda b: None
kernels.residual_norm = counted(lambda h, *a, **k: h)
kernels.linear_residual_norm = counted(lambda x, w, h, *a, **k: h)
kernels.geglu_linear = counted(lambda y, w: y.new_empty(y.shape[0], w.shape[0] // 2))
kernels.qkv_rope_into_cache = counted(lambda y, cos, sin, k_tail, v_tail, heads, horizon, **k:
                                      y.new_empty(y.shape[0] // horizon, heads, horizon, k_tail.shape[-1]))
kernels.mqa_attention = counted(lambda q, k, v, bias, heads, horizon, cfg:
                                q.new_empty(q.shape[0], horizon, heads * q.shape[-1]))

b, horizon, cache_len, prefix_len = 1, policy.config.action_horizon, 192, 100
layers, dims = len(fast.w.expert), fast.expert_dims
schedule = fast.schedule(10)
k_cache = torch.zeros(layers, b, cache_len, dims.head_dim, dtype=torch.bfloat16)
v_cache = torch.zeros_like(k_cache)
geometry = fast.action_geometry(torch.ones(b, prefix_len, dtype=torch.bool), horizon, cache_len)
h = torch.zeros(b, horizon, fast.w.expert[0].qkv.shape[1], dtype=torch.bfloat16)
for _ in range(3):
    fast._expert_triton(h, 1, schedule, geometry, k_cache, v_cache, prefix_len)
launches[0], times = 0, []
for _ in range(50):
    started = time.perf_counter()
    fast._expert_triton(h, 1, schedule, geometry, k_cache, v_cache, prefix_len)
    times.append(time.perf_counter() - started)
step_us = statistics.median(times) * 1e6
print(f"{layers} layers, {launches[0] // 50} stubbed launches a step: {step_us:.1f} us a step, "
      f"{step_us / layers:.1f} us a layer-step")
