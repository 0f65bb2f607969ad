"""Exact prefix cache: an observation seen before skips the vision tower and the prefix LM.

Keyed on everything the prefix depends on: the preprocessed pixels, camera masks, token ids and
token mask, plus the model revision and dtype. A hit returns the very K/V tensors the miss
computed, so hit and miss give bit-identical actions. Opt-in (hashing ~2 MB of pixels costs
about a millisecond on the host; it pays when robots resend identical frames, e.g. a static scene).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    k: torch.Tensor  # [L, P, D] on the model device, keys post-RoPE
    v: torch.Tensor  # [L, P, D]
    pad: torch.Tensor  # [P] bool


class PrefixCache:
    def __init__(self, max_entries: int, namespace: str):
        if max_entries < 1:
            raise ValueError("a prefix cache needs room for at least one entry")
        self.max_entries, self.namespace = max_entries, namespace
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self.hits = self.misses = 0

    def key(self, images: torch.Tensor, image_mask: torch.Tensor, tokens: torch.Tensor,
            token_mask: torch.Tensor, pending=()) -> bytes:
        """Per observation (no batch dimension), from the host tensors; `pending`: its raw frames
        still to be resized on the device, (slot, raw [3, H, W] frame)."""
        h = hashlib.blake2b(self.namespace.encode(), digest_size=20)
        for slot, _ in pending:
            h.update(f"pending{slot}".encode())
        for t in (images, image_mask, tokens, token_mask, *(frame for _, frame in pending)):
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
        return h.digest()

    def fetch(self, keys: list[bytes | None]) -> tuple[list[PrefixEntry | None], bool]:
        """Each key's entry (None where missing, or where the key is None: an item that opted out of
        the cache, neither looked up nor counted), and whether every key hit (then the prefix is skipped)."""
        entries = [None if k is None else self.get(k) for k in keys]
        return entries, all(e is not None for e in entries)

    def get(self, key: bytes) -> PrefixEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, entry: PrefixEntry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drops every entry (the weights that computed them were replaced); the counts stay."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        return {"entries": len(self), "max_entries": self.max_entries, "hits": self.hits, "misses": self.misses}
