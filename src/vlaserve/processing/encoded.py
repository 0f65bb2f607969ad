"""Camera frames sent encoded, as PNG or JPEG: bytes (msgpack), or text (JSON: base64, or a
`data:image/...;base64,` URL).

A request keeps the image as sent; `Policy.prepare` (on the server's worker threads, never the event
loop: base64 of a large body is long CPU work, and Pillow decodes with the GIL released) reads its
header first, so a decompression bomb or a stray byte string is refused before any pixel is
allocated, then decodes it to an HxWx3 uint8 array that takes the same path as a raw one.

Colour modes: RGB as is; greyscale (its value copied into R, G and B), palette images (expanded)
and alpha channels (dropped, not composited: a browser canvas's PNG is RGBA with alpha 255) become
RGB; anything else (16-bit greyscale, CMYK, float) is refused. EXIF orientation is not applied:
pixels are used in the order stored, like a raw array's. Pillow (libjpeg-turbo, zlib) decodes both
formats from one library: JPEG within 10% of simplejpeg's speed (docs/server.md).
"""

from __future__ import annotations

import binascii
import io
import numpy as np
from PIL import Image

from ..errors import InvalidObservation
from ..types import EncodedImage
from .images import MAX_IMAGE_SIDE

SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}
DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg")
# Modes Pillow opens 8-bit PNGs and JPEGs in, that become RGB by dropping alpha or expanding.
CONVERTIBLE_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1"})


def decode_image(image: EncodedImage, field: str) -> np.ndarray:
    """HxWx3 uint8, after checking the header: a PNG or JPEG, of at most MAX_IMAGE_SIDE pixels a
    side, in a colour mode that becomes RGB."""
    data = _from_text(image.data, field) if isinstance(image.data, str) else image.data
    kind = next((kind for magic, kind in SIGNATURES.items() if data.startswith(magic)), None)
    if kind is None:
        raise InvalidObservation(field, f"bytes are not a PNG or JPEG image (they start with {data[:8]!r}); "
                                        "send a PNG, a JPEG or an array of pixels")
    try:
        opened = Image.open(io.BytesIO(data), formats=[kind])  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own limit, far past ours
        raise InvalidObservation(field, f"the {kind} header declares an image far larger than {MAX_IMAGE_SIDE}x"
                                        f"{MAX_IMAGE_SIDE} pixels; refused before decoding") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidObservation(field, f"not a readable {kind}: {e}") from None
    with opened:
        (width, height), mode = opened.size, opened.mode
        if max(width, height) > MAX_IMAGE_SIDE or min(width, height) < 1:
            raise InvalidObservation(field, f"the {kind} is {width}x{height} pixels; sides must be 1 to "
                                            f"{MAX_IMAGE_SIDE} pixels (refused before decoding)")
        if mode not in CONVERTIBLE_MODES:
            raise InvalidObservation(field, f"a {kind} in colour mode {mode!r}; send 8-bit RGB, RGBA, "
                                            "greyscale or palette images")
        try:
            opened.load()
            return np.asarray(opened if mode == "RGB" else opened.convert("RGB"))
        except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt after a valid header
            raise InvalidObservation(field, f"a broken {kind}: {e}") from None


def _from_text(text: str, field: str) -> bytes:
    if text.startswith("data:"):
        header, comma, text = text.partition(",")
        media, _, encoding = header[len("data:"):].partition(";")
        if not comma or encoding.lower() != "base64" or media.lower() not in DATA_URL_TYPES:
            raise InvalidObservation(field, "a data URL image must be data:image/png;base64,... or "
                                            "data:image/jpeg;base64,...")
    try:
        # Line breaks are allowed (base64 tools wrap lines); any other character outside the alphabet is an error.
        return binascii.a2b_base64(text.replace("\n", "").replace("\r", ""), strict_mode=True)
    except (binascii.Error, ValueError):
        raise InvalidObservation(field, "an image given as text must be a base64-encoded PNG or JPEG, or a "
                                        "data:image/...;base64, URL") from None
