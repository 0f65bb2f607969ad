"""bench_fleet.py --swap-weights: the served weights swapped in place (POST /update_weights_from_disk) under a fleet
of paced robots, to a perturbed copy of the checkpoint and back.

Each robot (openpi-client, its own observation and fixed noise) sends at --hz for --seconds; a third of the way
in the server's weights are updated to the copy, two thirds in back to the original. Each robot's answer alone
on either version (taken before the run, the server swapped to the copy and back for it) is the reference every
answer under load is attributed by: to the version it lies within WRONG_ANSWER of (and closer to), else to
neither (a mix of versions, or a wrong answer). Reports each update's time (the server's load_ms, read_ms and
swap_ms: how long batches were held back) against the checkpoint's read time (its weight files read once with
plain reads), the failed requests, the answers per version and those of neither, answers of the old version to
a request sent after the update had answered, and the p99 latency before the first update vs of the requests in
flight during an update.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from common import percentiles

ROUTE = "/update_weights_from_disk"


def perturbed_copy(checkpoint: Path, out: Path, scale: float = 0.05, seed: int = 0) -> Path:
    """A copy of `checkpoint` whose every weight tensor moved by `scale` of its standard deviation in Gaussian
    noise (stored in its own dtype): the same architecture, other actions."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    generator = torch.Generator().manual_seed(seed)
    for path in sorted(out.glob("*.safetensors")):
        if "processor" in path.name:
            continue
        tensors = load_file(path)
        for key, t in tensors.items():
            if t.is_floating_point():
                x = t.float()
                noise = torch.randn(x.shape, generator=generator) * (scale * float(x.std()) if x.numel() > 1 else scale)
                tensors[key] = (x + noise).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def read_time_s(checkpoint: Path) -> float:
    """Seconds to read the checkpoint's weight files once, in full, with plain reads (as the update reads them)."""
    started = time.perf_counter()
    for path in sorted(checkpoint.glob("*.safetensors")):
        if "processor" not in path.name:
            with open(path, "rb", buffering=0) as f:
                while f.read(64 * 2**20):
                    pass
    return time.perf_counter() - started


def update(port: int, checkpoint: Path) -> dict:
    """POSTs an update -> the server's reply, with the client's wall time around it."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{ROUTE}", method="POST",
                                     data=json.dumps({"model_path": str(checkpoint)}).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        reply = json.loads(response.read())
    return {**reply, "client_wall_ms": (time.perf_counter() - started) * 1e3}


def run_swap(port: int, observations: list[dict], versions: dict[str, Path], hz: float, seconds: float,
             wrong_answer: float) -> dict:
    """The run above; `versions`: {"original": the served checkpoint, "perturbed": its copy}."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    alone = WebsocketClientPolicy("127.0.0.1", port)
    references = {"original": [alone.infer(obs)["actions"] for obs in observations]}
    update(port, versions["perturbed"])
    references["perturbed"] = [alone.infer(obs)["actions"] for obs in observations]
    update(port, versions["original"])
    apart = min(float(np.abs(a - b).max()) for a, b in zip(references["original"], references["perturbed"]))

    n, answers, failures, lock = len(observations), [], [], threading.Lock()
    start_barrier = threading.Barrier(n + 1)
    updates: list[dict] = []

    def robot(i: int) -> None:
        client = WebsocketClientPolicy("127.0.0.1", port)
        client.infer(observations[i])  # connect and warm this socket before timing
        start_barrier.wait()
        started, tick = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            delay = started + (i / n + tick) / hz - time.perf_counter()
            tick += 1
            if delay > 0:
                time.sleep(delay)
            sent = time.perf_counter()
            try:
                out = client.infer(observations[i])
            except Exception as e:  # noqa: BLE001 - counted: must be none
                with lock:
                    failures.append(f"robot {i}: {type(e).__name__}: {e}")
                continue
            received = time.perf_counter()
            distance = {v: float(np.abs(out["actions"] - refs[i]).max()) for v, refs in references.items()}
            best = min(distance, key=distance.get)
            with lock:
                answers.append({"robot": i, "sent": sent, "received": received, "latency_ms": (received - sent) * 1e3,
                                "version": best if distance[best] <= wrong_answer else "neither",
                                "distance": distance})

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start_barrier.wait()
    began = time.perf_counter()
    for at, version in ((seconds / 3, "perturbed"), (2 * seconds / 3, "original")):
        time.sleep(max(0.0, began + at - time.perf_counter()))
        started = time.perf_counter()
        reply = update(port, versions[version])
        updates.append({"to": version, "started": started - began, "answered": time.perf_counter() - began, **reply})
    for t in threads:
        t.join()

    for a in answers:
        a["sent"], a["received"] = a["sent"] - began, a["received"] - began
    first = updates[0]["started"]
    during = [a for a in answers if any(a["sent"] < u["answered"] and a["received"] > u["started"] for u in updates)]
    before = [a for a in answers if a["received"] < first]
    # A request sent after an update answered is served by its version, or by a later update's that began before
    # the answer came.
    stale = [a for a in answers for j, u in enumerate(updates)
             if a["sent"] > u["answered"] and (j + 1 == len(updates) or a["sent"] < updates[j + 1]["started"])
             and a["version"] not in {u["to"], *(w["to"] for w in updates[j + 1:] if w["started"] < a["received"])}]
    counts = {v: sum(a["version"] == v for a in answers) for v in ("original", "perturbed", "neither")}
    return {"robots": n, "hz": hz, "seconds": seconds, "references_apart": apart, "updates": updates,
            "failed_requests": len(failures), "failures": failures[:10], "answers": len(answers),
            "answers_by_version": counts, "stale_answers": len(stale),
            "before": percentiles([a["latency_ms"] for a in before]) if before else None,
            "during": percentiles([a["latency_ms"] for a in during]) if during else None,
            "timeline": [{k: a[k] for k in ("robot", "sent", "received", "latency_ms", "version")} for a in answers]}


def plot_swap(results: dict, plt):
    swap = results["swap"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = {"original": "tab:blue", "perturbed": "tab:orange", "neither": "tab:red"}
    for version, color in colors.items():
        points = [(a["sent"], a["latency_ms"]) for a in swap["timeline"] if a["version"] == version]
        if points:
            ax.scatter(*zip(*points), s=6, color=color, label=f"answered by {version} ({len(points)})")
    for u in swap["updates"]:
        ax.axvspan(u["started"], u["answered"], color="grey", alpha=0.3)
        ax.text(u["started"], ax.get_ylim()[1] * 0.95, f" to {u['to']}: {u['load_ms']:.0f} ms\n "
                f"(batches held {u['swap_ms']:.1f} ms)", fontsize=8, va="top")
    ax.set_xlabel("request sent (s since the robots started)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{swap['robots']} robots at {swap['hz']:g} Hz, weights updated in place twice (grey); "
                 f"checkpoint read {results['read_s'] * 1e3:.0f} ms")
    ax.legend(loc="upper left", fontsize=8)
    return fig
