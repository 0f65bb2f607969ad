"""Probe (runs 182-184; removed in the next commit): The full-size checkpoint loaded to the GPU through StagedCopy and through a direct .to(): the same
bits, and the rate of each from a warm page cache."""
import sys, time, json
from pathlib import Path
sys.path.insert(0, "bench")
import torch
from vlaserve.family import family_of, load_policy_config
from vlaserve.checkpoint import weights
from vlaserve.checkpoint.files import checkpoint_files

ck = Path(sys.argv[1])
for f in checkpoint_files(ck):  # into the page cache
    with open(f, "rb") as fh:
        while fh.read(1 << 26):
            pass
config = load_policy_config(ck)
family = family_of(config)
torch.zeros(1, device="cuda")
out, models = {}, {}
for run, staged in (("direct", False), ("staged", True), ("direct2", False), ("staged2", True)):
    original = weights.StagedCopy.__init__
    def init(self, device, chunk_bytes=weights.StagedCopy.CHUNK_BYTES, staged_=None, _s=staged):
        original(self, device, chunk_bytes, _s)
    weights.StagedCopy.__init__ = init
    torch.cuda.synchronize(); t = time.perf_counter()
    m = weights.load_weights(family.build_model(config), ck, torch.bfloat16, torch.device("cuda"), progress=False,
                             layout=family.weights)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    weights.StagedCopy.__init__ = original
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    out[run] = {"s": round(dt, 3), "GB_s": round(nbytes / dt / 1e9, 2)}
    if run in ("direct", "staged"):
        models[run] = {n: p.detach() for n, p in m.named_parameters()}
    del m
    print(run, out[run], flush=True)
same = all(torch.equal(models["direct"][n], p) and models["direct"][n].dtype == p.dtype for n, p in models["staged"].items())
print(json.dumps({"bit_identical": same, "tensors": len(models["staged"]), **out}))
