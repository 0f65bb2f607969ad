"""Experiment (issue 44, session 14): minor page faults a `vlaserve serve` process (CPU, golden checkpoint) takes per
openpi-client request, 10 ms apart, with glibc's default malloc and with freed memory kept (blocks below 32 MiB
from the heap, no trim below 256 MiB; set through glibc's environment tunables, for the whole process).

    python bench/probes/malloc_server_faults.py
"""
import os
import socket
import subprocess
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."), os.path.join(os.path.dirname(__file__), "..", "..", "tests")]
import httpx  # noqa: E402
from common import golden_checkpoint, robot_observation  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402

KEEP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def minor_faults(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


for mode in ("default", "keep", "default", "keep"):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **(KEEP if mode == "keep" else {})}
    server = subprocess.Popen([sys.executable, "-m", "vlaserve.cli", "serve", str(golden_checkpoint("pi05")), "--device",
                               "cpu", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    client = WebsocketClientPolicy("127.0.0.1", port)
    obs = robot_observation(0, 14, 50, 32)
    for _ in range(5):
        client.infer(obs)
    before, n = minor_faults(server.pid), 40
    for _ in range(n):
        client.infer(obs)
        time.sleep(0.01)
    print(f"{mode}: the server's minor page faults per request {(minor_faults(server.pid) - before) / n:.0f}", flush=True)
    server.terminate()
    server.wait()
