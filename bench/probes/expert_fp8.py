"""Would the expert's GEMMs pay in fp8 (issue 45: "the expert's where it measures faster")? Not maintained.

Per batch size (1, 2, 4, 8: 50 rows an item), each of the expert's four GEMM shapes (Gemma 300M: width 1024,
qkv 2560, o from 2048, gate_up 8192, down from 4096) timed in a CUDA graph of 180 back-to-back launches
(a call's 18 layers x 10 steps): bf16 through cuBLAS (F.linear), fp8 through torch._scaled_mm with
row-wise scales, and the fast path's activation quantizer for that input. Prints µs a GEMM and ms a call.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from vlaserve.model.fp8 import quantize_weight  # noqa: E402
from vlaserve.runtime.fast.fp8_kernels import quantize_rows  # noqa: E402

SHAPES = {"qkv": (1024, 2560), "o": (2048, 1024), "gate_up": (1024, 8192), "down": (4096, 1024)}
REPEAT = 180


def graphed_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEAT):
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPEAT)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    out = {}
    for batch in (1, 2, 4, 8):
        m = 50 * batch
        row = {}
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            qw, sw = quantize_weight(w)
            qx, sx = quantize_rows(x)
            bf16 = graphed_us(lambda: F.linear(x, w))
            fp8 = graphed_us(lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, n),
                                                      out_dtype=torch.bfloat16))
            quant = graphed_us(lambda: quantize_rows(x))
            ref = F.linear(x.float(), w.float())
            err = (torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, n), out_dtype=torch.bfloat16).float()
                   - ref).abs().max().item() / ref.abs().max().item()
            row[name] = {"bf16_us": bf16, "fp8_us": fp8, "quantizer_us": quant, "fp8_rel_err": err}
        calls = {k: sum(v[k] for v in row.values()) * REPEAT / 1e3 for k in ("bf16_us", "fp8_us", "quantizer_us")}
        row["per_call_ms"] = {"bf16": calls["bf16_us"], "fp8": calls["fp8_us"], "quantizers": calls["quantizer_us"],
                              "fp8_with_quantizers": calls["fp8_us"] + calls["quantizer_us"]}
        out[batch] = row
        print(batch, json.dumps({k: ({kk: round(vv, 2) for kk, vv in v.items()}) for k, v in row.items()}), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "expert_fp8.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
