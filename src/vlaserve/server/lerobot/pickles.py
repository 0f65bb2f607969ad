"""The only way a LeRobot pickle is read: a restricted unpickler.

LeRobot's robot_client sends pickles (a RemotePolicyConfig, TimedObservations holding numpy arrays).
Before anything runs, `scan` walks the opcodes without executing them: opcodes that reach outside
the data (persistent ids, the extension registry, protocol 0/1 instantiation, out-of-band buffers),
memo indices that would make the unpickler allocate a huge table, too many opcodes, and too deep a
nesting are refused. Then `RestrictedUnpickler` resolves only the globals of ALLOWED, each mapped to
our own small classes and functions (records.py; LeRobot and numpy's reconstructors are never
imported), so any other callable (`os.system`, `builtins.eval`, a torch storage loader) cannot even
be named, let alone REDUCEd. Finally `materialize` turns what was built into plain values, bounding
depth (cycles included), node count and array sizes.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools

import numpy as np

from . import records

MAX_OPCODES = 100_000
MAX_DEPTH = 16  # containers within containers: an observation is 3 deep
MAX_NODES = 50_000  # values in one message
MAX_MEMO_INDEX = MAX_OPCODES  # the pickler numbers memo slots 0, 1, 2...: never more than its opcodes
MAX_ARRAY_DIMS = 8
# Numeric dtypes an observation may carry: LeRobot sends uint8 frames and float32/float64 positions.
NUMERIC_DTYPES = frozenset({"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8"})
REFUSED_OPCODES = {
    "PERSID": "a persistent id", "BINPERSID": "a persistent id",
    "EXT1": "the extension registry", "EXT2": "the extension registry", "EXT4": "the extension registry",
    "INST": "protocol-0 instantiation", "OBJ": "protocol-1 instantiation",
    "NEXT_BUFFER": "an out-of-band buffer", "READONLY_BUFFER": "an out-of-band buffer",
}
MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


class Refused(ValueError):
    """A pickle (or what it holds) that is not read: the message names what was refused."""


# ---- numpy's reconstruction, re-implemented over checked inputs ---------------------------------
class Dtype:
    """`numpy.dtype(name, align, copy)` + its BUILD state: numeric dtypes only."""

    def __init__(self, name, align=False, copy=True):
        if not isinstance(name, str) or name not in NUMERIC_DTYPES:
            raise Refused(f"numpy dtype {name!r} (only numeric dtypes: {', '.join(sorted(NUMERIC_DTYPES))})")
        self.dtype = np.dtype(name)

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) < 2 or state[1] not in ("<", ">", "|", "="):
            raise Refused("a numpy dtype state that is not a numeric dtype's")
        if state[1] in "<>":
            self.dtype = self.dtype.newbyteorder(state[1])


class NdarrayClass:
    """Stands for `numpy.ndarray` where numpy's `_reconstruct` names the class to build."""


class ArrayUnderConstruction:
    """`numpy._core.multiarray._reconstruct(ndarray, (0,), b'b')`: filled by its BUILD state
    (version, shape, dtype, fortran order, raw bytes)."""

    def __init__(self):
        self.array: np.ndarray | None = None

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) != 5:
            raise Refused("a numpy array state that is not (version, shape, dtype, fortran, data)")
        _, shape, dtype, fortran, data = state
        self.array = _array(data, dtype, shape, "F" if fortran is True else "C")


def reconstruct(cls, shape, typecode):
    if cls is not NdarrayClass:
        raise Refused("numpy _reconstruct of anything but an ndarray")
    return ArrayUnderConstruction()


def frombuffer(buffer, dtype, shape, order):
    """`numpy._core.numeric._frombuffer`, what protocol 5 pickles an array with."""
    return _array(buffer, dtype, shape, order)


def scalar(dtype, data):
    """`numpy._core.multiarray.scalar(dtype, bytes)`: a numpy number, as a Python number."""
    return _array(data, dtype, (), "C").item()


def _array(data, dtype, shape, order) -> np.ndarray:
    if not isinstance(dtype, Dtype):
        raise Refused("a numpy array whose dtype is not a numeric numpy dtype")
    if not isinstance(data, (bytes, bytearray)):
        raise Refused("a numpy array whose data is not bytes")
    if (not isinstance(shape, tuple) or len(shape) > MAX_ARRAY_DIMS
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise Refused(f"a numpy array shape must be at most {MAX_ARRAY_DIMS} non-negative integers")
    if order not in ("C", "F"):
        raise Refused("a numpy array order must be 'C' or 'F'")
    declared = math.prod(shape) * dtype.dtype.itemsize
    if declared != len(data):
        raise Refused(f"a numpy array declares {declared} bytes ({list(shape)} x {dtype.dtype}) "
                      f"but carries {len(data)}")
    return np.frombuffer(data, dtype.dtype).reshape(shape, order=order)


# What a pickle may name: (module, name) -> our stand-in. numpy 2 moved `core` to `_core`.
ALLOWED = {
    ("numpy", "dtype"): Dtype,
    ("numpy", "ndarray"): NdarrayClass,
    **{(f"numpy.{core}.multiarray", "_reconstruct"): reconstruct for core in ("_core", "core")},
    **{(f"numpy.{core}.multiarray", "scalar"): scalar for core in ("_core", "core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): frombuffer for core in ("_core", "core")},
    **records.PICKLED_NAMES,
}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise Refused(f"the global {module}.{name} (not on the allow-list)") from None

    def persistent_load(self, pid):
        raise Refused("a persistent id")


def scan(data: bytes) -> None:
    """Refuses, without executing anything, what the unpickler must never see (module docstring)."""
    depth = opcodes = 0
    end = None
    try:
        for opcode, arg, position in pickletools.genops(data):
            opcodes += 1
            if opcodes > MAX_OPCODES:
                raise Refused(f"a pickle of more than {MAX_OPCODES} opcodes")
            if opcode.name in REFUSED_OPCODES:
                raise Refused(f"{REFUSED_OPCODES[opcode.name]} ({opcode.name} opcode)")
            if opcode.name in MEMO_PUTS and not 0 <= arg <= MAX_MEMO_INDEX:
                raise Refused(f"memo index {arg} (at most {MAX_MEMO_INDEX})")
            if opcode.name == "MARK":
                depth += 1
                if depth > MAX_DEPTH:
                    raise Refused(f"nesting deeper than {MAX_DEPTH}")
            elif pickletools.markobject in opcode.stack_before:
                depth -= 1
            if opcode.name == "STOP":
                end = position + 1
    except ValueError as e:  # genops' own complaints: truncated data, unknown opcodes (Refused is one too)
        raise e if isinstance(e, Refused) else Refused(f"a malformed pickle ({e})") from None
    if end != len(data):
        raise Refused("bytes after the pickle's end")


def loads(data: bytes):
    """The object `data` pickles, as plain values and records' classes, or Refused."""
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise Refused("an empty message")
    scan(data)
    try:
        built = RestrictedUnpickler(io.BytesIO(data)).load()
    except Refused:
        raise
    except RecursionError:
        raise Refused(f"nesting deeper than {MAX_DEPTH}") from None
    except Exception as e:  # noqa: BLE001 - malformed data: anything the unpickler raises is a refusal
        raise Refused(f"a malformed pickle ({type(e).__name__}: {e})") from None
    try:
        return materialize(built)
    except Refused:
        raise
    except ValueError as e:  # a record's fields
        raise Refused(str(e)) from None


def materialize(value, depth: int = 0, counter: list | None = None):
    """Plain values (dict with str keys, list, tuple, str, bytes, numbers, None, ndarray) and the
    records' classes, checked; anything else is refused."""
    counter = counter if counter is not None else [0]
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise Refused(f"more than {MAX_NODES} values")
    if depth > MAX_DEPTH:
        raise Refused(f"nesting deeper than {MAX_DEPTH}")
    if value is None or type(value) in (bool, int, float, str, bytes, np.ndarray):
        return value
    if type(value) is ArrayUnderConstruction:
        if value.array is None:
            raise Refused("a numpy array without its data")
        return value.array
    if type(value) is dict:
        if not all(type(k) is str for k in value):
            raise Refused("a dict with keys that are not strings")
        return {k: materialize(v, depth + 1, counter) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(materialize(v, depth + 1, counter) for v in value)
    if isinstance(value, records.Record):
        return value.materialize(lambda v: materialize(v, depth + 1, counter))
    if type(value) is records.FeatureType:
        return value
    raise Refused(f"a value of type {type(value).__name__}")
