"""Which CUDA graphs start-up captures, and in which order.

`capture_plan` lists every graph once, in the order traffic needs them: batch 1's common call first (the
server serves once it exists), then the largest size's, then the rest of batch 1, then the larger sizes
largest first.
"""

from __future__ import annotations

from ..runtime.graph_keys import GraphKey


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
    the pool anew). Batch 1 first breaks that order for batch 1 only: its intermediates are the
    smallest of all, so at worst the pool keeps batch 1's own blocks besides the rest. The fleet's
    common call comes behind its size's largest graph, not before it: captured first, the shorter
    prompt's blocks were kept beside the longer one's (a larger pool).

    Why the fleet's call early: robots starting with the server run as batch-1 calls (about twice
    the wait the fleet's batch size gives them) until it is captured."""
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
