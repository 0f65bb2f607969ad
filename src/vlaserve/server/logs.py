"""Rate-limited logging: a flood of one message (a client that fails the same way a thousand times
a second, "Too many open files" from the accept loop) must not fill the disk or bury the rest."""

from __future__ import annotations

import logging
import time


class RepeatLimit(logging.Filter):
    """Passes at most `burst` records of one (logger, level, message template) per `window_s`; at the
    first record after a window with suppressed ones, says how many were dropped."""

    def __init__(self, burst: int = 10, window_s: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._windows: dict[tuple, list] = {}  # key -> [window start, passed, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.msg if isinstance(record.msg, str) else repr(record.msg))
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.window_s:
            dropped = 0 if window is None else window[2]
            if len(self._windows) > 10_000:  # bounded, even for messages that embed varying text
                self._windows.clear()
            self._windows[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this suppressed in the last {self.window_s:g} s]"
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        return False


def install(burst: int = 10, window_s: float = 60.0) -> RepeatLimit:
    """Puts one RepeatLimit on every handler of the root logger (where all records end up)."""
    limit = RepeatLimit(burst, window_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)
    return limit
