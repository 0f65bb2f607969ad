"""Every golden case of both families on the GPU, float32: the eager model (every recorded tensor) and
the fast path (the actions), plus the fast path's prefix-cache hit against its miss (Pi0's state token
is recomputed after a restore), two batches enqueued back to back against each run alone, and a
prompt bucket served from graphs captured at warm-up. One device call, seconds.

    python3 bench/golden_gpu.py [--out DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_gpu import golden_check, log  # noqa: E402
from fixtures import fixture_dir  # noqa: E402


def cache_hit_equals_miss(golden: Path) -> bool:
    from vlaserve import Policy
    from vlaserve.golden import GoldenCase, case_dirs

    policy = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="float32", progress=False,
                                    prefix_cache=4)
    case = GoldenCase.load(case_dirs(golden)[0])
    runs = [policy.infer_batch(case.observations(), noise=list(case.tensors["input.noise"]),
                               num_steps=case.meta["num_steps"]) for _ in range(2)]
    stats = policy.metadata["prefix_cache"]
    return stats["hits"] >= 1 and all(np.array_equal(a.actions, b.actions) for a, b in zip(*runs))


def overlapped_equals_serial(golden: Path) -> bool:
    """Two batches of one size enqueued back to back (the second's inputs copied into the graph's
    buffers while the first still runs), then waited for: bitwise the answers of running each alone."""
    from vlaserve import Policy
    from vlaserve.golden import GoldenCase, case_dirs

    policy = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="float32", progress=False)
    batches = []
    for case_dir in case_dirs(golden)[:2]:
        case = GoldenCase.load(case_dir)
        batches.append([policy.request(o, noise=n) for o, n in zip(case.observations(), case.tensors["input.noise"])])
    batches = [b[:1] for b in batches]  # one size, so both use the same static buffers and graphs
    serial = [policy.run(b) for b in batches]
    launched = [policy.launch(b) for b in batches]
    overlapped = [b.finish() for b in launched]
    return all(np.array_equal(x.actions, y.actions) for s, o in zip(serial, overlapped) for x, y in zip(s, o))


def prompt_buckets_captured(golden: Path) -> dict:
    """A prompt bucket served from CUDA graphs captured at warm-up (on views of the full-length
    buffers): no capture and no ungraphed call once ready, and the actions of the full-length prompt
    (float32: the same function over other GEMM shapes)."""
    from vlaserve import Policy
    from vlaserve.golden import GoldenCase, case_dirs

    case = GoldenCase.load(case_dirs(golden)[0])
    observations, noise = case.observations(), list(case.tensors["input.noise"])
    plain = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="float32", progress=False,
                                   prompt_buckets="none")
    longest = max(int(plain.prepare(o).token_mask.sum()) for o in observations)
    bucket = -(-(longest + 1) // 8) * 8
    bucketed = Policy.from_pretrained(golden / "checkpoint", device="cuda", dtype="float32", progress=False,
                                      prompt_buckets=(bucket,))
    captured = bucketed.metadata["graph_captures"]
    ours = bucketed.infer_batch(observations, noise=noise, num_steps=case.meta["num_steps"])
    theirs = plain.infer_batch(observations, noise=noise, num_steps=case.meta["num_steps"])
    meta = bucketed.metadata
    return {"bucket": bucket, "max_token_len": bucketed.config.max_token_len, "graphs_at_ready": captured,
            "graphs_without_buckets": plain.metadata["graph_captures"],
            "captures_after_ready": meta["graph_captures"] - captured, "uncaptured_calls": meta["uncaptured_calls"],
            "max_delta_vs_full_length": float(max(np.abs(a.actions - b.actions).max() for a, b in zip(ours, theirs)))}


def main() -> None:
    out = {}
    for name in ("pi05_golden", "pi0_golden"):
        golden = fixture_dir(name)
        out[name] = {"cases": golden_check(golden), "prefix_cache_hit_equals_miss": cache_hit_equals_miss(golden),
                     "overlapped_equals_serial": overlapped_equals_serial(golden),
                     "prompt_buckets": prompt_buckets_captured(golden)}
        log(name, json.dumps(out[name]))
    for d in filter(None, [ROOT / "bench" / "results", Path(os.environ["OUT"]) if os.environ.get("OUT") else None]):
        d.mkdir(parents=True, exist_ok=True)
        (d / "golden_gpu.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
