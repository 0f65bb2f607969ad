"""Probe (issue 45): the fp8 fast path's served actions and call times at batch 1, 2, 4, 8, saved or compared
with a file another tree saved (an A/B of two trees, one process each).

python3 bench/probes/fp8_calls.py --save before.pt      (in the old tree)
python3 bench/probes/fp8_calls.py --compare before.pt   (in the new one)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import CAMERAS, bucketed, served_call, stage_medians  # noqa: E402
from common import bench_model, log, make_inputs, sample, time_ms  # noqa: E402

from vlaserve.model.fp8 import convert_to_fp8  # noqa: E402
from vlaserve.runtime.fast.graphs import FastRunner  # noqa: E402

BUCKET = 96


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--compare")
    args = ap.parse_args()
    model, cfg = bench_model(False, "cuda")
    convert_to_fp8(model)
    engine = FastRunner(model, cfg)
    now = {"actions": {}, "p50_ms": {}, "stages": {}}
    for b in (1, 2, 4, 8):
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        short = bucketed(inputs, BUCKET)
        now["actions"][b] = sample(engine, short, noise, vision_slots=CAMERAS)[0].cpu()
        now["p50_ms"][b] = time_ms(lambda: served_call(engine, short, noise), "cuda", warmup=3, iters=30)["p50_ms"]
        now["stages"][b] = stage_medians(engine, short, noise)
    for b in (1, 8):  # again: the drift within the process
        inputs, noise = make_inputs(b, model.config.vlm.vocab_size, seed=b)
        short = bucketed(inputs, BUCKET)
        now["p50_ms"][f"{b} again"] = time_ms(lambda: served_call(engine, short, noise), "cuda", warmup=3,
                                              iters=30)["p50_ms"]
    log("p50 ms", json.dumps(now["p50_ms"]), "stages", json.dumps(now["stages"]))
    if args.save:
        torch.save(now, args.save)
    if args.compare:
        before = torch.load(args.compare)
        log("vs", args.compare, json.dumps({b: {"bit_identical": bool(torch.equal(a, before["actions"][b])),
                                                "p50_before": before["p50_ms"][b], "p50_now": now["p50_ms"][b]}
                                            for b, a in now["actions"].items()}),
            "again before", json.dumps({k: v for k, v in before["p50_ms"].items() if isinstance(k, str)}))


if __name__ == "__main__":
    main()
