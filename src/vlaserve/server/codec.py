"""Wire formats: JSON and msgpack with OpenPI's numpy extension.

Both decoders bound what they accept before any other work sees it (docs/server.md#limits): valid
UTF-8 only (no lone surrogates, in JSON escapes either), no duplicate map keys, at most
MAX_NESTING_DEPTH levels of maps and lists. Nested lists of numbers become ndarrays here, once, so
the schema checks arrays whichever format they came in.

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

from vlaserve_client.codec import packb  # noqa: F401  (encoding is the one wire format both sides share)

JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
# Maps and lists inside maps and lists. A request body needs 7 (body.input.observation.images.cam
# + an image's rows and pixels); numpy arrays themselves may have up to 64 dims and are checked by shape.
MAX_NESTING_DEPTH = 32
# Arrays on the wire hold numbers only: bool, signed/unsigned ints and floats.
_NUMERIC_KINDS = "biuf"


class DecodeError(ValueError):
    """The payload is not valid JSON/msgpack, or an embedded array is malformed."""


def media_type(content_type: str | None) -> str | None:
    """`type/subtype` of a Content-Type or Accept value, lower-cased, parameters (charset) dropped."""
    if content_type is None:
        return None
    return content_type.partition(";")[0].strip().lower()


def is_msgpack(content_type: str | None) -> bool:
    """An exact msgpack media type (a substring such as `text/plain; x=msgpack` does not count)."""
    return media_type(content_type) in MSGPACK_MEDIA_TYPES


def accepts_msgpack(accept: str | None) -> bool:
    """Whether an Accept header lists a msgpack media type among its comma-separated entries."""
    return bool(accept) and any(is_msgpack(entry) for entry in accept.split(","))


def reply_msgpack(content_type: str | None, accept: str | None) -> bool:
    """SGLang's negotiation: a msgpack reply when either the body's Content-Type or Accept names msgpack."""
    return is_msgpack(content_type) or accepts_msgpack(accept)


TENSOR_OBJECT_KEYS = frozenset({"dtype", "shape", "values"})


def tensor_object(value):
    """SGLang's JSON form of an array, {"dtype": "float32", "shape": [..], "values": nested or flat},
    as an ndarray; any other value is returned unchanged. Raises DecodeError when it is malformed."""
    if not isinstance(value, dict) or "values" not in value or not set(value) <= TENSOR_OBJECT_KEYS:
        return value
    values = value["values"]
    if not isinstance(values, np.ndarray):
        raise DecodeError("a tensor object's values must be a (nested) list of numbers")
    array = values
    if value.get("dtype") is not None:
        dtype = _numeric_dtype(value["dtype"])
        if dtype.kind in "iu" and array.dtype.kind == "f" and not np.array_equal(array, np.round(array)):
            raise DecodeError(f"a tensor object of dtype {dtype.name} holds non-integer values")
        array = array.astype(dtype, copy=False)
    shape = value.get("shape")
    if shape is not None:
        if not isinstance(shape, (list, np.ndarray)) or not all(type(n) in (int, np.int64) and n >= 0 for n in
                                                                list(shape)):
            raise DecodeError(f"a tensor object's shape must be a list of non-negative ints, got {shape!r}")
        shape = [int(n) for n in shape]
        if math.prod(shape) != array.size:
            raise DecodeError(f"a tensor object of shape {shape} needs {math.prod(shape)} values, got {array.size}")
        array = array.reshape(shape)
    return array


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


def _unique_map(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DecodeError(f"duplicate key {duplicate!r}")
    return obj


def _msgpack_map(pairs: list):
    try:
        return _decode_extension(_unique_map(pairs))
    except KeyError as e:
        raise DecodeError(f"array encoding lacks {e.args[0]!r}") from None
    except TypeError as e:  # an unhashable key (a map or list used as a key)
        raise DecodeError(f"invalid map key: {e}") from None


def _list(items: list) -> list:
    # A Python callback per list is what lets a long decode in a worker thread give up the GIL
    # (the C unpacker never does on its own), so the event loop keeps answering meanwhile.
    return items


class OverBudget(Exception):
    """An inline decode met more maps and lists than it may build on the event loop."""


def _counted(hooks, budget: int):
    # A container counts 1, plus 1 per 256 items: numpy converts long number lists later, which
    # costs per item.
    count = 0

    def wrap(hook):
        def counted(obj):
            nonlocal count
            count += 1 + len(obj) // 256
            if count > budget:
                raise OverBudget
            return hook(obj)
        return counted

    return [wrap(h) for h in hooks]


def unpackb(data: bytes, max_containers: int | None = None):
    """`max_containers`: raise OverBudget (early) past that many maps and lists (see _counted), so a caller can
    decode a cheap body in place and hand a costly one to a thread (server.bodies)."""
    pairs_hook, list_hook = _msgpack_map, _list
    if max_containers is not None:
        pairs_hook, list_hook = _counted((pairs_hook, list_hook), max_containers)
    try:
        obj = msgpack.unpackb(data, raw=False, object_pairs_hook=pairs_hook, list_hook=list_hook,
                              strict_map_key=False)
    except (DecodeError, OverBudget):
        raise
    except msgpack.StackError:
        raise DecodeError(f"invalid msgpack: nested deeper than {MAX_NESTING_DEPTH} levels") from None
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"invalid msgpack: {e}") from None
    return bounded(obj)


_JSON = json.JSONDecoder(object_pairs_hook=_unique_map)


def loads_json(data: bytes):
    try:
        # Decoded as UTF-8 explicitly: json.loads(bytes) would also take UTF-16 and UTF-32.
        obj = _JSON.decode(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DecodeError(f"invalid JSON: not UTF-8 ({e.reason} at byte {e.start}){_msgpack_hint(data)}") from None
    except json.JSONDecodeError as e:
        raise DecodeError(f"invalid JSON: {e}{_msgpack_hint(data)}") from None
    except RecursionError:  # the C scanner's own limit, far past ours
        raise DecodeError(f"invalid JSON: nested deeper than {MAX_NESTING_DEPTH} levels") from None
    return bounded(obj)


def _msgpack_hint(data: bytes) -> str:
    """The fix for a msgpack body sent as JSON (no Content-Type, or application/json): a body that opens
    with a msgpack map's first byte."""
    if data[:1] and (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF)):
        return "; the body looks like msgpack: send it with Content-Type: application/msgpack"
    return ""


def bounded(obj, depth: int = 1):
    """Checks depth and strings of a decoded body; returns it with numeric lists as ndarrays.

    A list that numpy turns into a numeric array is not walked element by element (numpy already
    did, in C, and the schema would convert it anyway), so this costs nothing extra on image-sized
    JSON lists. Anything else is walked: ragged or mixed lists, maps, strings."""
    if depth > MAX_NESTING_DEPTH:
        raise DecodeError(f"nested deeper than {MAX_NESTING_DEPTH} levels")
    if isinstance(obj, str):
        _check_text(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str):
                _check_text(key)
            obj[key] = bounded(value, depth + 1)
    elif isinstance(obj, list):
        array = _numeric_array(obj)
        if array is not None:
            if array.ndim + depth - 1 > MAX_NESTING_DEPTH:
                raise DecodeError(f"nested deeper than {MAX_NESTING_DEPTH} levels")
            return array
        for i, item in enumerate(obj):
            obj[i] = bounded(item, depth + 1)
    return obj


def _numeric_array(items: list) -> np.ndarray | None:
    if not items:
        return None  # [] stays a list: its dtype (float64) would be a guess
    try:
        array = np.asarray(items)
    except (ValueError, TypeError, OverflowError, RecursionError):  # ragged, too deep, huge ints
        return None
    return array if array.dtype.kind in _NUMERIC_KINDS else None


def _check_text(text: str) -> None:
    # Strings decoded from UTF-8 can't hold surrogates, but a JSON escape ("\ud800") can.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise DecodeError("a string holds a lone surrogate (not valid Unicode text)") from None


def dumps_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
