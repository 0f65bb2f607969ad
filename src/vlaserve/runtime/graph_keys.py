"""The fast path's CUDA graphs by key, and how a batch runs on the ones captured: plain Python, no device.

A call of batch size b at prompt length L with c camera slots (with or without RTC) replays two
graphs: the prefix graph of (b, L, c) and the Euler-steps graph of (b, L, rtc). `route` maps a batch
to captured sizes while the rest are still being captured (and, with the graph_batches ladder, for
good); which graphs are captured, in which order, is start-up's (startup/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphKey:
    """One CUDA graph: the prefix of (batch, length, slots), or (slots None) the Euler steps of
    (batch, length, rtc). `str`: "b1 L96 cams3" (prefix), "b1 L96 denoise", "b1 L96 rtc"."""

    batch: int
    length: int
    slots: int | None = None
    rtc: bool = False

    @property
    def is_prefix(self) -> bool:
        return self.slots is not None

    def __str__(self) -> str:
        stage = f"cams{self.slots}" if self.is_prefix else "rtc" if self.rtc else "denoise"
        return f"b{self.batch} L{self.length} {stage}"


def route(batch: int, sizes) -> list[tuple[int, int]]:
    """How a batch runs on the captured batch `sizes` of its shape: [(size, rows)] parts in order,
    each one replay of `size` rows whose first `rows` are the batch's next items (the rest repeat
    its last item and are dropped). [] when it cannot (nothing captured at or below its size).

    Pad when a captured size s with batch <= s <= 2 * batch exists (the smallest), else split off
    the largest captured size below it and route the remainder the same way. Why: one replay of s
    rows reads the weights once, as one of fewer rows does (batches up to 8 are bound by that
    read), while every part of a split reads them again; padding to at most twice the rows is the
    cost the graph_batches ladder already accepts for good (3 -> 4, 5 -> 8). A batch of b run as
    parts gives each item exactly what its part's batch size gives (at the batch's camera layout):
    bit-identical to a call of that size, not to a call of size b (GEMMs tile differently per
    batch size)."""
    sizes = sorted(set(sizes))
    parts: list[tuple[int, int]] = []
    while batch:
        up = next((s for s in sizes if batch <= s <= 2 * batch), None)
        if up is not None:
            return parts + [(up, batch)]
        down = next((s for s in reversed(sizes) if s < batch), None)
        if down is None:
            return []
        parts.append((down, down))
        batch -= down
    return parts
