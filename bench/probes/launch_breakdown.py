"""Probe (issue 44): where a lone batch-1 call's host time goes before the prefix starts, and the served actions
of this tree, to compare bit for bit with another's (one process, full-size random checkpoint, graphs captured
first as the server does).

    python bench/probes/launch_breakdown.py CHECKPOINT OUT.json [--calls 200] [--compare OTHER_actions.pt]

Writes OUT.json (p50 / p99 µs of each step) and OUT_actions.pt (robots 0-7 alone at batch 1 and together at
batch 8, without and with RTC). Marks: `Runtime.launch` on the host; inside it the runner's `into_buffers`, the
prefix graph's launch, the Euler steps' graph's launch; on the device, from an event recorded as
`Runtime.launch` begins to the prefix's start event (the device idle before the prefix: the inputs' copies).
"""
import argparse
import json
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "bench")
from common import robot_observation  # noqa: E402

import vlaserve.runtime.fast.graphs as graphs_mod  # noqa: E402
from vlaserve import Policy  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("checkpoint")
ap.add_argument("out")
ap.add_argument("--calls", type=int, default=200)
ap.add_argument("--compare")
args = ap.parse_args()

policy = Policy.from_pretrained(args.checkpoint, device="cuda", max_batch_size=8, warmup="blocking", progress=False)
policy.runtime.limit_host_threads()
config = policy.config
observations = [robot_observation(r, config.state_dim, config.action_horizon, config.model.max_action_dim)
                for r in range(8)]
RTC = {"prev_chunk": np.random.default_rng(0).uniform(-1, 1, (40, 32)).astype(np.float32), "space": "model",
       "inference_delay": 3, "execution_horizon": 10}


def served(rtc):
    alone = [policy.run([policy.request(o, rtc=rtc)])[0].model_actions for o in observations]
    together = [r.model_actions for r in policy.run([policy.request(o, rtc=rtc) for o in observations])]
    return torch.from_numpy(np.stack(alone)), torch.from_numpy(np.stack(together))


actions = {"plain": served(None), "rtc": served(RTC)}
torch.save(actions, args.out.replace(".json", "_actions.pt"))
report = {"alone_equals_together": {k: bool(torch.equal(a, t)) for k, (a, t) in actions.items()},
          "bytes_in_sizes": sorted(getattr(policy.runtime.runner, "_bytes_in", {}))}
if args.compare:
    other = torch.load(args.compare)
    report["bit_identical_to_other"] = {k: [bool(torch.equal(a, b)) for a, b in zip(actions[k], other[k])]
                                        for k in actions}
print(json.dumps(report))

runner, runtime = policy.runtime.runner, policy.runtime
marks = {}


def wrap(owner, name, key):
    original = getattr(owner, name)

    def timed(*a, **k):
        marks[key + "0"] = time.perf_counter()
        result = original(*a, **k)
        marks[key + "1"] = time.perf_counter()
        return result

    setattr(owner, name, timed)


wrap(graphs_mod, "into_buffers", "into")
wrap(runner, "_prefix", "prefix")
wrap(runner, "_denoise", "denoise")
wrap(runtime, "launch", "rt")
original_launch = runtime.launch
device = {}


def launch_with_event(*a, **k):
    first = torch.cuda.Event(enable_timing=True)
    first.record()
    result = original_launch(*a, **k)
    device["events"] = (first, result._stages)
    return result


runtime.launch = launch_with_event
for rtc in (None, RTC):
    rows = []
    for i in range(args.calls):
        request = policy.request(observations[0], rtc=rtc)
        policy.prepare(request)
        time.sleep(0.015)  # the device idle, as between a lone robot's calls
        policy.launch([request]).finish()
        first, stages = device["events"]
        m = marks
        rows.append({
            "rt_launch": m["rt1"] - m["rt0"],
            "before_into_buffers": m["into0"] - m["rt0"],
            "into_buffers": m["into1"] - m["into0"],
            "into_to_prefix_launch": m["prefix0"] - m["into1"],
            "prefix_graph_launch": m["prefix1"] - m["prefix0"],
            "prefix_to_denoise_launch": m["denoise0"] - m["prefix1"],
            "denoise_graph_launch": m["denoise1"] - m["denoise0"],
            "after_denoise": m["rt1"] - m["denoise1"],
            "device_idle_before_prefix": first.elapsed_time(stages.start) / 1e3,
            "device_prefix": stages.start.elapsed_time(stages.mid) / 1e3,
            "device_denoise": stages.mid.elapsed_time(stages.end) / 1e3,
        })
    name = "rtc" if rtc else "plain"
    report[name] = {k: [round(float(np.percentile([r[k] for r in rows[20:]], q)) * 1e6, 1) for q in (50, 99)]
                    for k in rows[0]}
    for k, (p50, p99) in report[name].items():
        print(f"{name:5s} {k:28s} p50 {p50:9.1f} us  p99 {p99:9.1f} us")
json.dump(report, open(args.out, "w"), indent=1)
