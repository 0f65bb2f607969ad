"""A lone robot's batch-1 request through Policy + Batcher (no server), host timestamps per stage.

    python bench/probes/lone_request_timeline.py CHECKPOINT [--calls 300] [--robot-ms 1.2]

Stages (p50 / p99 µs): loop prepare; loop -> launch thread; collate; Runtime.launch (inputs up, graph
replays, pinned copy back, event); launch return -> wait's synchronize returns minus device time;
postprocess; answer -> future done on the loop. Device: prefix_ms + denoise_ms by events; plus a GPU event
pair around the whole of Runtime.launch's work (H2D in, D2H out) to see the device-side extras.
"""
import asyncio, sys, time, json
import numpy as np, torch
sys.path.insert(0, "bench")
from common import robot_observation, golden_checkpoint
from vlaserve import Policy
from vlaserve.batcher import Batcher
import vlaserve.runtime.runner as runner_mod
import os
DEV = os.environ.get("DEV", "cuda")

ck = sys.argv[1] if sys.argv[1] != "golden" else golden_checkpoint()
calls = int(os.environ.get("CALLS", 300))
policy = Policy.from_pretrained(ck, device=DEV, max_batch_size=1, warmup="blocking", progress=False)
policy.runtime.limit_host_threads()
rt = policy.runtime
marks = {}
def mark(k): marks[k] = time.perf_counter()

orig_collate = policy.preprocessor.collate
def collate(reqs):
    mark("collate0"); r = orig_collate(reqs); mark("collate1"); return r
policy.preprocessor.collate = collate

orig_launch = rt.launch
gpu = {}
def launch(*a, **k):
    mark("rtlaunch0")
    if DEV == "cuda":
        e0 = torch.cuda.Event(enable_timing=True); e0.record()
    r = orig_launch(*a, **k)
    if DEV == "cuda":
        e1 = torch.cuda.Event(enable_timing=True); e1.record()
        gpu["pair"] = (e0, e1)
    mark("rtlaunch1"); return r
rt.launch = launch

orig_wait = runner_mod.Launched.wait
def wait(self):
    mark("wait0"); r = orig_wait(self); mark("wait1"); return r
runner_mod.Launched.wait = wait

orig_post = policy.preprocessor.postprocess
def post(*a):
    mark("post0"); r = orig_post(*a); mark("post1"); return r
policy.preprocessor.postprocess = post

def make_batcher(direct):
    batcher = Batcher(policy, max_batch_size=1, direct_launch=direct)
    orig_exec = batcher._execute
    def execute(batch):
        mark("exec0"); return orig_exec(batch)
    batcher._execute = execute
    return batcher

obs = robot_observation(0, policy.config.state_dim, policy.config.action_horizon, policy.config.model.max_action_dim)
rows = []

async def main(batcher):
    loop = asyncio.get_running_loop()
    for i in range(calls):
        t0 = time.perf_counter()
        request = policy.request(obs)
        policy.prepare(request)
        mark("prepared")
        fut = batcher.submit_many([request])[0]
        result = await fut
        t_done = time.perf_counter()
        tm = result.timings
        m = dict(marks)
        dev = tm["device_ms"] / 1e3
        rows.append({
            "prepare_loop": m["prepared"] - t0,
            "hop_to_launch": m["exec0"] - m["prepared"],
            "exec_to_collate": m["collate0"] - m["exec0"],
            "collate": m["collate1"] - m["collate0"],
            "collate_to_rtlaunch": m["rtlaunch0"] - m["collate1"],
            "runtime_launch": m["rtlaunch1"] - m["rtlaunch0"],
            "launch_ret_to_wait": m["wait0"] - m["rtlaunch1"],
            "wait_minus_device": (m["wait1"] - m["rtlaunch1"]) - dev,
            "wait_to_post": m["post0"] - m["wait1"],
            "post": m["post1"] - m["post0"],
            "answer_to_loop": t_done - m["post1"],
            "gpu_launch_pair_minus_device": gpu["pair"][0].elapsed_time(gpu["pair"][1]) / 1e3 - dev if gpu else 0.0,
            "device": dev,
            "total": t_done - t0,
        })
        await asyncio.sleep(0.0012)

result = {}
for rnd in range(2):
    for direct in (False, True):
        rows.clear()
        batcher = make_batcher(direct)
        asyncio.run(main(batcher))
        print("direct launches", batcher.direct_launches)
        batcher.close()
        keys = rows[0].keys()
        out = {k: (float(np.percentile([r[k] for r in rows[30:]], 50)) * 1e6, float(np.percentile([r[k] for r in rows[30:]], 99)) * 1e6) for k in keys}
        print(f"--- round {rnd} direct={direct}")
        for k, (p50, p99) in out.items():
            print(f"{k:32s} p50 {p50:9.1f} us   p99 {p99:9.1f} us")
        result[f"{rnd}_{direct}"] = out
json.dump(result, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/timeline.json", "w"), indent=1)
