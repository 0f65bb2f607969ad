"""Which CUDA graphs the fast path captures, in which order, and how a batch runs on the ones
already captured: plain Python, no device (runtime/runner.py and fast/graphs.py drive it).

A call of batch size b at prompt length L with c camera slots (with or without RTC) replays two
graphs: the prefix graph of (b, L, c) and the Euler-steps graph of (b, L, rtc). `capture_plan`
lists every graph once, in the order traffic needs them: batch 1's common call first (the server
serves once it exists), then the largest size's, then the rest of batch 1, then the larger sizes
largest first. `route` maps a batch to captured sizes while the rest are still being captured (and,
with the graph_batches ladder, for good).
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


def _graphs_of(batch: int, length: int, cameras: int) -> list[GraphKey]:
    """One (batch, length)'s graphs: all cameras and no RTC first (the common call), then the
    fewer-camera layouts, then RTC."""
    return [GraphKey(batch, length, cameras), GraphKey(batch, length),
            *(GraphKey(batch, length, slots) for slots in range(cameras - 1, 0, -1)), GraphKey(batch, length, rtc=True)]


def capture_plan(sizes: tuple[int, ...], lengths: tuple[int, ...], cameras: int) -> list[GraphKey]:
    """Every graph of `sizes` x `lengths` x camera layouts (1..cameras slots) x RTC, each once.

    The smallest size's common call first (batch 1 at the smallest length, the default prompt
    bucket, every camera, no RTC: what a lone robot sends; the server serves once it is captured).
    Then what a fleet sends: the largest size's common call, behind that size's largest graph (its
    prefix at the longest length). Then the rest of the smallest size, at every length from the
    smallest up: once those are captured any batch can run (`route`; a call of a shape not captured
    yet asks for its graphs next). Then the other sizes largest first, longest length first.

    The graphs share one memory pool; capturing largest first lets each smaller graph's
    intermediates fit in blocks a larger one freed (the nano-vllm order; ascending, each size grew
    the pool anew: run 32). Batch 1 first breaks that order for batch 1 only: its intermediates are
    the smallest of all, so at worst the pool keeps batch 1's own blocks besides the rest. The
    fleet's common call comes behind its size's largest graph, not before it: captured first, the
    shorter prompt's blocks were kept beside the longer one's (the pool 2.51-2.54 GiB instead of
    2.21, run 190); behind it the pool stays 2.21 GiB (run 237).

    Why the fleet's call early: 16 robots starting with the server ran as batch-1 calls (~2x the
    wait batch 8 gives them) until it was captured, 6 s (warm compile cache) and 13 s (empty) after
    serving began, behind 8 more batch-1 graphs and 5 of batch 8 at the longest length; 1 and 4 s
    with this order (run 237)."""
    first, *rest = sorted(set(sizes))
    plan = [key for length in sorted(lengths) for key in _graphs_of(first, length, cameras)]
    for batch in sorted(rest, reverse=True):
        plan += [key for length in sorted(lengths, reverse=True) for key in _graphs_of(batch, length, cameras)]
    if rest:
        largest = max(rest)
        fleet = [GraphKey(largest, max(lengths), cameras), *_graphs_of(largest, min(lengths), cameras)[:2]]
        fleet = list(dict.fromkeys(fleet))  # one prompt length: its prefix is listed once
        plan = plan[:2] + fleet + [key for key in plan[2:] if key not in fleet]
    return plan


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
