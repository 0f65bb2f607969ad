"""The host/device boundary: a host batch onto the device, the one place it crosses.

`to_device` moves a batch into fresh device tensors (the eager runner, and a fast-path batch cut into
parts); `into_buffers` writes it into a fast runner's static buffers; `BytesIn` is a batch size's frames'
conversion, captured as a graph. Each input goes up once, in the layout it has; uint8 frames (kept as
bytes on the host) become [-1, 1] floats on the device, and frames of another size than the model's
are resized there (`finish_frame`: the same torch operations the host would run, so the same values).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..processing.images import bytes_to_model_range, finish_frame
from ..types import ModelInputs


def to_device(inputs: ModelInputs, device) -> ModelInputs:
    """The batch on `device`: `into_buffers` into fresh contiguous tensors."""
    fields = {"images": inputs.images, "image_masks": inputs.image_masks, "tokens": inputs.tokens,
              "token_mask": inputs.token_mask}
    if inputs.state is not None:
        fields["state"] = inputs.state
    moved = {name: torch.empty(t.shape, dtype=torch.float32 if name == "images" else t.dtype, device=device)
             for name, t in fields.items()}
    into_buffers(inputs, moved)
    return ModelInputs(moved["images"], moved["image_masks"], moved["tokens"], moved["token_mask"], moved.get("state"))


def into_buffers(inputs: ModelInputs, buffers: dict[str, torch.Tensor],
                 bytes_in: Callable[[torch.Tensor], None] | None = None) -> None:
    """The batch written into device buffers (a fast runner's static ones: `images` float32, `image_masks`,
    `tokens`, `token_mask`, and `state` where the model takes one): each input copied up once into its
    buffer, in the layout it has, and the bytes converted as they are written into `images` (fewer device
    operations than moving the batch and then copying it into the buffers); pending frames resized there.
    Inputs already on the device are copied across the same way.

    `bytes_in`: where the runtime has one for these buffers (`BytesIn`), it takes uint8 frames instead:
    their bytes up as they lie and their conversion into `images` replayed, the same operations without
    launching each from the host."""
    images = buffers["images"]
    if inputs.images.dtype == torch.uint8 and bytes_in is not None:
        bytes_in(inputs.images)
    elif inputs.images.dtype == torch.uint8:
        bytes_to_model_range(inputs.images.to(images.device, non_blocking=True), out=images)
    else:
        images.copy_(inputs.images, non_blocking=True)
    for item, slot, frame in inputs.pending:
        images[item, slot] = finish_frame(frame.to(images.device, non_blocking=True), images.shape[-1])
    for name in ("image_masks", "tokens", "token_mask"):
        buffers[name].copy_(getattr(inputs, name), non_blocking=True)
    if inputs.state is not None:
        buffers["state"].copy_(inputs.state, non_blocking=True)


class BytesIn:
    """A batch size's uint8 frames into its static buffers: copied up as they lie into `image_bytes`
    (channels-last, as robots send them: one plain copy), and `bytes_to_model_range` into `images` replayed
    from a graph instead of launched from the host on a fresh device tensor (less host time a call). The
    same operations on the same bytes: the same values."""

    def __init__(self, buf: dict, new_graph):
        self.pixels = self.pixels_of(buf)
        self.graph = new_graph(self.conversion(buf))

    @staticmethod
    def pixels_of(buf: dict) -> torch.Tensor:
        """The byte buffer viewed as `images` is laid out: [B, N, 3, S, S]."""
        return buf["image_bytes"].permute(0, 1, 4, 2, 3)

    @staticmethod
    def conversion(buf: dict):
        def run():
            bytes_to_model_range(BytesIn.pixels_of(buf), out=buf["images"])

        return run

    def __call__(self, frames: torch.Tensor) -> None:
        self.pixels.copy_(frames, non_blocking=True)
        self.graph.replay()
