"""Where start-up's capture plan stands: what is captured, what comes next, and how long it took."""

from __future__ import annotations

import threading
import time

from ..runtime.graph_keys import GraphKey


class CaptureProgress:
    """Where a capture plan stands, for the runtime's stats()["graphs"] (seconds since the warm-up began),
    and which graph comes next: the plan's order, but a graph a waiting call needs first."""

    def __init__(self, plan: list[GraphKey], num_steps: int = 0):
        self.plan, self.num_steps = plan, num_steps
        self.planned = set(plan)
        self.timed: list[tuple[str, float, float]] = []  # (shape, warm-up s, capture s), in order
        self.started = time.perf_counter()
        self.serving_after_s: float | None = None
        self.all_captured_after_s: float | None = None
        self.error: str | None = None
        self.kernels_compiled = 0  # compiled ahead (a cold compile cache), and the seconds recording and waiting took
        self.compile_s = 0.0
        self._captured: set[GraphKey] = set()
        self._wanted: list[GraphKey] = []
        self._changed = threading.Condition()
        # Serving starts once the first batch size can run its first prompt length and camera
        # layout without RTC (the plan lists that prefix and its Euler steps first; the offload
        # profile's plan has no prefix graphs): the most common call. Others wait for theirs.
        first = [k for k in plan if k.batch == plan[0].batch] if plan else []
        self._serve_keys = {next(k for k in first if k.is_prefix == prefix)
                            for prefix in (True, False) if any(k.is_prefix == prefix for k in first)}

    @property
    def done(self) -> list[str]:
        return [shape for shape, _, _ in self.timed]

    @property
    def warmup_s(self) -> float:
        return sum(w for _, w, _ in self.timed)

    @property
    def capture_s(self) -> float:
        return sum(c for _, _, c in self.timed)

    def can_serve(self) -> bool:
        return self._serve_keys <= self._captured

    def serves(self, key: GraphKey) -> bool:
        """Whether serving waits for `key`'s graph."""
        return key in self._serve_keys

    def next_key(self) -> GraphKey | None:
        """The next graph to capture: the first one a waiting call asked for, else the plan's next."""
        with self._changed:
            return next((k for k in (*self._wanted, *self.plan) if k not in self._captured), None)

    def wait_for(self, keys: list[GraphKey], timeout: float) -> bool:
        """Asks for `keys` next and waits until they are captured (or the capture failed) -> False
        after `timeout`."""
        with self._changed:
            missing = [k for k in keys if k not in self._captured]
            if not missing:
                return True
            self._wanted += [k for k in missing if k not in self._wanted]
            return self._changed.wait_for(
                lambda: self.error is not None or all(k in self._captured for k in missing), timeout)

    def failed(self, error: str) -> None:
        with self._changed:
            self.error = error
            self._changed.notify_all()

    def compiled(self, kernels: int, seconds: float) -> None:
        self.kernels_compiled += kernels
        self.compile_s += seconds

    def captured(self, key: GraphKey, warmup_s: float, capture_s: float) -> None:
        with self._changed:
            self.timed.append((str(key), warmup_s, capture_s))
            self._captured.add(key)
            self._changed.notify_all()

    def stats(self) -> dict:
        timed = list(self.timed)
        done = [shape for shape, _, _ in timed]
        return {"captured": len(done), "total": len(self.plan), "pending": len(self.plan) - len(done),
                "captured_shapes": done, "pending_shapes": [str(k) for k in self.plan if k not in self._captured],
                "serving_after_s": self.serving_after_s, "all_captured_after_s": self.all_captured_after_s,
                "warmup_s": sum(w for _, w, _ in timed), "capture_s": sum(c for _, _, c in timed),
                "kernels_compiled_ahead": self.kernels_compiled, "compile_ahead_s": self.compile_s,
                "per_graph": [{"shape": shape, "warmup_s": round(w, 4), "capture_s": round(c, 4)}
                              for shape, w, c in timed],
                "error": self.error}
