"""Probe (issue 14): FlashAttention-3's forward (the `fa3-fwd` wheel) and FlashAttention-4's
against the attention we serve, on ALOHA-3's shapes (runs 123-124).

    python3 bench/flash_probe.py --library fa3|fa4 [--served] [--policy] [--out DIR]

FA4 on sm90 has no key splits (run 101), so it lost the expert's attention (50 queries a head).
FA3 has them (`num_splits`, with its own combine kernel), packs the 8 query heads of one K/V head
into one query axis (`pack_gqa`), takes head_dim 256, and masks the keys past `seqused_k`. The
wheel (`bash bench/prepare_fa3.sh`, 28 MB, built for torch 2.10 on torch's stable C ABI) is
carried as `.fa3/` and installed `--no-deps` on the device. FA4 (`flash-attn-4`, CuTe DSL) travels
in `.cute/` (`bash bench/prepare_cute.sh`); it has no key splits on sm90, so only its prefix and
SigLIP cases run.

Cases (8 query heads on one K/V head, head_dim 256, the 96-token bucket: 768 image + 96 prompt
tokens, 26 of them padding): the prefix's attention (864 queries a head, 838 valid keys) and the
expert's (50 queries a head, 888 valid of 914 keys), at batch 1, 2, 4 and 8. Ours reads the keys
in the cache's order with the key bias (the prompt's padding sits between the prompt and the
chunk); FA3 reads the same keys with the valid ones first, `seqused_k` long (a permutation of the
keys: the softmax sums over the same set). q is ours, head-major [B, 8 * queries, D], seen by FA3
through a strided view [B, queries, 8, D]; its output [B, queries, 8 * D] is token-major, the
layout o_proj reads. Each graph runs 18 layers' q/k/v in turn, so that K/V stream from HBM as in
a call; times are per layer, p50 of 20 replays. Errors: max|Δ| against fp32 math on the same bf16
inputs.

SigLIP's attention (16 heads of 72, 256 patches an image, 3 images a sample, no mask): the served
path (q/k/v permuted out of the fused projection, SDPA, the output transposed back for o_proj)
against the library on strided views of the projection, whose output is already o_proj's layout.
JSON: flash_probe_<library>.json.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from vlaserve.model.gemma import MASK_VALUE
from vlaserve.runtime.fast import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_gpu (the served parts: it needs .whl's packages)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


HEADS, D, IMAGE, BUCKET, PROMPT, CHUNK, LAYERS = 8, 256, 768, 96, 70, 50, 18


def graphed_us(fn, calls: int) -> float:
    """Per-call µs of fn captured in one CUDA graph: p50 of 20 replays."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[10] * 1e3 / calls


def reference(q, k, v, valid):
    """fp32 softmax(q k^T / sqrt(D) + mask) v; q [B, H, Q, D], k/v [B, T, D], valid [B, T] -> [B, Q, H * D]."""
    s = torch.einsum("bhqd,btd->bhqt", q.float(), k.float()) / math.sqrt(D)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqt,btd->bqhd", s.softmax(-1), v.float())
    return out.reshape(out.shape[0], out.shape[1], -1)


def library(name: str):
    """attend(q [B, Q, H, D], k/v [B, T, Hk, D], used [B] int32 or None, splits, pack) -> [B, Q, H, D]."""
    if name == "fa3":
        import fa3_fwd_interface as fa3

        def attend(q, k, v, used, splits=1, pack=None):
            return fa3._flash_attn_forward(q, k, v, seqused_k=used, softmax_scale=q.shape[-1]**-0.5,
                                           num_splits=splits, pack_gqa=pack)[0]
        return attend, {"config": __import__("fa3_fwd_config").CONFIG}
    from flash_attn.cute.interface import _flash_attn_fwd

    def attend(q, k, v, used, splits=1, pack=None):
        return _flash_attn_fwd(q, k, v, seqused_k=used, softmax_scale=q.shape[-1]**-0.5, num_splits=splits,
                               pack_gqa=pack)[0]
    return attend, {"version": importlib.metadata.version("flash-attn-4")}


def timed(entry: dict, run, ref, layers: int) -> None:
    """First call's seconds, max|Δ| vs ref, graphed µs a layer and repeat bits into entry (errors recorded)."""
    try:
        t0 = time.perf_counter()
        out = run(0)
        torch.cuda.synchronize()
        entry["first_call_s"] = time.perf_counter() - t0
        entry["vs_fp32"] = float((out.float() - ref).abs().max())
        entry["us"] = graphed_us(lambda: [run(i) for i in range(layers)], layers)
        entry["repeat_same_bits"] = bool(torch.equal(run(0), out))
    except Exception as exc:  # an unsupported combination: recorded, the probe goes on
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc()


def gemma_case(attend, name: str, b: int, queries: int, keys: int, expert: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + queries)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    qs = [torch.randn(b, HEADS * queries, D, **bf16) for _ in range(LAYERS)]
    ks = [torch.randn(b, keys, D, **bf16) for _ in range(LAYERS)]
    vs = [torch.randn(b, keys, D, **bf16) for _ in range(LAYERS)]
    valid = torch.zeros(b, keys, dtype=torch.bool, device="cuda")
    valid[:, :IMAGE + PROMPT] = True
    if expert:
        valid[:, keys - CHUNK:] = True
    valid_keys = int(valid[0].sum())
    bias = torch.where(valid, 0.0, MASK_VALUE).float()
    order = torch.cat([valid[0].nonzero().flatten(), (~valid[0]).nonzero().flatten()])
    fa_ks = [k[:, order].unsqueeze(2).contiguous() for k in ks]  # [B, T, 1, D], valid keys first
    fa_vs = [v[:, order].unsqueeze(2).contiguous() for v in vs]
    used = torch.full((b,), valid_keys, dtype=torch.int32, device="cuda")
    ref = reference(qs[0].view(b, HEADS, queries, D), ks[0], vs[0], valid)
    flop = 4 * b * HEADS * queries * valid_keys * D
    committed = kernels.attention_config(b) if expert else kernels.prefix_attention_config(b)
    row: dict = {"batch": b, "stage": "expert" if expert else "prefix", "queries": queries, "keys": keys,
                 "valid_keys": valid_keys, "flop": flop, "committed": committed, "ref_scale": float(ref.abs().max())}

    def ours(i):
        return kernels.mqa_attention(qs[i], ks[i], vs[i], bias, HEADS, queries, committed)

    row["ours_vs_fp32"] = float((ours(0).float() - ref).abs().max())
    row["ours_us"] = graphed_us(lambda: [ours(i) for i in range(LAYERS)], LAYERS)
    log(f"b{b} {row['stage']}: ours {row['ours_us']:.1f} us ({flop / row['ours_us'] / 1e6:.0f} TFLOP/s), "
        f"vs fp32 {row['ours_vs_fp32']:.2e}")
    row[name] = []
    splits_set = (1, 2, 3, 4, 6, 8, 12, 16, 0) if expert else (1,)
    for pack in (True, False):
        for splits in splits_set:
            entry: dict = {"num_splits": splits, "pack_gqa": pack}

            def run(i, splits=splits, pack=pack):
                q = qs[i].view(b, HEADS, queries, D).transpose(1, 2)  # [B, Q, H, D], strided
                return attend(q, fa_ks[i], fa_vs[i], used, splits, pack).view(b, queries, HEADS * D)
            timed(entry, run, ref, LAYERS)
            row[name].append(entry)
            log(f"  b{b} {row['stage']} {name} {entry}")
    return row


def siglip_case(attend, name: str, b: int) -> dict:
    """SigLIP So400m's attention on 3 b images: served (permute, SDPA, transpose back) against the library."""
    images, heads, hd, patches, layers = 3 * b, 16, 72, 256, 27
    g = torch.Generator(device="cuda").manual_seed(b)
    qkvs = [torch.randn(images * patches, 3 * heads * hd, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(layers)]

    def served(i):  # FastPi05._vision_attention
        q, k, v = qkvs[i].view(images, patches, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)
        return out.transpose(1, 2).reshape(images * patches, heads * hd)

    def lib(i):
        q, k, v = qkvs[i].view(images, patches, 3, heads, hd).unbind(2)  # [N, P, H, hd] strided views
        return attend(q, k, v, None).view(images * patches, heads * hd)

    q, k, v = qkvs[0].view(images, patches, 3, heads, hd).float().permute(2, 0, 3, 1, 4).unbind(0)
    ref = torch.softmax(q @ k.transpose(-1, -2) * hd**-0.5, -1) @ v
    ref = ref.transpose(1, 2).reshape(images * patches, heads * hd)
    flop = 4 * images * heads * patches * patches * hd
    row: dict = {"batch": b, "stage": "siglip", "images": images, "flop": flop}
    served_entry: dict = {}
    timed(served_entry, served, ref, layers)
    row["served"] = served_entry
    entry: dict = {}
    timed(entry, lib, ref, layers)
    row[name] = entry
    log(f"b{b} siglip: served {served_entry} {name} {entry}")
    return row


def full_size_runners():
    """A full-size random Pi0.5 (bf16), its fp32 copy, and a FastRunner for each attention library."""
    from vlaserve.checkpoint.weights import random_model
    from vlaserve.config import ModelConfig, PolicyConfig
    from vlaserve.runtime.fast.graphs import FastRunner

    cfg = ModelConfig.full_size()
    model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    model32 = copy.deepcopy(model).float()
    policy_config = PolicyConfig(cfg, ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"), 14, 14)
    return cfg, model, model32, {lib: FastRunner(model, policy_config, attention_library=lib)
                                 for lib in ("triton", "fa4")}


def served(results: dict, save) -> None:
    """`attention_library="fa4"` against the default on the served path (run 125): FastRunners in CUDA
    graphs on a full-size random Pi0.5, bench_gpu.py's ALOHA-3 inputs in the default 96-token bucket;
    p50 ms at batch 1, 2, 4, 8, the actions' distance between the two, and each one's distance from the
    fp32 eager model, also for a batch of 2 whose first item lacks its middle camera (its masked
    tokens then sit between valid ones in the token order; the cache holds the valid ones first)."""
    from bench_gpu import CAMERAS, STEPS, bucketed, default_bucket, eager, make_inputs, maxdiff, time_cuda

    cfg, model, model32, runners = full_size_runners()
    bucket = default_bucket()
    rows = results.setdefault("served", [])
    for b in (1, 2, 4, 8):
        inputs, noise = make_inputs(b, cfg.vlm.vocab_size)
        inputs = bucketed(inputs, bucket)
        row: dict = {"batch": b, "bucket": bucket}
        out = {}
        for lib, runner in runners.items():
            t0 = time.perf_counter()
            out[lib] = runner.sample(inputs, noise, STEPS, None, vision_slots=CAMERAS)[0]
            row[f"{lib}_first_call_s"] = time.perf_counter() - t0
            row[f"{lib}_repeat_same_bits"] = bool(torch.equal(runner.sample(inputs, noise, STEPS, None,
                                                                            vision_slots=CAMERAS)[0], out[lib]))
            row[f"{lib}_p50_ms"] = time_cuda(lambda: runner.sample(inputs, noise, STEPS, None,
                                                                   vision_slots=CAMERAS))["p50_ms"]
            stages = [runner.sample(inputs, noise, STEPS, None, vision_slots=CAMERAS)[1] for _ in range(10)]
            row[f"{lib}_prefix_ms"] = sorted(st["prefix_ms"] for st in stages)[5]
        row["fa4_vs_triton"] = maxdiff(out["fa4"], out["triton"])
        if b in (1, 8):
            ref32 = eager(model32, inputs, noise)
            for lib in runners:
                row[f"{lib}_vs_fp32"] = maxdiff(out[lib], ref32)
        rows.append(row)
        log(f"served {row}")
        save()
    inputs, noise = make_inputs(2, cfg.vlm.vocab_size, seed=1)
    inputs = bucketed(inputs, bucket)
    masks = inputs.image_masks.clone()
    masks[0, 1] = False
    inputs = dataclasses.replace(inputs, image_masks=masks)
    ref32 = eager(model32, inputs, noise)
    row = {"batch": 2, "case": "item 0 without its middle camera"}
    for lib, runner in runners.items():
        row[f"{lib}_vs_fp32"] = maxdiff(runner.sample(inputs, noise, STEPS, None, vision_slots=CAMERAS)[0], ref32)
    rows.append(row)
    log(f"served {row}")
    save()


def policy_check(results: dict, save) -> None:
    """The option as users pass it: the golden (tiny) checkpoint through Policy.from_pretrained(...,
    attention_library=...) in bf16 (its warm-up captures every graph), each case's observations (one
    lacks a camera) repeated to batch 1, 2 and 8: max|Δ| of the model-space actions between the two
    libraries and of each from the reference's fp32 actions."""
    import numpy as np

    from bench_gpu import GOLDEN

    from vlaserve import Policy
    from vlaserve.golden import GoldenCase, case_dirs

    golden = Path(GOLDEN)
    policies = {}
    out: dict = {}
    for lib in ("triton", "fa4"):
        t0 = time.perf_counter()
        policies[lib] = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="bfloat16",
                                               progress=False, attention_library=lib)
        out[f"{lib}_load_s"] = time.perf_counter() - t0
    for case_dir in case_dirs(golden):
        case = GoldenCase.load(case_dir)
        obs, noise = case.observations(), list(case.tensors["input.noise"])
        rtcs = case.rtcs() or [None] * len(obs)  # the rtc case's previous chunk (until run 130 it was left out)
        expected = case.tensors["expected.actions_model"]
        for b in (1, 2, 8):
            pick = [i % len(obs) for i in range(b)]
            batch, z, r = [obs[i] for i in pick], [noise[i % len(noise)] for i in range(b)], [rtcs[i] for i in pick]
            ref = np.stack([expected[i] for i in pick])
            acts = {lib: np.stack([res.model_actions for res in p.infer_batch(batch, noise=z, rtcs=r,
                                                                              num_steps=case.meta["num_steps"])])
                    for lib, p in policies.items()}
            row = {"fa4_vs_triton": float(np.abs(acts["fa4"] - acts["triton"]).max())}
            row.update({f"{lib}_vs_fp32_reference": float(np.abs(a - ref).max()) for lib, a in acts.items()})
            out[f"{case.name}_b{b}"] = row
    out["metadata_fa4"] = {k: v for k, v in policies["fa4"].metadata.items() if isinstance(v, (str, int, bool))}
    results["policy_check"] = out
    log(f"policy check: {json.dumps(out)}")
    save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", choices=("fa3", "fa4"), required=True)
    ap.add_argument("--served", action="store_true", help="fa4: full-size FastRunners against the default")
    ap.add_argument("--policy", action="store_true", help="fa4: the golden checkpoint through Policy, against the default")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    name = args.library
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__, "library": name, "cases": []}

    def save():
        for d in filter(None, [Path(__file__).resolve().parent / "results", Path(args.out) if args.out else None]):
            d.mkdir(parents=True, exist_ok=True)
            (d / f"flash_probe_{name}.json").write_text(json.dumps(results, indent=1, default=str))

    try:
        attend, results["library_info"] = library(name)
    except Exception as exc:
        results["import_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        save()
        return
    if args.policy:
        policy_check(results, save)
    if args.served:
        served(results, save)
    if args.policy or args.served:
        return
    for b in (1, 2, 4, 8):
        results["cases"].append(siglip_case(attend, name, b))
        save()
        results["cases"].append(gemma_case(attend, name, b, IMAGE + BUCKET, IMAGE + BUCKET, expert=False))
        save()
        if name == "fa3":  # FA4 has no key splits on sm90: run 101 timed it slower on the expert
            results["cases"].append(gemma_case(attend, name, b, CHUNK, IMAGE + BUCKET + CHUNK, expert=True))
            save()


if __name__ == "__main__":
    main()
