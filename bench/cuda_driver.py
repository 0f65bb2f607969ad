"""CUDA C++ kernels for the probes: built by nvcc to a cubin, loaded and launched through the
driver API by ctypes (cuLaunchKernelEx, optionally with the programmatic-serialization attribute so
that a launch pairs with the Triton kernels' PDL). Used by cuda_splitk.py and persistent_cuda.py.

A ctypes pitfall cost run 95 a device call: a launch attribute's value must be a real int field of
the structure. A `memmove` into a `c_char * 64` field writes into the temporary `bytes` object that
reading the field returns (the shared empty b''), and corrupts the interpreter.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch


class LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, then a 64-byte value union (here its int)
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_ubyte * 60)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
PREFERRED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent of the maximum)


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: CUresult {code}")


def compile_cubin(source: str, arch: str = "sm_90a") -> tuple[bytes, str, float]:
    """nvcc -cubin of `source`: (the image, ptxas's report, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.cubin"
        src.write_text(source)
        started = time.time()
        done = subprocess.run(["nvcc", "-cubin", "-O3", f"-gencode=arch=compute_{arch[3:]},code={arch}",
                               "-Xptxas", "-v", "-o", str(cubin), str(src)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-4000:])
        return cubin.read_bytes(), done.stderr, time.time() - started


class CudaModule:
    """A cubin's kernels, loaded into the current CUDA context (torch's primary one)."""

    def __init__(self, source: str):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        image, self.build_log, self.build_s = compile_cubin(source)
        torch.zeros(1, device="cuda")  # the primary context is current
        self.module = ctypes.c_void_p()
        _check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), image), "cuModuleLoadData")
        self.funcs: dict[str, ctypes.c_void_p] = {}

    def function(self, name: str, shared: int = 0, carveout: int | None = None) -> ctypes.c_void_p:
        """The kernel `name`, allowed `shared` bytes of dynamic shared memory."""
        if name not in self.funcs:
            f = ctypes.c_void_p()
            _check(self.cuda.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()), "cuModuleGetFunction")
            _check(self.cuda.cuFuncSetAttribute(f, MAX_DYNAMIC_SHARED, shared), "cuFuncSetAttribute")
            if carveout is not None:
                _check(self.cuda.cuFuncSetAttribute(f, PREFERRED_CARVEOUT, carveout), "cuFuncSetAttribute")
            self.funcs[name] = f
        return self.funcs[name]

    def registers(self, name: str) -> int:
        count = ctypes.c_int()
        _check(self.cuda.cuFuncGetAttribute(ctypes.byref(count), 4, self.funcs[name]),  # CU_FUNC_ATTRIBUTE_NUM_REGS
               "cuFuncGetAttribute")
        return count.value

    def launch(self, func: ctypes.c_void_p, grid: tuple[int, int, int], threads: int, shared: int, args: list,
               pdl: bool = False) -> None:
        """func<<<grid, threads, shared>>>(*args) on torch's current stream. args: ctypes values
        (c_void_p for pointers, c_int, ...), kept alive by the caller until the launch returns."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), shared,
                           ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                           ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
        _check(self.cuda.cuLaunchKernelEx(ctypes.byref(cfg), func, params, None), "cuLaunchKernelEx")
