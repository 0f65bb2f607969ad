"""Experiment (issue 44, session 14): websockets' sans-I/O server parser (what uvicorn's websockets-sansio runs)
taking a 0.45 MB masked binary message off the wire in 256 KiB reads, 10 ms after the last, in a bare process or
one that imported torch, with glibc's default malloc or with freed memory kept (mallopt: no mmap below 32 MiB, no
trim below 256 MiB).

    python bench/probes/malloc_ws_parse.py {plain,tuned} [torch]
"""
import ctypes
import os
import sys
import time

if "torch" in sys.argv:
    import torch  # noqa: F401
import numpy as np
from websockets.client import ClientProtocol
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

if sys.argv[1] == "tuned":
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 256 << 20) == 1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
client, server = ClientProtocol(parse_uri("ws://robot/"), max_size=None), ServerProtocol(max_size=None)
client.send_request(client.connect())
for data in client.data_to_send():
    server.receive_data(data)
server.send_response(server.accept(server.events_received()[0]))
for data in server.data_to_send():
    client.receive_data(data)
payload = os.urandom(451_700)
ms = []
for _ in range(300):
    client.send_binary(payload)
    wire = b"".join(client.data_to_send())
    time.sleep(0.01)
    t = time.perf_counter()
    for at in range(0, len(wire), 2**18):
        server.receive_data(wire[at:at + 2**18])
    message = server.events_received()[0].data
    ms.append((time.perf_counter() - t) * 1e6)
    assert len(message) == len(payload)
    del message
print(sys.argv[1:], f"parse after 10 ms idle: p50 {np.percentile(ms[20:], 50):.0f} us, p90 {np.percentile(ms[20:], 90):.0f}")
