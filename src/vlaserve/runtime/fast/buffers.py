"""The fast path's static buffers, described once: `BufferSpec` allocates them for the runner and
sums their bytes for the memory estimate (runtime/memory.py), so the two can never disagree.

One set per batch size, at the checkpoint's prompt length; a shorter prompt length (a prompt
bucket) uses views of its leading rows (`views`), so buckets add graphs but no buffer memory. The
K/V cache holds the prefix's keys and values in its first `prefix_len` rows and the action tokens'
in the next `horizon`, padded to the attention kernels' key tile.

A static buffer filled from the host in one copy (StaticRTC's guidance block, runtime/fast/model.py) lies in
one uint8 block (`block_layout`, `typed_view`) with a pinned host mirror (`HostMirror`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...config import PolicyConfig

# The attention kernels tile keys by 64 (kernels.py "block_t"): the cache length is a multiple of it.
KV_TILE = 64

BLOCK_ALIGN = 64  # bytes: every typed view of a block (`block_layout`) starts aligned


@dataclass(frozen=True)
class BufferSpec:
    batch: int
    cameras: int
    resolution: int
    token_len: int
    prefix_len: int
    horizon: int
    max_action_dim: int
    layers: int
    head_dim: int  # K/V per token and layer (one KV head)
    kv_dtype: torch.dtype
    state_dim: int = 0  # Pi0: the state token's input (one more context token after the prefix); 0: none

    @staticmethod
    def of(config: PolicyConfig, batch: int, kv_dtype: torch.dtype, token_len: int | None = None,
           state_dim: int = 0) -> "BufferSpec":
        m = config.model
        token_len = config.max_token_len if token_len is None else token_len
        return BufferSpec(batch, len(config.cameras), m.vision.image_size, token_len,
                          len(config.cameras) * m.vision.num_patches + token_len, config.action_horizon,
                          m.max_action_dim, m.vlm.depth, m.vlm.num_kv_heads * m.vlm.head_dim, kv_dtype, state_dim)

    @property
    def context_len(self) -> int:
        """Tokens the action tokens attend to besides themselves: the prefix, and Pi0's state token."""
        return self.prefix_len + (1 if self.state_dim else 0)

    @property
    def cache_len(self) -> int:
        return -(-(self.context_len + self.horizon) // KV_TILE) * KV_TILE

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        b = self.batch
        return {
            "images": ((b, self.cameras, 3, self.resolution, self.resolution), torch.float32),
            # The frames as robots send them (uint8, channels-last), converted into `images` by a graph
            # (graphs.py `_BytesIn`).
            "image_bytes": ((b, self.cameras, self.resolution, self.resolution, 3), torch.uint8),
            "image_masks": ((b, self.cameras), torch.bool),
            "tokens": ((b, self.token_len), torch.int64),
            "token_mask": ((b, self.token_len), torch.bool),
            "noise": ((b, self.horizon, self.max_action_dim), torch.float32),
            "k_cache": ((self.layers, b, self.cache_len, self.head_dim), self.kv_dtype),
            "v_cache": ((self.layers, b, self.cache_len, self.head_dim), self.kv_dtype),
            "pad": ((b, self.context_len), torch.bool),
            **({"state": ((b, self.state_dim), torch.float32)} if self.state_dim else {}),
        }

    def nbytes(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self.layout().values())

    def views(self, larger: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This spec's buffers as views of the leading part of a larger set (same batch size, a
        longer prompt): every dimension here is at most the larger one's. The kernels address the
        K/V cache through its strides, so a view of fewer rows per item serves as it is."""
        out = {}
        for name, (shape, _) in self.layout().items():
            full = larger[name]
            if any(s > f for s, f in zip(shape, full.shape)):
                raise ValueError(f"buffer {name}: {shape} does not fit in {tuple(full.shape)}")
            out[name] = full[tuple(slice(0, s) for s in shape)]
        return out

    def allocate(self, device) -> dict[str, torch.Tensor]:
        # Masks start all-true and the rest zero: a warm-up replay on them computes finite values.
        return {name: (torch.ones if dtype == torch.bool else torch.zeros)(shape, dtype=dtype, device=device)
                for name, (shape, dtype) in self.layout().items()}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def typed_view(block: torch.Tensor, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The bytes of a uint8 `block` from `start` (a multiple of dtype's size) as a [shape] tensor of `dtype`."""
    return block[start:start + _nbytes(shape, dtype)].view(dtype).view(shape)


def block_layout(entries: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Where each (shape, dtype) of `entries` starts in one uint8 block that holds them in order, each
    BLOCK_ALIGN-aligned, and the block's size."""
    starts, at = [], 0
    for shape, dtype in entries:
        starts.append(at)
        at = -(-(at + _nbytes(shape, dtype)) // BLOCK_ALIGN) * BLOCK_ALIGN
    return starts, at


class HostMirror:
    """A device block's mirror in pinned host memory (plain memory for a CPU block), and the event of its
    last upload: a call writes what it sends into the mirror and it goes up in one copy (`upload`) that the
    host does not wait for; the next call's writes wait until that copy has read the mirror (`ready`:
    long done, normally, as the batcher launches one batch ahead at most). Against copying each tensor up
    from where it lies (pageable memory: one copy through the driver's staging buffer each), one copy up."""

    def __init__(self, device_block: torch.Tensor):
        self.device_block = device_block
        self.cuda = device_block.device.type == "cuda"
        self.block = torch.zeros(device_block.numel(), dtype=torch.uint8, pin_memory=self.cuda)
        self._uploaded = torch.cuda.Event() if self.cuda else None
        self._pending = False

    def ready(self) -> None:
        """Waits until the last upload has read the mirror. The caller holds the device lock (launches go
        one at a time)."""
        if self._pending:
            self._uploaded.synchronize()
            self._pending = False

    def upload(self) -> None:
        """The mirror up into the device block."""
        self.device_block.copy_(self.block, non_blocking=True)
        if self.cuda:
            self._uploaded.record()
            self._pending = True
