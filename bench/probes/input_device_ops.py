"""Experiment (issue 44, session 14): the device operations a batch-1 launch issues for its inputs and its RTC
guidance, counted with the meta device standing in for the GPU (each operation with a meta tensor among its
arguments or results would be a kernel launch or a copy there; views aside). Runs on this tree or, from another
tree's root, on that one (main: into_buffers and the device-side guidance; staged-inputs: the staged blocks).

    python bench/probes/input_device_ops.py
"""
import sys; sys.path.insert(0, "src"); sys.path.insert(0, "tests")
import collections, numpy as np, torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from vlaserve.config import ModelConfig, PolicyConfig
from vlaserve.types import ModelInputs
from vlaserve.model.rtc import RTCGuidance
from vlaserve.model.flow import euler_times
import vlaserve.runtime.fast.buffers as B
from vlaserve.runtime.fast.model import StaticRTC
import vlaserve.processing.prepare as P
class Count(TorchDispatchMode):
    def __init__(self): super().__init__(); self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = tree_flatten((args, kwargs or {}))[0]
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat + tree_flatten(out)[0]):
            if func.__name__.split(".")[0] not in ("view", "_unsafe_view", "permute", "slice", "select", "unsqueeze", "expand", "as_strided", "t", "alias", "detach", "empty_like", "empty"):
                self.ops[func.__name__] += 1
        return out
c = PolicyConfig(ModelConfig.full_size(), ("a","b","c"), 14, 14)
spec = B.BufferSpec.of(c, 1, torch.bfloat16)
buf = spec.allocate("meta")
rng = np.random.default_rng(0)
inp = ModelInputs(torch.from_numpy(rng.integers(0,256,(1,3,224,224,3),dtype=np.uint8)).permute(0,1,4,2,3), torch.ones(1,3,dtype=torch.bool), torch.zeros(1,200,dtype=torch.int64), torch.ones(1,200,dtype=torch.bool))
noise = torch.zeros(1,50,32)
rtc = RTCGuidance(torch.zeros(1,50,32), torch.zeros(1,50), torch.full((1,), 5.0))
if hasattr(B, "InputStaging"):
    st = B.InputStaging(spec, buf["inputs"])
    with Count() as inputs_count:
        order = P.into_staging(inp, noise, st.host, True); st.upload_inputs(order is not None); P.from_staging(inp, buf, order)
    static = StaticRTC.allocate(1, 50, 32, 10, "meta")
    with Count() as rtc_count:
        static.fill(rtc, euler_times(10))
else:
    with Count() as inputs_count:
        P.into_buffers(inp, buf); buf["noise"].copy_(noise, non_blocking=True)
    static = StaticRTC.allocate(1, 50, 32, 10, "meta")
    with Count() as rtc_count:
        r = RTCGuidance(*(t.to("meta", non_blocking=True) for t in (rtc.prev, rtc.weights, rtc.max_weight)))
        static.fill(r, euler_times(10))
print("inputs:", sum(inputs_count.ops.values()), dict(inputs_count.ops))
print("rtc:", sum(rtc_count.ops.values()), dict(rtc_count.ops))
