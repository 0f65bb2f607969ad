"""Wire formats: JSON and msgpack with OpenPI's numpy extension.

OpenPI (openpi-client's msgpack_numpy) sends an ndarray as a map
{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": [...]}, and a numpy scalar as
{b"__npgeneric__": True, b"data": python value, b"dtype": dtype.str}. Decoding here builds arrays from raw
bytes only: no pickle, no object or void dtypes, and the byte count must match the shape.
"""

from __future__ import annotations

import json
import math

import msgpack
import numpy as np

MSGPACK_MEDIA_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
# Arrays on the wire hold numbers only: bool, signed/unsigned ints and floats.
_NUMERIC_KINDS = "biuf"


class DecodeError(ValueError):
    """The payload is not valid JSON/msgpack, or an embedded array is malformed."""


def is_msgpack(media_type: str | None) -> bool:
    return bool(media_type) and any(t in media_type.lower() for t in MSGPACK_MEDIA_TYPES)


def _field(obj: dict, name: str):
    # openpi-client packs these keys as bytes; other msgpack clients often use str.
    return obj[name.encode()] if name.encode() in obj else obj[name]


def _has(obj: dict, name: str) -> bool:
    return name.encode() in obj or name in obj


def _numeric_dtype(spec) -> np.dtype:
    if isinstance(spec, bytes):
        spec = spec.decode("ascii", "replace")
    if not isinstance(spec, str):
        raise DecodeError(f"array dtype must be a string, got {type(spec).__name__}")
    try:
        dtype = np.dtype(spec)
    except TypeError:
        raise DecodeError(f"unknown array dtype {spec!r}") from None
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise DecodeError(f"array dtype {spec!r} is not numeric")
    return dtype


def _decode_extension(obj: dict):
    if _has(obj, "__ndarray__"):
        dtype = _numeric_dtype(_field(obj, "dtype"))
        data, shape = _field(obj, "data"), _field(obj, "shape")
        if not isinstance(data, bytes):
            raise DecodeError("array data must be binary")
        if not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= 0 for n in shape):
            raise DecodeError(f"array shape must be a list of non-negative ints, got {shape!r}")
        if math.prod(shape) * dtype.itemsize != len(data):
            raise DecodeError(f"array of shape {list(shape)} and dtype {dtype.str} needs "
                              f"{math.prod(shape) * dtype.itemsize} bytes, got {len(data)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if _has(obj, "__npgeneric__"):
        dtype = _numeric_dtype(_field(obj, "dtype"))
        value = _field(obj, "data")
        if isinstance(value, (bytes, str, dict, list)):
            raise DecodeError("numpy scalar data must be a number")
        # A plain Python number: downstream validation treats it like any other scalar.
        return dtype.type(value).item()
    return obj


def _hook(obj: dict):
    try:
        return _decode_extension(obj)
    except KeyError as e:
        raise DecodeError(f"array encoding lacks {e.args[0]!r}") from None


def unpackb(data: bytes):
    try:
        return msgpack.unpackb(data, raw=False, object_hook=_hook)
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"invalid msgpack: {e}") from None


def _encode_extension(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"cannot encode an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(),
                b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=_encode_extension)


def loads_json(data: bytes):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DecodeError(f"invalid JSON: {e}") from None


def dumps_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
