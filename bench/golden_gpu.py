"""Every golden case of both families on the GPU, float32: the eager model (every recorded tensor) and
the fast path (the actions), plus the fast path's prefix-cache hit against its miss (Pi0's state token
is recomputed after a restore). One device call, seconds.

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


def main() -> None:
    out = {}
    for name in ("pi05_golden", "pi0_golden"):
        golden = fixture_dir(name)
        out[name] = {"cases": golden_check(golden), "prefix_cache_hit_equals_miss": cache_hit_equals_miss(golden)}
        log(name, json.dumps(out[name]))
    for d in filter(None, [ROOT / "bench" / "results", Path(os.environ["OUT"]) if os.environ.get("OUT") else None]):
        d.mkdir(parents=True, exist_ok=True)
        (d / "golden_gpu.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
