"""`Actions.data`: a pickle of LeRobot's `list[TimedAction]`, written opcode by opcode.

LeRobot's client unpickles it into its own TimedAction dataclasses holding torch tensors, so the
pickle names LeRobot's class and torch's tensor rebuild exactly as `pickle.dumps` of those objects
does: a dataclass is NEWOBJ of its class plus a BUILD of its fields; a tensor is
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, OrderedDict())`, its
storage `torch.storage._load_from_bytes(<torch.save of the storage, legacy format>)`. The chunk's
rows share one storage, written once (each action a row view of it). Written by hand because
pickle itself can only name a class it can import, and the server never imports LeRobot.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings

import numpy as np
import torch

TIMED_ACTION = ("lerobot.async_inference.helpers", "TimedAction")
REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
LOAD_STORAGE = ("torch.storage", "_load_from_bytes")
ORDERED_DICT = ("collections", "OrderedDict")


class _Writer:
    def __init__(self):
        self.out = io.BytesIO()
        self.memo = 0

    def op(self, code: bytes, payload: bytes = b"") -> None:
        self.out.write(code + payload)

    def text(self, value: str) -> None:
        data = value.encode()
        self.op(pickle.SHORT_BINUNICODE if len(data) < 256 else pickle.BINUNICODE,
                bytes([len(data)]) if len(data) < 256 else struct.pack("<I", len(data)))
        self.out.write(data)

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.op(pickle.BININT1, bytes([value]))
        elif -2**31 <= value < 2**31:
            self.op(pickle.BININT, struct.pack("<i", value))
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.op(pickle.LONG1, bytes([len(data)]) + data)

    def global_(self, name: tuple[str, str]) -> None:
        self.text(name[0])
        self.text(name[1])
        self.op(pickle.STACK_GLOBAL)

    def memoize(self) -> int:
        self.op(pickle.MEMOIZE)
        self.memo += 1
        return self.memo - 1

    def get(self, index: int) -> None:
        self.op(pickle.LONG_BINGET, struct.pack("<I", index))


def _storage_bytes(chunk: torch.Tensor) -> bytes:
    """What torch's TypedStorage.__reduce__ hands `_load_from_bytes`: torch.save of the storage."""
    rebuild, args = chunk.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation notice
        load, (data,) = args[0].__reduce__()
    if (rebuild.__module__, rebuild.__name__) != REBUILD_TENSOR or (load.__module__, load.__name__) != LOAD_STORAGE:
        raise RuntimeError(f"this torch pickles tensors with {rebuild.__module__}.{rebuild.__name__} and "
                           f"{load.__module__}.{load.__name__}, not what LeRobot's client expects")
    return data


def timed_actions(actions: np.ndarray, timestamp: float, timestep: int, dt: float) -> bytes:
    """A pickled list of TimedAction(timestamp + i*dt, timestep + i, actions[i] as a float32 tensor)."""
    chunk = torch.from_numpy(np.ascontiguousarray(actions, dtype=np.float32))
    steps, dim = chunk.shape
    w = _Writer()
    w.op(pickle.PROTO, bytes([4]))
    w.op(pickle.EMPTY_LIST)
    # The globals and the storage go to the memo first (popped off the stack), for every action to share.
    w.global_(TIMED_ACTION)
    timed_action = w.memoize()
    w.op(pickle.POP)
    w.global_(REBUILD_TENSOR)
    rebuild = w.memoize()
    w.op(pickle.POP)
    w.global_(ORDERED_DICT)
    ordered_dict = w.memoize()
    w.op(pickle.POP)
    w.global_(LOAD_STORAGE)
    data = _storage_bytes(chunk)
    w.op(pickle.BINBYTES, struct.pack("<I", len(data)) + data)
    w.op(pickle.TUPLE1)
    w.op(pickle.REDUCE)
    storage = w.memoize()
    w.op(pickle.POP)
    w.op(pickle.MARK)
    for i in range(steps):
        w.get(timed_action)
        w.op(pickle.EMPTY_TUPLE)
        w.op(pickle.NEWOBJ)
        w.op(pickle.EMPTY_DICT)
        w.op(pickle.MARK)
        w.text("timestamp")
        w.op(pickle.BINFLOAT, struct.pack(">d", timestamp + i * dt))
        w.text("timestep")
        w.integer(timestep + i)
        w.text("action")
        w.get(rebuild)
        w.op(pickle.MARK)
        w.get(storage)
        w.integer(i * dim)
        w.integer(dim)
        w.op(pickle.TUPLE1)
        w.integer(1)
        w.op(pickle.TUPLE1)
        w.op(pickle.NEWFALSE)
        w.get(ordered_dict)
        w.op(pickle.EMPTY_TUPLE)
        w.op(pickle.REDUCE)
        w.op(pickle.TUPLE)
        w.op(pickle.REDUCE)
        w.op(pickle.SETITEMS)
        w.op(pickle.BUILD)
    w.op(pickle.APPENDS)
    w.op(pickle.STOP)
    return w.out.getvalue()
