"""Probe (issue 43): does the weight load slow down beside a thread that launches small CUDA work (as the
capture thread's warm-ups do), and does the load by ranges (`load_weights`: each file read in ranges, staged
once a range) suffer less than 34320c0's load a tensor at a time?

    python3 bench/probes/load_chunks.py --checkpoint DIR [--rounds 3]

Page cache warm (the files read once first). Prints the seconds of each (loader, neighbour) pair per round and
checks the two loaders give the same parameters bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src")]

from safetensors import safe_open  # noqa: E402

from vlaserve.checkpoint.weights import StagedCopy, check_weights, load_weights, materialize  # noqa: E402
from vlaserve.family import family_of, load_policy_config  # noqa: E402

def load_per_tensor(model, sources, dtype, device, layout):
    """34320c0's CUDA load: a tensor at a time from safetensors' mmap, each through StagedCopy on its own."""
    params = dict(model.named_parameters())
    copy = StagedCopy(device)
    by_file = {}
    for ours, (path, key) in sources.items():
        by_file.setdefault(path, []).append((ours, key))
    for path, items in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for ours, key in items:
                copy(f.get_tensor(key), layout.param_dtype(ours, dtype), into=params[ours].data)
    copy.finish()


def busy_launcher(stop: threading.Event, counter: list) -> None:
    x = torch.zeros(1024, device="cuda")
    while not stop.is_set():
        for _ in range(50):
            x.add_(1.0)
            counter[0] += 1
        torch.cuda.current_stream().synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    directory = Path(args.checkpoint)
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(64 * 2**20):
                pass
    config = load_policy_config(directory)
    family = family_of(config)
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = family.build_model(config).eval()
    sources = check_weights(model, directory, family.weights)
    materialize(model, dtype, device, family.weights)
    reference = None
    results = []
    for r in range(args.rounds):
        for loader in ("per_tensor", "by_ranges"):
            for neighbour in ("none", "launcher"):
                for p in model.parameters():
                    p.data.zero_()
                torch.cuda.synchronize()
                stop, counter = threading.Event(), [0]
                thread = threading.Thread(target=busy_launcher, args=(stop, counter)) if neighbour != "none" else None
                if thread:
                    thread.start()
                    time.sleep(0.2)
                t0 = time.perf_counter()
                if loader == "per_tensor":
                    load_per_tensor(model, sources, dtype, device, family.weights)
                else:
                    load_weights(model, directory, dtype, device, progress=False, layout=family.weights, sources=sources)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                if thread:
                    stop.set()
                    thread.join()
                if reference is None:
                    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
                same = all(torch.equal(p.detach(), reference[n]) for n, p in model.named_parameters())
                results.append({"round": r, "loader": loader, "neighbour": neighbour, "s": round(seconds, 3),
                                "neighbour_ops": counter[0], "same_as_first": same})
                print(json.dumps(results[-1]), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "load_chunks.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
