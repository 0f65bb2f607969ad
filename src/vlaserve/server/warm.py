"""Keep-warm (`--keep-warm`): a client's host path rehearsed on the event loop just before its answer
is due, so that the reply and the client's next frame find that code warm.

While the device runs a batch (14 ms at batch 1 on an H200) the event loop's thread sits idle, and a
request path run after such a pause costs 2-4x its back-to-back time; keeping the core busy meanwhile
does not help, running the same code does (docs/performance.md, "A lone robot's host time"). Within
~2 ms of the device finishing, the event loop hands the answer back and encodes the reply, and then
decodes, checks and prepares the client's next frame. A rehearsal runs that code once, LEAD_S before
the batch is predicted to end, on the frame just served: decoded again, its request built and prepared
(with zero noise: nothing is drawn from the global generator) and a reply of zeros encoded. Nothing is
queued, kept, counted or sent.

At most one rehearsal is pending: a later one replaces it, and an answer coming back drops it (run after
the answer, it could only delay the reply or the next frame: a device time over-predicted). A shape whose
device time is not known yet (its first batch) schedules none; a rehearsal that raises is logged and
switches keep-warm off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..batcher import DeviceClock

log = logging.getLogger(__name__)

# How long before the batch's predicted end a rehearsal is due. Event-loop timers fire up to 1 ms late (asyncio
# and uvloop wait in whole milliseconds), so it runs 1-2 ms before: long enough for it to finish (~0.3 ms of
# host time) before the answer comes back, short enough that little decays before the real work runs.
LEAD_S = 0.002


class KeepWarm:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.rehearsals = 0
        self._pending: asyncio.TimerHandle | None = None

    def schedule(self, rehearsal: Callable[[], bool], clock: DeviceClock, shape: tuple, queued_at: float) -> None:
        """On the event loop, as a request is queued (at `queued_at`, perf_counter seconds) or launched:
        `rehearsal` runs LEAD_S before its batch of `shape` (batch size, step count, graphs) is predicted to
        end, by the batcher's `clock`. It returns whether it rehearsed anything (a frame decoded off the
        event loop is not rehearsed)."""
        if not self.enabled:
            return
        device_s = clock.device_s(shape)
        if device_s is None:
            return
        if self._pending is not None:
            self._pending.cancel()
        now = time.perf_counter()
        end = clock.predicted_end()
        if end is None:  # the device idle: the request launches now
            due = now + clock.launch_s + device_s
        elif clock.last_launch_s >= queued_at:  # its batch is on the device (a direct launch, or a quick launch thread)
            due = end
        else:  # it runs behind the batch on the device
            due = end + device_s
        self._pending = asyncio.get_running_loop().call_later(max(0.0, due - now - LEAD_S), self._rehearse, rehearsal)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _rehearse(self, rehearsal: Callable[[], bool]) -> None:
        self._pending = None
        try:
            rehearsed = rehearsal()
        except Exception:  # noqa: BLE001 - a rehearsal must never hurt serving
            log.exception("keep-warm: a rehearsal failed; keep-warm is off from now on")
            self.enabled = False
            return
        self.rehearsals += bool(rehearsed)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "rehearsals": self.rehearsals, "pending": self._pending is not None}
