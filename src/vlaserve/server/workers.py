"""Heavy request work off the event loop, behind a bounded backlog.

Threads take what releases the GIL or calls back into Python often enough for the loop to get it:
preprocessing (resize, tokenize) and msgpack decoding (a Python hook per list and map). JSON
decoding does neither: the C scanner holds the GIL for a whole body (a 48 MB JSON image stalled
every client for 4.4 s), so large JSON bodies are decoded in a separate process, which returns the
body with its arrays as ndarrays (cheap to pickle). Past `max_pending` jobs, new requests get 503.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from .orphans import die_with_parent
from .schema import ApiError


def _ready() -> bool:
    return True


class Workers:
    def __init__(self, threads: int, processes: int, max_pending: int):
        self.max_pending = max_pending
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="vlaserve-work")
        # spawn, not fork: the parent holds torch's threads and the model; the child imports codec only.
        # The child dies with this process (server.orphans): a SIGKILLed server leaves nothing behind.
        self._processes = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=die_with_parent, initargs=(os.getpid(),))
        self._pending = 0

    def start(self) -> None:
        """Starts the decode process now, so the first large JSON body doesn't wait for it."""
        self._processes.submit(_ready)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._processes.shutdown(wait=True, cancel_futures=True)

    async def in_thread(self, fn, *args):
        return await self._run(self._threads, fn, args)

    async def in_process(self, fn, *args):
        return await self._run(self._processes, fn, args)

    async def _run(self, executor, fn, args):
        if self._pending >= self.max_pending:
            raise ApiError(503, "overloaded", f"{self._pending} requests are being decoded or prepared; "
                                              "retry shortly")
        self._pending += 1  # only the event loop thread touches the count
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        finally:
            self._pending -= 1
