"""Real-time chunking on the robot side: a toy robot at 50 Hz against `vlaserve serve` on the CPU.

Starts `vlaserve serve` on the golden checkpoint (or the demo), puts a websocket relay in front of it
that delays every frame (network) and every reply (a slower model), and runs one toy robot loop per
mode, each for the same number of ticks:

  sync        the OpenPI ActionChunkBroker pattern: run `execution_horizon` actions, then block on a
              request for the next chunk (the loop stops while it waits);
  async       ActionChunkExecutor, rtc=False: the next chunk is fetched while the old one runs,
              switched to at the index of the current tick;
  async+rtc   ActionChunkExecutor with RTC guidance (prev_chunk, inference_delay from the round trip).

The toy robot is position controlled: its state is the last action it was sent (the first
state_dim joints), so every chunk is computed from where the robot really is.

Smooth chunks. The golden checkpoint (and the demo) has random weights: with the server's i.i.d.
flow noise its chunks are white noise in time (mean step max_j |a_t - a_{t-1}| 3.2, as large as the
difference between two samples), so no switch could look different from any other tick. A trained
policy's chunks are smooth in time and still differ from one sample to the next, the case RTC is
for. The toy robot gets that structure by sending with each observation flow noise that is a random
walk over the chunk's steps, a fresh draw per request (`noise` in the observation): chunks then step
~0.4 per tick while two draws differ by ~4.4. Reports, per mode:
the jump max_j |a_t - a_{t-1}| at chunk switches and inside chunks, ticks missed (the loop more
than one period late), ticks starved (no planned action), get_action times, and the fraction of
wall time the loop spent waiting for the network. Writes bench_rtc[_LABEL].json and a PNG of one
joint across three switches; --smoke runs 150 ticks per mode.

    python bench/bench_rtc.py [--checkpoint DIR|demo] [--ticks 600] [--hz 50] [--horizon 25]
                              [--network-delay-ms 20] [--jitter-ms 10] [--model-delay-ms 0]
                              [--label L] [--out DIR]
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import (free_port, golden_checkpoint, parser, pyplot, save_json, save_png, start_server, stop_server,
                    wait_until_healthy)
from vlaserve_client import ActionChunkExecutor, Client

MODES = ("sync", "async", "async+rtc")


class DelayRelay:
    """ws://127.0.0.1:PORT/path -> upstream/path, each frame delayed by `network` s (+ uniform jitter)
    per direction, replies by `model` s more. Frames keep their order (like TCP)."""

    def __init__(self, upstream_port: int, network: float, jitter: float, model: float):
        self.upstream, self.network, self.jitter, self.model = upstream_port, network, jitter, model
        self.port = free_port()
        ready = threading.Event()
        threading.Thread(target=lambda: asyncio.run(self._serve(ready)), daemon=True).start()
        ready.wait(10)

    async def _serve(self, ready):
        from websockets.asyncio.client import connect
        from websockets.asyncio.server import serve

        async def pump(source, sink, extra: float, skip_first_extra: bool):
            due, first = 0.0, skip_first_extra
            queue: asyncio.Queue = asyncio.Queue()

            async def send():
                while True:
                    when, frame = await queue.get()
                    await asyncio.sleep(max(0.0, when - time.monotonic()))
                    await sink.send(frame)
            sender = asyncio.create_task(send())
            try:
                async for frame in source:
                    delay = self.network + random.uniform(0, self.jitter) + (0.0 if first else extra)
                    first = False  # the metadata frame is not a model answer
                    due = max(due, time.monotonic() + delay)
                    queue.put_nowait((due, frame))
            finally:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                sender.cancel()

        async def handle(ws):
            async with connect(f"ws://127.0.0.1:{self.upstream}{ws.request.path}", max_size=None,
                               compression=None) as up:
                await asyncio.gather(pump(ws, up, 0.0, False), pump(up, ws, self.model, True),
                                     return_exceptions=True)

        async with serve(handle, "127.0.0.1", self.port, max_size=None, compression=None):
            ready.set()
            await asyncio.Future()


# ---- the toy robot --------------------------------------------------------------------------------
class ToyRobot:
    def __init__(self, metadata: dict, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.state_dim = metadata["state_dim"]
        self.horizon, self.noise_dim = metadata["action_horizon"], metadata["max_action_dim"]
        self.images = {cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in metadata["cameras"]}
        self.position = np.zeros(metadata["action_dim"], np.float32)

    def observation(self) -> dict:
        return {"images": self.images, "state": self.position[: self.state_dim].copy(), "task": "pick up the block",
                "noise": self.smooth_noise()}

    def smooth_noise(self) -> np.ndarray:
        """Flow noise [horizon, max_action_dim] that drifts slowly over the steps (see the docstring)."""
        steps = self.rng.standard_normal((self.horizon, self.noise_dim))
        walk = 0.2 * np.cumsum(steps, axis=0)
        return (walk - walk.mean(axis=0) + self.rng.standard_normal(self.noise_dim)).astype(np.float32)

    def apply(self, action: np.ndarray) -> None:
        self.position = np.asarray(action, np.float32)


def run_mode(mode: str, url: str, args) -> dict:
    client = Client(url, timeout=30)
    metadata = client.metadata()
    robot = ToyRobot(metadata)
    period = 1.0 / args.hz
    actions, switch_ticks, call_s = [], set(), []
    missed = 0
    waited = 0.0
    executor = None
    if mode == "sync":
        chunk, index = client.infer(robot.observation()).actions, 0
    else:
        executor = ActionChunkExecutor(client, control_hz=args.hz, execution_horizon=args.horizon,
                                       rtc=mode == "async+rtc")
        executor.start(robot.observation())
    started = next_tick = time.perf_counter()
    for tick in range(args.ticks):
        t0 = time.perf_counter()
        if mode == "sync":
            if index == args.horizon:  # ActionChunkBroker: the loop waits for the next chunk
                chunk, index = client.infer(robot.observation()).actions, 0
                waited += time.perf_counter() - t0
                switch_ticks.add(tick)
            action = chunk[index]  # the robot.observation callable draws fresh noise per request
            index += 1
        else:
            action = executor.get_action(robot.observation)
        call_s.append(time.perf_counter() - t0)
        robot.apply(action)
        actions.append(action.copy())
        next_tick += period
        behind = time.perf_counter() - next_tick
        if behind > period:  # whole periods went by without a command: missed; restart the schedule
            missed += int(behind / period)
            next_tick = time.perf_counter()
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    wall = time.perf_counter() - started
    stats = None
    if executor is not None:
        executor.close()
        stats = executor.stats
        switch_ticks = {e.tick for e in executor.events if e.kind == "switch"}
        events = [{"tick": e.tick, "kind": e.kind, **e.detail} for e in executor.events]
    else:
        client.close()
        events = []
    return summarize(mode, np.array(actions), sorted(switch_ticks), call_s, missed, waited, wall, period,
                     stats, events, args.joint)


def summarize(mode, actions, switch_ticks, call_s, missed, waited, wall, period, stats, events, joint) -> dict:
    jumps = np.abs(np.diff(actions, axis=0)).max(axis=1)  # jumps[t-1] = max_j |a_t - a_{t-1}|
    at_switch = np.array([jumps[t - 1] for t in switch_ticks if t >= 1])
    inside = np.delete(jumps, [t - 1 for t in switch_ticks if t >= 1])
    calls_ms = np.array(call_s) * 1e3
    out = {
        "mode": mode,
        "ticks": len(actions),
        "switches": len(at_switch),
        "jump_at_switch": {"mean": float(at_switch.mean()), "median": float(np.median(at_switch)),
                           "max": float(at_switch.max())},
        "jump_inside_chunk": {"mean": float(inside.mean()), "p99": float(np.quantile(inside, 0.99)),
                              "max": float(inside.max())},
        "missed_ticks": missed,
        "get_action_ms": {"p50": float(np.median(calls_ms)), "p99": float(np.quantile(calls_ms, 0.99)),
                          "max": float(calls_ms.max())},
        "ticks_blocked_on_network": int((calls_ms > period * 1e3 / 2).sum()),
        "fraction_of_time_waiting": waited / wall,
        "trajectory": actions[:, joint].round(5).tolist(),  # the plotted joint only: keeps the JSON small
        "switch_ticks": switch_ticks,
    }
    if stats is not None:
        out["executor"] = stats.__dict__
        out["events"] = events
    return out


def plot(results: dict, joint: int, out: str, name: str, hz: float, horizon: int) -> None:
    """Joint `joint` around the first three switches after the start, without and with RTC."""
    plt = pyplot()

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharey=True, layout="constrained")
    for ax, mode in zip(axes, ("async", "async+rtc")):
        r = results[mode]
        switches = [t for t in r["switch_ticks"] if t > 20][:3]
        lo, hi = switches[0] - 15, switches[-1] + 15
        traj = np.array(r["trajectory"])[lo:hi]
        ticks = np.arange(lo, hi)
        ax.plot(ticks / hz, traj, ".-", lw=1, ms=3)
        for t in switches:
            ax.axvline(t / hz, color="tab:red", ls="--", lw=1)
        for e in r.get("events", []):  # where the previous plan (the guided prefix) ended
            end = e["tick"] - e["index"] + horizon if e["kind"] == "switch" else None
            if end is not None and lo <= end < hi:
                ax.axvline(end / hz, color="gray", ls=":", lw=1)
        jump = r["jump_at_switch"]["mean"]
        title = "with RTC" if mode == "async+rtc" else "without RTC (plain switching)"
        ax.set_title(f"{title}: mean jump at switches {jump:.3f}, inside chunks {r['jump_inside_chunk']['mean']:.3f}")
        ax.set_ylabel(f"joint {joint}")
    axes[-1].set_xlabel("time (s); dashed red: chunk switches; dotted gray: end of the previous chunk's remainder")
    save_png(fig, out, name)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir, or 'demo' (default: the golden checkpoint)")
    ap.add_argument("--ticks", type=int, default=600)
    ap.add_argument("--hz", type=float, default=50.0)
    ap.add_argument("--horizon", type=int, default=25, help="execution_horizon (sync: actions run per chunk)")
    ap.add_argument("--network-delay-ms", type=float, default=20.0, help="one way, each frame")
    ap.add_argument("--jitter-ms", type=float, default=10.0)
    ap.add_argument("--model-delay-ms", type=float, default=0.0, help="added to every reply")
    ap.add_argument("--joint", type=int, default=0)
    ap.add_argument("--label", default="", help="suffix of the output files: bench_rtc_LABEL.json")
    args = ap.parse_args()
    if args.smoke:
        args.ticks = min(args.ticks, 150)

    checkpoint = args.checkpoint or str(golden_checkpoint())
    log_path = Path(tempfile.mkdtemp(prefix="bench_rtc-")) / "server.log"
    server, port = start_server("serve", None if checkpoint == "demo" else Path(checkpoint),
                                ["--device", "cpu", "--dtype", "float32"], log_path)
    try:
        wait_until_healthy(server, port, log_path)
        relay = DelayRelay(port, args.network_delay_ms / 1e3, args.jitter_ms / 1e3, args.model_delay_ms / 1e3)
        url = f"ws://127.0.0.1:{relay.port}"
        Client(url).infer(ToyRobot(Client(url).metadata()).observation())  # warm the server up
        results = {}
        for mode in MODES:
            results[mode] = run_mode(mode, url, args)
            r = results[mode]
            print(f"{mode:10s} switches {r['switches']:3d}  jump at switch mean {r['jump_at_switch']['mean']:.4f} "
                  f"max {r['jump_at_switch']['max']:.4f} | inside mean {r['jump_inside_chunk']['mean']:.4f} "
                  f"p99 {r['jump_inside_chunk']['p99']:.4f} | missed {r['missed_ticks']} "
                  f"blocked {r['ticks_blocked_on_network']} waiting {r['fraction_of_time_waiting']:.1%} "
                  f"get_action p99 {r['get_action_ms']['p99']:.3f} ms"
                  + (f" | starved {r['executor']['underrun_ticks']} delay {r['executor']['inference_delay']} "
                     f"rtt max {r['executor']['max_round_trip_ms']:.0f} ms" if "executor" in r else ""),
                  flush=True)
    finally:
        stop_server(server, log_path)
    ratio = results["async+rtc"]["jump_at_switch"]["mean"] / results["async"]["jump_at_switch"]["mean"]
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "checkpoint": checkpoint,
              "smoke": args.smoke, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
              "settings": vars(args), "rtc_over_plain_jump_at_switch": ratio, "modes": results}
    name = "bench_rtc" + (f"_{args.label}" if args.label else "")
    path = save_json(report, args.out, name)
    plot(results, args.joint, args.out, name, args.hz, args.horizon)
    print(f"RTC / plain mean jump at switches: {ratio:.3f}; wrote {path} and .png")


if __name__ == "__main__":
    main()
