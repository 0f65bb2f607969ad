import sys, json, os
sys.path.insert(0, "bench")
import torch, torch.nn.functional as F
from prefix_gemm import bench_ms
from vlaserve.runtime.fast import gemm, kernels
res = {}
for act, m, n, k in (("geglu", 6912, 16384, 2048), ("geglu", 864, 16384, 2048), ("none", 6144, 4304, 1152), ("none", 768, 3456, 1152)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    rows = 2 * n if act == "geglu" else n
    w = (torch.randn(rows, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    bias = None
    stock = (lambda: kernels.geglu(F.linear(x, w))) if act == "geglu" else (lambda: F.linear(x, w))
    ref = stock()
    row = {"stock_ms": bench_ms(stock), "linear_ms": bench_ms(lambda: F.linear(x, w))}
    print(act, m, "stock", row, flush=True)
    for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 4, 3)):
        if act == "geglu" and bn == 256:
            continue
        for ws in (None, "tiles", "k"):
            cfg = {"block_m": bm, "block_n": bn, "block_k": bk, "group_m": 8, "warps": warps, "stages": stages, "ws": ws}
            name = f"{bm}x{bn}x{bk}x{warps}x{stages}:{ws}"
            try:
                out = gemm.linear_act(x, w, bias, act, cfg)
                t = bench_ms(lambda: gemm.linear_act(x, w, bias, act, cfg))
                row[name] = {"ms": round(t, 4), "tflops": round(2 * m * rows * k / t / 1e9), "equal": bool(torch.equal(out, ref))}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            print(act, m, name, row[name], flush=True)
    res[f"{act}:{m}"] = row
open(os.path.join(os.environ.get("OUT", "."), "ws.json"), "w").write(json.dumps(res, indent=1))
