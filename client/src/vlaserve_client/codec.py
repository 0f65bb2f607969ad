"""msgpack with OpenPI's ndarray encoding, the one wire format of both websocket protocols.

An ndarray travels as {b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": [...]}
(openpi-client's msgpack_numpy). The server encodes with this module's `packb` too; it decodes with
its own bounded decoder (server/codec.py: nesting, duplicate keys, budgets), while this one reads the
server's replies. Both build arrays from raw bytes only (never pickle), numeric dtypes only.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

_NUMERIC_KINDS = "biuf"
_MAX_FRAME = 64 * 2**20  # the server's default --max-payload-mb; a reply is ~3 kB, a request < 1 MB


def _get(obj: dict, key: str):
    return obj[key.encode()] if key.encode() in obj else obj[key]


def _decode_hook(obj: dict):
    if b"__ndarray__" not in obj and "__ndarray__" not in obj:
        return obj
    dtype = np.dtype(_get(obj, "dtype"))
    data, shape = _get(obj, "data"), [int(n) for n in _get(obj, "shape")]
    if dtype.kind not in _NUMERIC_KINDS or math.prod(shape) * dtype.itemsize != len(data):
        raise ValueError(f"malformed ndarray in reply: dtype {dtype.str}, shape {shape}, {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _encode_default(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}: only bool, int and float arrays")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(),
                b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot send a {type(obj).__name__}")


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=_encode_default)


def unpackb(data: bytes):
    return msgpack.unpackb(data, raw=False, object_hook=_decode_hook, max_bin_len=_MAX_FRAME)
