"""batch_invariant (`vlaserve serve --batch-invariant`): an observation's actions are the same bits at every
batch size and batch position, from its own prefix or a cached one. Tolerance everywhere: none (bit-equal).

On the CPU the eager model runs each item on its own (runtime.runner.PerItemRunner); the golden checkpoint's
batches below mix what batching could leak through: camera layouts (SigLIP's slots any item uses), image
sizes (resized frames), prompt lengths, RTC on some items only, and prefix-cache hits. The fast path's
kernels are checked under Triton's interpreter (slow-marked, like tests/test_triton_kernels.py) at the
shapes its batch-invariant launch table picks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from openpi_client import msgpack_numpy

from vlaserve import Policy
from vlaserve.config import RuntimeConfig
from vlaserve.errors import ConfigError
from vlaserve.runtime.fast.launch_tables import LAUNCH_TABLES, SM90

from test_server import GENERATIONS, MSGPACK, ServerProcess, make_noise, make_observation

CAMERA_LAYOUTS = (("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), ("base_0_rgb",),
                  ("base_0_rgb", "left_wrist_0_rgb"), ("left_wrist_0_rgb",))


def varied_observation(seed: int) -> dict:
    obs = make_observation(seed, cameras=CAMERA_LAYOUTS[seed % 4], size=(224, 224) if seed % 3 else (120, 160))
    obs["task"] = "pick up the block " + "and put it in the bin " * (seed % 5)
    return obs


def batch_inputs(policy: Policy, seeds) -> tuple[list[dict], list[np.ndarray], list[dict | None]]:
    observations = [varied_observation(s) for s in seeds]
    noise = [make_noise(s) for s in seeds]
    rtcs = []
    for i, (obs, s) in enumerate(zip(observations, seeds)):
        if s % 3 == 1:  # RTC on some items only: the others run with zero weights in the batch
            left = policy.infer(obs, seed=s).model_actions[20:, :14]
            rtcs.append({"prev_chunk": left, "inference_delay": 2, "execution_horizon": 8})
        else:
            rtcs.append(None)
    return observations, noise, rtcs


def alone(policy: Policy, observations, noise, rtcs) -> list[np.ndarray]:
    return [policy.infer(o, noise=z, rtc=r).model_actions for o, z, r in zip(observations, noise, rtcs)]


def assert_bit_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"item {i}: max |diff| {np.abs(g - w).max():.3g}"


@pytest.fixture(scope="module")
def invariant(golden):
    return Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                  batch_invariant=True)


@pytest.fixture(scope="module")
def invariant_cached(golden):
    return Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False,
                                  batch_invariant=True, prefix_cache=32)


def test_a_batch_of_8_equals_each_item_alone(invariant):
    observations, noise, rtcs = batch_inputs(invariant, range(8))
    want = alone(invariant, observations, noise, rtcs)
    batch = invariant.infer_batch(observations, noise=noise, rtcs=rtcs)
    assert {r.timings["batch_size"] for r in batch} == {8}
    assert_bit_equal([r.model_actions for r in batch], want)
    # every position: the batch reversed, and each item inside smaller batches of others
    order = list(range(8))[::-1]
    reversed_batch = invariant.infer_batch([observations[i] for i in order], noise=[noise[i] for i in order],
                                           rtcs=[rtcs[i] for i in order])
    assert_bit_equal([r.model_actions for r in reversed_batch], [want[i] for i in order])
    part = invariant.infer_batch(observations[2:5], noise=noise[2:5], rtcs=rtcs[2:5])
    assert_bit_equal([r.model_actions for r in part], want[2:5])



def test_a_traced_batch_gives_each_item_its_own_trace_and_actions(invariant):
    """return_trace on the per-item runner: each item's trace is written where its own call runs (a view of
    the batch's), the same bits as alone, and ends in the actions returned."""
    observations, noise, rtcs = batch_inputs(invariant, range(3))
    lone = [invariant.infer(o, noise=z, rtc=r, return_trace=True) for o, z, r in zip(observations, noise, rtcs)]
    batch = invariant.infer_batch(observations, noise=noise, rtcs=rtcs, return_trace=True)
    for mine, single, z in zip(batch, lone, noise):
        assert mine.trace.shape == (invariant.config.num_inference_steps + 1, *mine.model_actions.shape)
        assert np.array_equal(mine.trace, single.trace) and np.array_equal(mine.model_actions, single.model_actions)
        assert np.array_equal(mine.trace[0], z) and np.array_equal(mine.trace[-1], mine.model_actions)

def test_prefix_cache_hits_equal_the_prefix_computed(invariant_cached):
    policy = invariant_cached
    observations, noise, rtcs = batch_inputs(policy, range(10, 18))
    misses = policy.metadata["prefix_cache"]["misses"]
    want = alone(policy, observations, noise, rtcs)  # each computes its prefix alone (and caches it)
    assert policy.metadata["prefix_cache"]["misses"] > misses
    hits = policy.metadata["prefix_cache"]["hits"]
    batch = policy.infer_batch(observations, noise=noise, rtcs=rtcs)  # every prefix from the cache
    assert policy.metadata["prefix_cache"]["hits"] > hits
    assert_bit_equal([r.model_actions for r in batch], want)
    # a batch mixing hits and a miss: a fresh observation beside the cached ones
    fresh, fresh_noise, _ = batch_inputs(policy, [40])
    mixed = policy.infer_batch(observations[:3] + fresh, noise=noise[:3] + fresh_noise, rtcs=rtcs[:3] + [None])
    assert_bit_equal([r.model_actions for r in mixed], want[:3] + [policy.infer(fresh[0], noise=fresh_noise[0])
                                                                      .model_actions])


def test_the_mode_is_reported_and_prompts_keep_one_length(invariant, golden_policy):
    assert invariant.metadata["batch_invariant"] is True and golden_policy.metadata["batch_invariant"] is False
    assert invariant.runtime.settings.prompt_buckets == ()
    # auto buckets resolve to none wherever the fast path would take one
    assert RuntimeConfig(batch_invariant=True).resolved_prompt_buckets(200, "cuda") == ()
    assert RuntimeConfig().resolved_prompt_buckets(200, "cuda") == (96,)


@pytest.mark.parametrize("options, named", [
    ({"precision": "fp8"}, "precision"), ({"precision": "fp8+expert"}, "precision"),
    ({"gemm_library": "quack"}, "gemm_library"), ({"attention_library": "fa4"}, "attention_library"),
    ({"prompt_buckets": "48,96"}, "prompt_buckets"),
])
def test_combinations_it_cannot_honour_are_refused(options, named):
    with pytest.raises(ConfigError, match=named):
        RuntimeConfig(batch_invariant=True, **options)
    RuntimeConfig(**options)  # each alone is a valid setting


def test_the_default_launch_tables_are_untouched():
    # The invariant table is a new table; the served ones keep their batched entries and cuBLAS switch-over.
    for table in LAUNCH_TABLES.values():
        assert not table.batch_invariant and "fixed_gemm" not in table.configs
        assert table["cublas_from_batch"] and table["attention_batched"] and table["batched"]
    invariant = SM90.batch_invariant_table()
    assert invariant.batch_invariant and invariant["attention_batched"] == {}
    assert invariant["cublas_from_batch"] == {} and invariant["action"]["max_rows"] == float("inf")
    assert SM90["action"]["max_rows"] == 64


# ---- a served `vlaserve serve --batch-invariant` ----------------------------------------------------------
@pytest.mark.slow
def test_served_batches_equal_items_sent_alone(golden, tmp_path, invariant):
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32", "--batch-invariant",
                          "--prefix-cache", "8"], tmp_path / "server.log")
    try:
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, timeout=300) as http:
            metadata = http.get("/v1/actions/metadata").json()
            assert metadata["capabilities"]["batch_invariant"] is True
            seeds = range(50, 58)
            observations = [make_observation(s, size=(32, 40)) for s in seeds]
            noise = np.stack([make_noise(s) for s in seeds])

            def post(items: list[int]) -> np.ndarray:
                body = {"input": {"task": [observations[i]["task"] for i in items], "observation": {
                    "images": {c: np.stack([observations[i]["images"][c] for i in items])
                               for c in observations[0]["images"]},
                    "state": np.stack([observations[i]["state"] for i in items]), "noise": noise[items]}},
                    "runtime": {"response_format": "raw"}}
                reply = http.post(GENERATIONS, content=msgpack_numpy.packb(body), headers={"Content-Type": MSGPACK})
                assert reply.status_code == 200, reply.text
                return msgpack_numpy.unpackb(reply.content)["actions"]

            batch = post(list(range(8)))  # one batch of 8: every prefix computed
            singles = [post([i])[0] for i in range(8)]  # alone: every prefix from the cache (8 entries)
            assert_bit_equal(list(batch), singles)
            # and the in-process policy's, on the same checkpoint in the same mode
            assert_bit_equal(singles, [invariant.infer(o, noise=z).actions for o, z in zip(observations, noise)])
    finally:
        assert proc.stop() == 0, proc.log()


# ---- the fast path's kernels, under Triton's interpreter ---------------------------------------------------
# Triton's interpreter multiplies a tile with numpy's matmul, whose BLAS sums a row of the tile in an order that
# depends on the row's place in the tile; a GPU's MMA sums every row of a tile alike. The script below gives
# the interpreter a dot with that property (each output a sequential sum over K), so what it checks is what
# the launches control: which tiles, splits and key ranges each row's sums go through, at each batch size.
INTERPRETED = r'''
import json, sys
import numpy as np
import torch
from triton.runtime import interpreter

def row_independent_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    acc = d.data.dtype
    out = (a.data.astype(acc)[..., :, :, None] * b.data.astype(acc)[..., None, :, :]).sum(axis=-2)
    return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

interpreter.InterpreterBuilder.create_dot = row_independent_dot

from vlaserve.demo import random_model
from vlaserve.config import GemmaDims, ModelConfig, VisionDims
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.launch_tables import SM90
from vlaserve.runtime.fast.model import FastPi05

mode = sys.argv[1]
assert kernels.interpreted()
invariant = mode == "invariant"
table = SM90.batch_invariant_table() if invariant else SM90
gemma = GemmaDims(width=256, depth=1, mlp_dim=512, num_heads=2, num_kv_heads=1, head_dim=128, vocab_size=64)
cfg = ModelConfig(VisionDims(width=64, depth=1, mlp_dim=128, num_heads=2, head_dim=24, image_size=28), gemma, gemma)
model = random_model(cfg, torch.float16, "cpu", seed=1, std=0.05)
fast = FastPi05(model, launch_table=table, gemm_library="invariant" if invariant else "cublas",
               attention_library="invariant" if invariant else "triton")
assert fast.use_triton
cams, tokens, steps, horizon = 2, 8, 2, 50
torch.manual_seed(0)
n = 5
images = torch.rand(n, cams, 3, 28, 28) * 2 - 1
masks = torch.ones(n, cams, dtype=torch.bool)
masks[1, 1] = masks[3, 1] = False  # absent cameras in some items
tok = torch.randint(1, 64, (n, tokens))
tmask = torch.ones(n, tokens, dtype=torch.bool)
for i in range(n):
    tmask[i, 3 + i:] = False  # a prompt length per item
noise = torch.randn(n, horizon, 32)
plen = cams * 4 + tokens
cache = -(-(plen + horizon) // 64) * 64

def run(items):
    b = len(items)
    k = torch.zeros(1, b, cache, 128, dtype=torch.float16)
    v = torch.zeros_like(k)
    sched = fast.schedule(steps)
    with torch.no_grad():
        pad = fast.prefix(images[items], masks[items], tok[items], tmask[items], k, v, int(masks[items].any(0).sum()))
        return fast.denoise(pad, noise[items], sched, k, v, None).float()

batch = run([0, 1, 2, 3, 4])
if invariant:  # alone: an item with an absent camera, one in the middle, the last; and a batch of 2 reordered
    pair = run([4, 2])
    report = {"alone": [bool(torch.equal(run([i])[0], batch[i])) for i in (1, 2, 4)],
              "batch_of_2": [bool(torch.equal(pair[j], batch[i])) for j, i in enumerate((4, 2))]}
else:  # the served table: the first item that differs alone is enough
    report = {"alone": []}
    for i in range(n):
        report["alone"].append(bool(torch.equal(run([i])[0], batch[i])))
        if not report["alone"][-1]:
            break
print(json.dumps(report))
'''


def interpreted(mode: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    done = subprocess.run([sys.executable, "-c", INTERPRETED, mode], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_fast_path_kernels_are_batch_invariant_under_the_interpreter():
    # Batch 1 (one row tile of 50 action rows), 2 and 5 (250 rows: several row tiles; 5 images in SigLIP)
    # cross every regime of the served table: batched tiles, a cuBLAS expert from batch 4, other key splits,
    # the unfused action step. The invariant table keeps batch 1's: each item's bits at every size and place.
    report = interpreted("invariant")
    assert all(report["alone"]) and all(report["batch_of_2"]), report


@pytest.mark.slow
def test_the_served_table_is_not_batch_invariant_under_the_same_check():
    # The check above can fail: with the default table (other tiles and splits by row count, the unfused
    # action step from batch 2) the same items differ somewhere.
    report = interpreted("default")
    assert not all(report["alone"]), report
