"""bench_fleet.py --chaos: robots at their control rate (ActionChunkExecutor, the realtime websocket)
while the server is SIGKILLed, restarted on the same port, then stopped with SIGTERM.

What it records, as the robots and the process table see it:
- each robot's longest gap without fresh actions (between two chunks it switched to, at tick granularity),
- the restart time (kill -> /healthz 200) and each robot's first fresh chunk in use after that (at tick
  granularity; and when its first request after the outage left: the robot's own share, the rest is
  the server's round trip),
- every request's observation age when it was sent (read -> handed to the socket), and how many
  observations read before the server was back were sent after it (must be none),
- the server's descendant processes still alive after the kill and after the SIGTERM exit,
- how long each executor.close() took with the server gone, and whether its worker thread ended.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from common import log

from vlaserve_client import ActionChunkExecutor, Client

HEALTH_POLL_S = 0.02  # how finely the restart's ready moment is found (the ready time is late by at most this)


class RecordingClient(Client):
    """A Client that notes, per request, when the observation was read and when it was sent and answered."""

    def __init__(self, url: str, robot: Robot, **settings):
        super().__init__(url, **settings)
        self.robot = robot
        self.sends: list[tuple[float, float, float | None]] = []  # (read, sent, answered or None)

    def infer(self, observation, **kwargs):
        read, sent = self.robot.last_read, time.monotonic()
        try:
            reply = super().infer(observation, **kwargs)
        except Exception:
            self.sends.append((read, sent, None))
            raise
        self.sends.append((read, sent, time.monotonic()))
        return reply


class Robot:
    """One robot: an executor fed at `hz` from its own thread, noting when a new chunk came into use."""

    def __init__(self, index: int, url: str, hz: float, metadata: dict):
        self.index, self.hz = index, hz
        rng = np.random.default_rng(index)
        size = metadata["input"].get("image_size") or [224, 224]
        self.observation = {
            "images": {cam: rng.integers(0, 256, (*size[:2], 3), dtype=np.uint8) for cam in metadata["input"]["image_keys"]},
            "state": rng.uniform(-1, 1, metadata["input"]["state_dim"]).astype(np.float32),
            "task": f"robot {index}: pick up the red block"}
        self.last_read = time.monotonic()
        # A loaded CPU server can take longer than the default 10 s for a first batch of cold robots.
        self.client = RecordingClient(url, self, timeout=60.0)
        self.executor = ActionChunkExecutor(self.client, control_hz=hz)
        self.installs: list[float] = []  # when a new chunk was first served
        self.tick_late_s: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"robot-{index}", daemon=True)

    def read(self) -> dict:
        self.last_read = time.monotonic()
        return self.observation

    def start(self) -> None:
        self.executor.start(self.read)  # read when the first request goes out, after the connect
        self.installs.append(time.monotonic())
        self.thread.start()

    def _loop(self) -> None:
        period, chunks = 1.0 / self.hz, 1
        next_tick = time.monotonic()
        while not self.stop.is_set():
            self.executor.get_action(self.read)
            now = time.monotonic()
            if self.executor.stats.chunks != chunks:
                chunks = self.executor.stats.chunks
                self.installs.append(now)
            self.tick_late_s.append(now - next_tick)
            next_tick += period
            time.sleep(max(0.0, next_tick - time.monotonic()))


def descendants(pid: int) -> set[int]:
    """The processes below `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie has exited: it only waits to be reaped)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(pid)
    return out


def wait_gone(pids: set[int], since: float, bound_s: float = 10.0) -> dict:
    """Polls until none of `pids` runs: how many there were, how long after `since` the last went."""
    while alive(pids) and time.monotonic() - since < bound_s:
        time.sleep(0.02)
    left = alive(pids)
    return {"processes": len(pids), "left": len(left), "gone_after_s": None if left else time.monotonic() - since}


def wait_ready(proc, port: int, bound_s: float = 600) -> float:
    """Polls /healthz every HEALTH_POLL_S: the monotonic time it first answered 200."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the restarted server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return time.monotonic()
        except OSError:
            time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"not healthy within {bound_s} s")


def run_chaos(start, port: int, robots: int, hz: float, seconds: float) -> dict:
    """`start()` starts the server on `port` (a Popen); robots run `seconds` before the kill and after
    every robot is back, then the server gets SIGTERM and the executors are closed."""
    server = start()
    wait_ready(server, port)
    url = f"ws://127.0.0.1:{port}"
    with Client(url) as probe:
        metadata = probe.metadata()
    fleet = [Robot(i, url, hz, metadata) for i in range(robots)]
    for robot in fleet:
        robot.start()
    time.sleep(seconds)

    pids = descendants(server.pid)
    killed = time.monotonic()
    server.send_signal(signal.SIGKILL)
    server.wait()
    after_kill = wait_gone(pids, killed)
    log("SIGKILL: leftover processes", after_kill)
    server = start()
    ready = wait_ready(server, port)
    log(f"restarted: ready {ready - killed:.2f} s after the kill")
    deadline = ready + 60  # until every robot has a reply to a request sent after the outage
    while (not all(any(t is not None and read >= killed for read, _, t in r.client.sends) for r in fleet)
           and time.monotonic() < deadline):
        time.sleep(0.01)
    time.sleep(seconds)

    pids = descendants(server.pid)
    server.send_signal(signal.SIGTERM)
    exit_code = server.wait(timeout=120)
    exited = time.monotonic()
    after_term = wait_gone(pids, exited)
    closes = []
    for robot in fleet:
        robot.stop.set()
        robot.thread.join()
        started = time.monotonic()
        robot.executor.close()
        closes.append({"close_s": time.monotonic() - started, "worker_alive": robot.executor._worker.is_alive()})
    return summarize(fleet, hz, killed, ready, after_kill, after_term, exit_code, closes)


def summarize(fleet, hz, killed, ready, after_kill, after_term, exit_code, closes) -> dict:
    period = 1.0 / hz
    per_robot = []
    for robot in fleet:
        gaps = np.diff(robot.installs)
        # The first request after the outage (the restarted server may take it before /healthz says ready:
        # then the robot's share is 0), and the first chunk after ready that came into use.
        first_send = min((sent for read, sent, _ in robot.client.sends if read >= killed), default=None)
        fresh = [t for t in robot.installs if t >= ready]
        answered = [t for read, sent, t in robot.client.sends if t is not None and read >= killed]
        after_outage = [(read, sent) for read, sent, _ in robot.client.sends if sent >= killed]
        stats = robot.executor.stats
        per_robot.append({
            "max_gap_s": float(gaps.max()) if len(gaps) else None,
            "first_fresh_chunk_after_ready_s": min(fresh) - ready if fresh else None,
            # answered, used or not (a reply past max_staleness_s is dropped: the server's round trip was too long)
            "first_reply_after_ready_s": max(0.0, min(answered) - ready) if answered else None,
            # the robot's own share of that: found the server and sent a fresh observation
            "first_fresh_send_after_ready_s": max(0.0, first_send - ready) if first_send is not None else None,
            "sent_after_kill": len(after_outage),
            "read_before_ready_sent_after": sum(1 for read, sent in after_outage if read < ready <= sent),
            "max_send_age_ms": max(((sent - read) * 1e3 for read, sent, _ in robot.client.sends), default=None),
            "sends_older_than_a_tick": sum(1 for read, sent, _ in robot.client.sends if sent - read > period),
            "tick_late_p99_ms": float(np.percentile(robot.tick_late_s, 99) * 1e3),
            "stats": {k: getattr(stats, k) for k in ("ticks", "chunks", "requests", "stale_dropped", "connection_failures",
                                                       "reconnects", "outage_ticks", "underrun_ticks")}})
    never = float("inf")  # a robot that never got a (fresh) chunk: its gap is unbounded
    gaps = [never if r["max_gap_s"] is None else r["max_gap_s"] for r in per_robot]
    fresh = [never if r["first_fresh_chunk_after_ready_s"] is None else r["first_fresh_chunk_after_ready_s"]
             for r in per_robot]
    sends = [never if r["first_fresh_send_after_ready_s"] is None else r["first_fresh_send_after_ready_s"]
             for r in per_robot]
    result = {
        "robots": len(fleet), "hz": hz, "restart_s": ready - killed,
        "gap_without_fresh_actions_s": {"p50": statistics.median(gaps), "max": max(gaps)},
        "fresh_chunk_after_ready_s": {"p50": statistics.median(fresh), "max": max(fresh)},
        "fresh_send_after_ready_s": {"p50": statistics.median(sends), "max": max(sends)},
        "after_sigkill": after_kill, "after_sigterm": {**after_term, "exit_code": exit_code},
        "close_s_max": max(c["close_s"] for c in closes), "workers_alive_after_close": sum(c["worker_alive"] for c in closes),
        "per_robot": per_robot, "timeline": {"killed": 0.0, "ready": ready - killed,
                                              "installs": [[t - killed for t in r.installs] for r in fleet]}}
    log(f"chaos: {len(fleet)} robots at {hz:g} Hz: restart {result['restart_s']:.2f} s, gap without fresh actions "
        f"p50 {result['gap_without_fresh_actions_s']['p50']:.2f} max {result['gap_without_fresh_actions_s']['max']:.2f} s, "
        f"fresh chunk after ready p50 {result['fresh_chunk_after_ready_s']['p50']:.2f} max "
        f"{result['fresh_chunk_after_ready_s']['max']:.2f} s (sent after p50 {result['fresh_send_after_ready_s']['p50']:.2f} "
        f"max {result['fresh_send_after_ready_s']['max']:.2f} s), close max {result['close_s_max'] * 1e3:.0f} ms, "
        f"leftover processes {after_kill['left']} (SIGKILL) {after_term['left']} (SIGTERM)")
    return result


def plot_chaos(results: dict, plt):
    chaos = results["chaos"]
    fig, ax = plt.subplots(figsize=(10, 0.4 * chaos["robots"] + 1.5))
    for i, installs in enumerate(chaos["timeline"]["installs"]):
        ax.plot(installs, [i] * len(installs), "|", markersize=10, color="tab:blue")
    ax.axvline(0.0, color="tab:red", label="SIGKILL")
    ax.axvline(chaos["timeline"]["ready"], color="tab:green", label="restarted: /healthz 200")
    ax.set(xlabel="seconds from the kill", ylabel="robot", title=(
        f"vlaserve chaos, {results['device']}: {chaos['robots']} robots at {chaos['hz']:g} Hz; new chunks in use (|); "
        f"gap p50 {chaos['gap_without_fresh_actions_s']['p50']:.2f} s, max {chaos['gap_without_fresh_actions_s']['max']:.2f} s"))
    ax.legend(loc="upper left")
    return fig
