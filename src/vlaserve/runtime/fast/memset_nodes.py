"""A captured CUDA graph's memset nodes replaced by kernel nodes that write the same bytes.

cuDNN's SDPA kernels and cuBLASLt's split-K GEMMs record a small `cudaMemsetAsync` ahead of themselves: dozens
of memset nodes in the batch-1 prefix graph. A graph launch costs the host a microsecond or two per memset node
and next to nothing per kernel node, and a lone robot's device waits for that launch. A fill kernel that stores the memset's value
into the same elements leaves the same bytes for the node after it, so what the graph computes is unchanged.

The graph is edited through the CUDA driver API (libcuda, loaded in every CUDA process) between its capture and
its instantiation (torch keeps it with `keep_graph=True`). The calls use the driver's unversioned symbols, which
keep their first signatures for programs built against older toolkits (newer headers map the names onto `_v2`
symbols), and the fill kernels are PTX that the driver compiles for the device when the module loads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

MEMSET_NODE = 2  # CU_GRAPH_NODE_TYPE_MEMSET
FILL_THREADS = 256
MAX_GRID_Y = 65535

# One kernel per element size: fill_bN(dst, pitch, value, width) stores `value` (its low N bits) into `width`
# elements of row blockIdx.y, which starts at dst + blockIdx.y * pitch: cuMemsetD2D's semantics.
_FILL = """
.visible .entry vlaserve_fill_b{bits}(.param .u64 dst, .param .u64 pitch, .param .u32 value, .param .u64 width)
{{
    .reg .pred %past;
    .reg .b16 %h;
    .reg .b32 %r<4>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [pitch];
    ld.param.u32 %r1, [value];
    ld.param.u64 %rd3, [width];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    mov.u32 %r2, %tid.x;
    cvt.u64.u32 %rd5, %r2;
    add.u64 %rd4, %rd4, %rd5;
    setp.ge.u64 %past, %rd4, %rd3;
    @%past bra DONE;
    mov.u32 %r2, %ctaid.y;
    cvt.u64.u32 %rd5, %r2;
    mad.lo.u64 %rd6, %rd5, %rd2, %rd1;
    mad.lo.u64 %rd7, %rd4, {size}, %rd6;
    cvta.to.global.u64 %rd7, %rd7;
    cvt.u16.u32 %h, %r1;
    {store}
DONE:
    ret;
}}
"""
_STORES = {1: "st.global.u8 [%rd7], %h;", 2: "st.global.u16 [%rd7], %h;", 4: "st.global.u32 [%rd7], %r1;"}
PTX = ".version 7.0\n.target sm_70\n.address_size 64\n" + "".join(
    _FILL.format(bits=8 * size, size=size, store=store) for size, store in _STORES.items())


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (the first version)
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.c_void_p)]


@dataclass(frozen=True)
class Fill:
    """The fill kernel launch that writes what one memset node writes."""

    kernel: str
    grid: tuple[int, int]
    pitch: int
    value: int
    width: int


def fill_for(element_size: int, width: int, height: int, pitch: int, value: int) -> Fill | None:
    """The launch for a memset of `height` rows of `width` elements of `element_size` bytes (rows `pitch`
    bytes apart), or None where no fill kernel covers it (another element size, too many rows, nothing)."""
    if element_size not in _STORES or width < 1 or not 1 <= height <= MAX_GRID_Y:
        return None
    return Fill(f"vlaserve_fill_b{8 * element_size}", (-(-width // FILL_THREADS), height),
                pitch if height > 1 else 0, value & ((1 << 8 * element_size) - 1), width)


class CudaError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str) -> None:
    if result != 0:
        raise CudaError(f"{call} failed: CUresult {result}")


@functools.lru_cache(maxsize=None)
def _module(context: int) -> ctypes.c_void_p:
    """The fill kernels' module, loaded into `context` (the one current: the cache key) once."""
    module = ctypes.c_void_p()
    _check(_driver().cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX.encode())), "cuModuleLoadData")
    return module


@functools.lru_cache(maxsize=None)
def _kernel(context: int, name: str) -> int:
    function = ctypes.c_void_p()
    _check(_driver().cuModuleGetFunction(ctypes.byref(function), _module(context), name.encode()),
           "cuModuleGetFunction")
    return function.value


def _current_context() -> int:
    context = ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    return context.value or 0


def _nodes(call, node_or_graph) -> list[int]:
    count = ctypes.c_size_t(0)
    _check(call(node_or_graph, None, ctypes.byref(count)), call.__name__)
    nodes = (ctypes.c_void_p * count.value)()
    _check(call(node_or_graph, nodes, ctypes.byref(count)), call.__name__)
    return [n for n in nodes[:count.value]]


def replace_memsets(graph: int) -> tuple[int, int]:
    """Replaces each memset node of the captured, not yet instantiated CUDA graph `graph` (a cudaGraph_t, as
    `torch.cuda.CUDAGraph.raw_cuda_graph` gives it) with a fill kernel node on the same edges -> (replaced,
    left: memsets no fill kernel covers). Raises CudaError where the driver refuses a step; the graph then
    computes what it captured all the same (a memset is removed only once its fill kernel stands on its edges)."""
    cuda = _driver()
    context = _current_context()
    replaced = left = 0
    for node in _nodes(cuda.cuGraphGetNodes, ctypes.c_void_p(graph)):
        node = ctypes.c_void_p(node)
        kind = ctypes.c_int(-1)
        _check(cuda.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != MEMSET_NODE:
            continue
        memset = _MemsetParams()
        _check(cuda.cuGraphMemsetNodeGetParams(node, ctypes.byref(memset)), "cuGraphMemsetNodeGetParams")
        fill = fill_for(memset.elementSize, memset.width, memset.height, memset.pitch, memset.value)
        if fill is None:
            left += 1
            continue
        args = (ctypes.c_uint64(memset.dst), ctypes.c_uint64(fill.pitch), ctypes.c_uint32(fill.value),
                ctypes.c_uint64(fill.width))
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args))
        params = _KernelParams(_kernel(context, fill.kernel), fill.grid[0], fill.grid[1], 1, FILL_THREADS, 1, 1, 0,
                               ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)), None)
        before = _nodes(cuda.cuGraphNodeGetDependencies, node)
        after = _nodes(cuda.cuGraphNodeGetDependentNodes, node)
        kernel = ctypes.c_void_p()
        _check(cuda.cuGraphAddKernelNode(ctypes.byref(kernel), ctypes.c_void_p(graph),
                                         (ctypes.c_void_p * len(before))(*before), ctypes.c_size_t(len(before)),
                                         ctypes.byref(params)), "cuGraphAddKernelNode")
        try:
            if after:
                _check(cuda.cuGraphAddDependencies(
                    ctypes.c_void_p(graph), (ctypes.c_void_p * len(after))(*[kernel.value] * len(after)),
                    (ctypes.c_void_p * len(after))(*after), ctypes.c_size_t(len(after))), "cuGraphAddDependencies")
        except CudaError:
            cuda.cuGraphDestroyNode(kernel)  # not left beside the memset, racing the node after it
            raise
        _check(cuda.cuGraphDestroyNode(node), "cuGraphDestroyNode")  # and its edges
        replaced += 1
    return replaced, left


def memsets_as_kernels(graph: int) -> tuple[int, int]:
    """`replace_memsets`, or where the driver refuses it (an old driver, say) the graph with the memsets it
    still has: a slower launch, the same results; said once in the log."""
    try:
        return replace_memsets(graph)
    except CudaError as e:
        _warn_once(str(e))
        return 0, 0


@functools.lru_cache(maxsize=None)
def _warn_once(error: str) -> None:
    log.warning("CUDA graphs keep their memset nodes (%s): each costs a launch more host time", error)
