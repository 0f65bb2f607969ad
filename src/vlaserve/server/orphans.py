"""A worker process that outlives its server holds its memory and, through an inherited pipe, the
multiprocessing resource tracker too (which exits only when every holder of its pipe has gone). So a
worker dies with the process that started it, however that one dies (SIGKILL included).

Imports the standard library only: it runs first in a freshly spawned worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.25


def die_with_parent(parent_pid: int) -> None:
    """Ends this process when `parent_pid` is no longer its parent. On Linux the kernel sends SIGKILL
    at once (no Python needed, so a worker busy in C code holding the GIL goes too); everywhere a
    thread also polls the parent id, which changes when the parent dies and this one is re-parented.
    Linux ties the signal to the parent's thread that spawned this process: call it in a process
    started from a thread that lives as long as its parent (Workers.start, on the server's loop)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: the poll below still applies
            pass
    if os.getppid() != parent_pid:  # it died before the watch was set up
        os._exit(1)
    threading.Thread(target=_poll, args=(parent_pid,), name="vlaserve-parent-watch", daemon=True).start()


def _poll(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os._exit(1)
