"""The fast path's Triton kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

The GPU benches check them at full size; this checks their indexing and math on every commit: a
small model whose expert and prefix meet the kernels' shape rules, in float16 (the interpreter has
no bfloat16), through FastPi05 with Triton against FastPi05 with stock kernels (same rounding
points, other summation orders) and against the float32 model.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # the interpreter runs every kernel program in Python: minutes on 2 cores

SCRIPT = r'''
import json, sys
import torch
from vlaserve.demo import random_model
from vlaserve.config import GemmaDims, ModelConfig, VisionDims
from vlaserve.model.rtc import RTCGuidance
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.launch_tables import SM90
from vlaserve.runtime.fast.model import FastPi05, StaticRTC

assert kernels.available() and kernels.interpreted()
table = SM90.with_features(tma=json.loads(sys.argv[2]))  # the attention's loads: null = TMA (as on Hopper), false = pointers
gemma = GemmaDims(width=256, depth=2, mlp_dim=512, num_heads=2, num_kv_heads=1, head_dim=128, vocab_size=64)
cfg = ModelConfig(VisionDims(width=64, depth=1, mlp_dim=128, num_heads=2, head_dim=32, image_size=28), gemma, gemma)
torch.manual_seed(0)
b, cams, tokens, steps, horizon = int(sys.argv[1]), 2, 8, 3, 50
images = torch.rand(b, cams, 3, 28, 28) * 2 - 1
masks = torch.ones(b, cams, dtype=torch.bool)
masks[0, 1] = False
tok = torch.randint(1, 64, (b, tokens))
tmask = torch.ones(b, tokens, dtype=torch.bool)
tmask[:, 6:] = False
noise = torch.randn(b, horizon, 32)
rtc_in = RTCGuidance(torch.randn(b, horizon, 32), torch.rand(b, horizon), torch.full((b,), 5.0))

def run(dtype, use_triton, with_rtc):
    model = random_model(cfg, dtype, "cpu", seed=1, std=0.05)
    fast = FastPi05(model, use_triton=use_triton, launch_table=table)
    assert fast.use_triton == use_triton
    plen = cams * 4 + tokens
    cache = -(-(plen + horizon) // 64) * 64
    k = torch.zeros(2, b, cache, 128, dtype=dtype)
    v = torch.zeros_like(k)
    sched = fast.schedule(steps)
    rtc = None
    if with_rtc:
        rtc = StaticRTC.allocate(b, horizon, 32, steps, "cpu")
        rtc.fill(rtc_in, sched.times)
    with torch.no_grad():
        pad = fast.prefix(images, masks, tok, tmask, k, v, cams)
        out = fast.denoise(pad, noise, sched, k, v, rtc)
    return out.float(), k.float(), pad

report = {}
for with_rtc in (False, True):
    tri, k_tri, pad = run(torch.float16, True, with_rtc)
    ref16, k16, _ = run(torch.float16, False, with_rtc)
    ref32, _, _ = run(torch.float32, False, with_rtc)
    valid = pad[None, :, :, None]
    report[f"rtc={with_rtc}"] = {
        "triton_vs_stock16": float((tri - ref16).abs().max()),
        "stock16_vs_fp32": float((ref16 - ref32).abs().max()),
        "triton_vs_fp32": float((tri - ref32).abs().max()),
        "kv_triton_vs_stock16": float(((k_tri - k16)[:, :, :pad.shape[1]].abs() * valid).max()),
        "scale": float(ref32.abs().max()),
    }
print(json.dumps(report))
'''


# Batch 1, 2, 4 and 8 take each launch-config regime of the sm90 launch table in turn: single row tiles;
# the 65-, 200- and 400-row tables of the batched GEMMs; the attention configs of batch 1, 4 and 8;
# the prefix attention's configs of batch 1 and from 2 on; and batch 2 once more with the attention's
# tiles loaded through pointers instead of TMA descriptors (GPUs before Hopper).
@pytest.mark.parametrize("batch, tma", [(1, None), (2, None), (4, None), (8, None), (2, False)])
def test_triton_kernels_match_stock_kernels(batch, tma):
    report = interpreted_report(SCRIPT, str(batch), json.dumps(tma), timeout=1800)
    for name, r in report.items():
        # Triton and stock kernels round at the same points (fp16 here) and sum in other orders:
        # they may differ by what fp16 rounding alone does to the answer, which the stock path's
        # own distance from float32 measures. A wrong index or mask gives errors of order `scale`.
        assert r["triton_vs_stock16"] <= 2 * r["stock16_vs_fp32"] + 1e-3, (name, r)
        assert r["triton_vs_fp32"] <= 2 * r["stock16_vs_fp32"] + 1e-3, (name, r)
        # Prefix K/V: both paths round each value to fp16 (11 significant bits); the keys here lie
        # within |4|, where one fp16 step is 2e-3 (what is observed): 2e-2 allows 10 steps.
        assert r["kv_triton_vs_stock16"] < 2e-2, (name, r)
        # The reference itself must be sound: fp16 rounding moves the actions by well under 5%.
        assert r["stock16_vs_fp32"] < 0.05 * r["scale"], (name, r)


def test_launch_tables_pick_the_entry_for_each_batch_size():
    # Each table applies from its key on (the largest key <= the batch, or <= the row count); below
    # the first key of "attention_batched", batch 1's config; below the first row key, the first entry.
    from vlaserve.runtime.fast import kernels
    from vlaserve.runtime.fast.launch_tables import SM90 as t

    assert kernels.attention_config(1) is t["attention"]
    assert kernels.attention_config(2) is t["attention_batched"][2] is kernels.attention_config(3)
    assert kernels.attention_config(4) is t["attention_batched"][4] is kernels.attention_config(7)
    assert kernels.attention_config(8) is t["attention_batched"][8] is kernels.attention_config(32)
    assert kernels.prefix_attention_config(1) is t["prefix_attention"]
    assert kernels.prefix_attention_config(2) is t["prefix_attention_batched"][2] is kernels.prefix_attention_config(8)
    assert kernels.batched_config(100) is t["batched"][65] is kernels.batched_config(199)
    assert kernels.batched_config(10) is t["batched"][65]
    assert kernels.batched_config(200) is t["batched"][200] and kernels.batched_config(1600) is t["batched"][400]


def test_expert_gemm_families_through_cublas_follow_their_table():
    # The sm90 table's choice: qkv and gate_up through cuBLAS from batch 4; o and down always on ours.
    from vlaserve.runtime.fast import kernels

    assert [kernels.through_cublas(f, 2) for f in kernels.EXPERT_GEMMS] == [False] * 4
    assert [kernels.through_cublas(f, 8) for f in kernels.EXPERT_GEMMS] == [True, False, True, False]
    assert kernels.through_cublas("qkv", 4) and not kernels.through_cublas("qkv", 3)
    with pytest.raises(KeyError):
        kernels.through_cublas("lm_head", 8)


ATTENTION_INPUTS = r'''
import json
import torch
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.launch_tables import SM90

torch.manual_seed(0)
# 14 folded queries (not a multiple of the query tile, nor of 4 or 8 merge rows) against 150 keys that
# are views of a 192-row cache (an item stride longer than the keys, as the fast path's cache views
# have); item 0's last 30 keys are masked, item 1 attends to every key
b, heads, tokens, d, t, cache = 2, 2, 7, 32, 150, 192
q = torch.randn(b, heads * tokens, d).half()
k, v = torch.randn(b, cache, d).half()[:, :t], torch.randn(b, cache, d).half()[:, :t]
bias = torch.zeros(b, t)
bias[0, 120:] = -3.0e38
scores = (q.float() @ k.float().transpose(1, 2)) * d**-0.5 + bias[:, None]
ref = (torch.softmax(scores, -1) @ v.float()).view(b, heads, tokens, d).transpose(1, 2).reshape(b, tokens, heads * d)
report = {}
'''

MERGE_SCRIPT = ATTENTION_INPUTS + r'''
for rows in (1, 2, 4, 8):
    out = kernels.mqa_attention(q, k, v, bias, heads, tokens,
                                {"block_m": 16, "splits": 4, "block_t": 32, "warps": 4, "stages": 2},
                                SM90.with_configs(merge={"rows": rows, "warps": 4}))
    report[rows] = float((out.float() - ref).abs().max())
print(json.dumps(report))
'''

TMA_SCRIPT = ATTENTION_INPUTS + r'''
for splits in (1, 4):
    cfg = {"block_m": 16, "splits": splits, "block_t": 32, "warps": 4, "stages": 2}
    outs = {}
    for tma in (True, False):
        outs[tma] = kernels.mqa_attention(q, k, v, bias, heads, tokens, cfg, SM90.with_features(tma=tma))
    report[splits] = {"equal": bool(torch.equal(outs[True], outs[False])),
                      "vs_fp32": float((outs[True].float() - ref).abs().max())}
print(json.dumps(report))
'''


def interpreted_report(script: str, *args: str, timeout: int = 600) -> dict:
    """Runs `script` (with `args`) under Triton's interpreter; its last stdout line, as JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_attention_merge_takes_any_number_of_queries_per_program():
    # Four key splits merged by their log-sum-exp, 1 to 8 queries per merge program (the last
    # program of an item partly empty), against the softmax attention in float32.
    report = interpreted_report(MERGE_SCRIPT)
    # The outputs lie within |2|, where one fp16 step is 2e-3: a wrong row, split or mask is off by
    # the output's own size (~1), the fp16 rounding of q/k/v and the output by far less.
    assert all(err < 4e-3 for err in report.values()), report


def test_attention_tiles_through_tma_equal_pointer_loads():
    # The same sums in the same order, whether the copy engine or pointer loads bring the tiles in:
    # bit-identical outputs, with one key split and with four (64 keys each: the third runs past the
    # keys' end and the fourth lies wholly beyond it, where TMA zero-fills what pointer loads mask),
    # and both the softmax attention up to fp16 rounding.
    report = interpreted_report(TMA_SCRIPT)
    assert all(r["equal"] for r in report.values()), report
    # Outputs within |2|, one fp16 step 2e-3 (as the merge test): a wrong row or mask is off by ~1.
    assert all(r["vs_fp32"] < 4e-3 for r in report.values()), report


GELU_SCRIPT = r'''
import json
import torch
import torch.nn.functional as F
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.launch_tables import SM90

torch.manual_seed(0)
# 3 blocks of 2048 and a partial fourth (the mask), values across GELU's curved range and its tails
x = (torch.randn(6500) * 4).half()
want = F.gelu(x.float(), approximate="tanh").half()
got = kernels.gelu(x.clone())
err = (got.float() - want.float()).abs()
big = want.float().abs() >= 1e-3
steps = (err[big] / (torch.finfo(torch.float16).eps * want.float().abs()[big])).max()
print(json.dumps({"max_ulps": float(steps), "max_abs": float(err.max()),
                  "in_place": bool(kernels.gelu(x).data_ptr() == x.data_ptr())}))
'''


def test_gelu_kernel_rounds_as_torch():
    # The kernel computes GELU in fp32 between an fp16 load and store, as F.gelu does. Where the
    # output is >= 1e-3 the two can differ only where their fp32 tanh formulas (ours 2 / (1 +
    # exp(-2z)) - 1) round a value to the other side of an fp16 rounding boundary: one step at most.
    # The error is measured in units of eps x |GELU|, of which one fp16 step is between 0.5 and 1:
    # <= 1 admits one step and never two.
    # Below x ~ -5 GELU is < 1e-6 and 1 + tanh(z) cancels: torch's gives 0, ours a few fp16
    # subnormal steps (6e-8 each) of the true ~1e-7, hence 4e-7 absolute there. A wrong formula or
    # mask is off by far more (dropping the 0.044715 x^3 term alone moves GELU(2) by 3.4e-2, 34 fp16 steps).
    report = interpreted_report(GELU_SCRIPT)
    assert report["max_ulps"] <= 1.0, report
    assert report["max_abs"] <= 4e-7, report
    assert report["in_place"], report


GEGLU = r'''
import json
import torch
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.launch_tables import SM90

torch.manual_seed(0)
# 3 rows of 2 x 1500 columns: M not a multiple of the kernel's 1024-column block
gate, up = torch.randn(3, 1500).half() * 3, torch.randn(3, 1500).half()
out = kernels.geglu(torch.cat([gate, up], dim=1))
eager = (torch.nn.functional.gelu(gate.float(), approximate="tanh").half().float() * up.float()).half()
print(json.dumps({"vs_eager": float((out.float() - eager.float()).abs().max())}))
'''


def test_geglu_pass_rounds_as_the_eager_path():
    # Against torch's ops at the same rounding points: the tanh's formula differs in the last fp32
    # bits, which may move a product by one fp16 step (products within |64| here: at most 2**-5; the
    # observed is 3.6e-7); a gate and up from the wrong columns are off by the products' own size.
    report = interpreted_report(GEGLU)
    assert report["vs_eager"] <= 2**-5, report
