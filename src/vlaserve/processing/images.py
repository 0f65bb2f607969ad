"""Camera images -> SigLIP input: [3, S, S] float32 in [-1, 1].

Accepted inputs: uint8 HWC/CHW, float [0, 1] HWC/CHW, or float [-1, 1] when the caller says
so explicitly (`normalized=True`); the range is never guessed from the values.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidObservation

# Larger camera images cost resize time and memory for nothing: they all end up at the model's
# resolution (224). 4096 px also keeps a uint8 image under the default 64 MiB payload.
MAX_IMAGE_SIDE = 4096


def to_chw_tensor(image, field: str) -> torch.Tensor:
    """Validates layout and dtype; returns a [3, H, W] tensor (uint8: a view of `image`, possibly
    strided and read-only; float32: its own copy), unscaled."""
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    image = np.asarray(image)
    if image.ndim != 3:
        raise InvalidObservation(field, f"expected an image of rank 3 (HWC or CHW), got shape {list(image.shape)}")
    if image.shape[-1] == 3:
        image = image.transpose(2, 0, 1)
    elif image.shape[0] != 3:
        raise InvalidObservation(field, f"expected 3 colour channels (RGB) first or last, got shape {list(image.shape)}")
    if image.shape[1] < 1 or image.shape[2] < 1:
        raise InvalidObservation(field, f"empty image of shape {list(image.shape)}")
    if max(image.shape[1:]) > MAX_IMAGE_SIDE:
        raise InvalidObservation(field, f"image sides must be at most {MAX_IMAGE_SIDE} pixels, "
                                        f"got {image.shape[1]}x{image.shape[2]}")
    if image.dtype == np.uint8:
        # A view, no copy: the batch's stack (or the resize) copies it once.
        if any(stride < 0 for stride in image.strides):  # e.g. a flipped array: torch takes no negative strides
            image = np.ascontiguousarray(image)
        return _view_of_bytes(image)
    if image.dtype.kind != "f":
        raise InvalidObservation(field, f"expected uint8 or float pixels, got {image.dtype}")
    image = image.astype(np.float32, copy=not image.flags.writeable)
    if not np.isfinite(image).all():
        raise InvalidObservation(field, "image contains NaN or inf")
    return torch.from_numpy(np.ascontiguousarray(image))


_read_only_warning_taken = False


def _view_of_bytes(image: np.ndarray) -> torch.Tensor:
    """torch.from_numpy of a uint8 array that may be read-only (arrays decoded from msgpack are views of
    the payload). Nothing here writes into it, so the warning torch gives about that, once per process,
    is not shown: it is taken under catch_warnings the first time only (catch_warnings swaps the
    process's filters, not thread-safely, and costs microseconds on every frame)."""
    global _read_only_warning_taken
    if image.flags.writeable or _read_only_warning_taken:
        return torch.from_numpy(image)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(image)
    _read_only_warning_taken = True
    return view


def resized_shape(height: int, width: int, target: int) -> tuple[int, int]:
    # A float quotient, truncated, exactly as the reference (36x72 -> 111 rows, not 112).
    ratio = max(width / target, height / target)
    return int(height / ratio), int(width / ratio)


def resize_with_pad(image: torch.Tensor, target: int, round_to_bytes: bool) -> torch.Tensor:
    """[3, H, W] float in [0, 255] (bytes) or [0, 1] -> [3, target, target], same scale.

    Bilinear, align_corners=False, no antialiasing (even when shrinking); centred zero padding
    with the odd pixel at the bottom/right.
    """
    _, h, w = image.shape
    new_h, new_w = resized_shape(h, w, target)
    resized = F.interpolate(image[None], size=(new_h, new_w), mode="bilinear", align_corners=False)[0]
    resized = resized.round().clamp(0, 255) if round_to_bytes else resized.clamp(0.0, 1.0)
    top, left = (target - new_h) // 2, (target - new_w) // 2
    return F.pad(resized, (left, target - new_w - left, top, target - new_h - top), value=0.0)


def resize_bytes(frame: torch.Tensor, target: int) -> torch.Tensor:
    """uint8 [3, H, W] -> uint8 [3, target, target] by resize-with-pad, rounded back to the byte grid
    (OpenPI's semantics). The same torch operations on whichever device `frame` lives: the server
    sends raw camera frames to the GPU and resizes them there."""
    if frame.shape[1:] == (target, target):
        return frame
    # round() and clamp() leave integers in [0, 255]: exact in uint8.
    return resize_with_pad(frame.float(), target, round_to_bytes=True).to(torch.uint8)


_BYTE_SCALE: dict[torch.device, torch.Tensor] = {}  # 255 as a 0-dim float32 tensor, per device


def bytes_to_model_range(pixels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1]: the reference's `uint8 / 255.0` (LeRobot divides on the
    host: a true IEEE division in float32), then * 2 - 1, bit for bit on any device. The divisor is
    a tensor on the pixels' device, not a Python number: CUDA torch divides by a number through its
    rounded reciprocal, which is 1 ulp off the division for 126 of the 256 byte values (111 of them
    still after * 2 - 1). `out`: a float32 tensor of the pixels' shape to write into (any strides:
    the pixels are read as they lie), else a new one."""
    scale = _BYTE_SCALE.get(pixels.device)
    if scale is None:  # torch.full: a fill on the device's stream, no copy that would wait for it
        scale = _BYTE_SCALE.setdefault(pixels.device, torch.full((), 255.0, device=pixels.device))
    # The division converts the bytes to float32 (exactly) as it reads them; * 2 is exact.
    quotient = torch.div(pixels, scale) if out is None else torch.div(pixels, scale, out=out)
    return quotient.mul_(2.0).sub_(1.0)


def finish_frame(frame: torch.Tensor, target: int) -> torch.Tensor:
    """A raw frame `prepare_image(defer_resize=True)` kept (uint8, or float in [0, 1]) -> [3, target,
    target] float32 in [-1, 1]: what prepare_image returns for it, computed wherever `frame` lives."""
    if frame.dtype == torch.uint8:
        return bytes_to_model_range(resize_bytes(frame, target))
    return resize_with_pad(frame, target, round_to_bytes=False) * 2.0 - 1.0


def place_frames(images: torch.Tensor, frames) -> torch.Tensor:
    """images [..., 3, S, S] (uint8, or float in [-1, 1]) with each (index, raw frame) of `frames`
    finished into images[index], on images' device: a new float32 tensor in [-1, 1]."""
    target = images.shape[-1]
    out = bytes_to_model_range(images) if images.dtype == torch.uint8 else images.clone()
    for index, frame in frames:
        out[index] = finish_frame(frame.to(images.device, non_blocking=True), target)
    return out


def prepare_image(image, resolution: int, field: str, normalized: bool = False,
                  keep_bytes: bool = False, defer_resize: bool = False) -> torch.Tensor:
    """Any accepted image -> [3, resolution, resolution] float32 in [-1, 1].

    keep_bytes: a uint8 image that needs no resize stays uint8 (4x less to copy to the GPU, where
    `bytes_to_model_range` finishes the job bit-identically). defer_resize (with keep_bytes): an
    image of another size comes back unresized, [3, H, W] uint8 or float in [0, 1], for
    `finish_frame` on the device."""
    chw = to_chw_tensor(image, field)
    if min(resized_shape(chw.shape[1], chw.shape[2], resolution)) < 1:
        raise InvalidObservation(field, f"an image of {chw.shape[1]}x{chw.shape[2]} is too elongated: resized to "
                                        f"fit {resolution}x{resolution}, a side would be 0 pixels")
    if chw.dtype == torch.uint8 and keep_bytes and (defer_resize or chw.shape[1:] == (resolution, resolution)):
        return chw
    if chw.dtype == torch.uint8:
        # OpenPI semantics: resized uint8 pixels are rounded back to the byte grid.
        return bytes_to_model_range(resize_bytes(chw, resolution))
    low, high = (-1.0, 1.0) if normalized else (0.0, 1.0)
    if chw.numel() and (chw.min() < low or chw.max() > high):
        hint = "" if normalized else "; pass images_normalized=true for images already in [-1, 1]"
        raise InvalidObservation(field, f"float pixels must lie in [{low:g}, {high:g}]{hint}")
    unit = (chw + 1.0) / 2.0 if normalized else chw
    if unit.shape[1:] != (resolution, resolution):
        if keep_bytes and defer_resize:
            return unit
        unit = resize_with_pad(unit, resolution, round_to_bytes=False)
    elif normalized:
        return chw.clone()
    return unit * 2.0 - 1.0


def empty_image(resolution: int) -> torch.Tensor:
    """What an absent camera contributes (its mask is off, so its values never matter)."""
    return torch.full((3, resolution, resolution), -1.0)
