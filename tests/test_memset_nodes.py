"""The captured graphs' memset nodes as fill kernels (runtime/fast/memset_nodes.py): the launch each memset
becomes, on the CPU; on a GPU, a graph with memsets among its kernels, edited, writes the same bytes."""

import ctypes
import os
import subprocess

import pytest
import torch

from vlaserve.runtime.fast.memset_nodes import FILL_THREADS, MAX_GRID_Y, PTX, fill_for


@pytest.mark.parametrize("size,bits", [(1, 8), (2, 16), (4, 32)])
def test_a_memset_becomes_the_fill_kernel_of_its_element_size(size, bits):
    """One row of 4 elements (cuDNN's and cuBLASLt's): one block of FILL_THREADS, the value cut to the element
    size as the memset cuts it (cuMemsetD8 takes the low byte of the value it is given)."""
    fill = fill_for(size, 4, 1, 0, 0xA1B2C3D4)
    assert fill.kernel == f"vlaserve_fill_b{bits}" and fill.kernel in PTX
    assert fill.grid == (1, 1) and fill.width == 4 and fill.pitch == 0
    assert fill.value == 0xA1B2C3D4 & ((1 << bits) - 1)


def test_rows_and_blocks_cover_the_memset():
    """A 2D memset: a grid row per memset row, rows `pitch` bytes apart; enough blocks for every element of a
    row and no more."""
    fill = fill_for(4, FILL_THREADS + 1, 3, 4096, 7)
    assert fill.grid == (2, 3) and fill.pitch == 4096
    assert fill_for(4, FILL_THREADS, 1, 4096, 7).grid == (1, 1)
    assert fill_for(4, FILL_THREADS, 1, 4096, 7).pitch == 0  # one row: the pitch is never read


@pytest.mark.parametrize("args", [(8, 4, 1, 0, 0), (3, 4, 1, 0, 0), (4, 0, 1, 0, 0), (4, 4, 0, 0, 0),
                                  (4, 4, MAX_GRID_Y + 1, 16, 0)])
def test_a_memset_no_kernel_covers_stays(args):
    """Element sizes other than 1, 2, 4 bytes, nothing to write, or more rows than a grid holds: no fill (the
    node stays a memset)."""
    assert fill_for(*args) is None


def test_where_the_driver_refuses_the_graph_keeps_its_memsets_and_the_log_says_so(monkeypatch, caplog):
    """An edit the driver refuses (raised as CudaError) leaves the graph as captured, slower to launch but
    computing the same: serving goes on, and the log says it once per distinct error."""
    from vlaserve.runtime.fast import memset_nodes

    def refused(graph):
        raise memset_nodes.CudaError("cuModuleLoadData failed: CUresult 218")

    monkeypatch.setattr(memset_nodes, "replace_memsets", refused)
    memset_nodes._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger=memset_nodes.__name__):
        assert memset_nodes.memsets_as_kernels(1234) == (0, 0)
        assert memset_nodes.memsets_as_kernels(5678) == (0, 0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "CUresult 218" in warnings[0]


def _ptxas() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton's bundled ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_fill_kernels_ptx_assembles(tmp_path, arch):
    """The PTX the driver compiles when the module loads, assembled here by Triton's ptxas (as the driver would
    for an Ampere or Hopper GPU): every fill kernel is in it, each with its four parameters."""
    source = tmp_path / "fill.ptx"
    source.write_text(PTX)
    done = subprocess.run([_ptxas(), f"-arch={arch}", str(source), "-o", str(tmp_path / "fill.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for bits in (8, 16, 32):
        assert f".entry vlaserve_fill_b{bits}(.param .u64 dst, .param .u64 pitch, .param .u32 value, .param .u64 width)" in PTX


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")
def test_on_a_gpu_a_graph_with_memsets_writes_the_same_bytes_with_fill_kernels():
    """Memsets of 1, 2 and 4-byte elements (one row, and 2D with a pitch) recorded between kernels that read
    what they wrote: the graph edited has no memset node left and gives the same bytes, replay after replay."""
    from vlaserve.runtime.graphs import _Graph

    cudart = next(ctypes.CDLL(line.split()[-1]) for line in open("/proc/self/maps") if "libcudart" in line)
    driver = ctypes.CDLL("libcuda.so.1")
    typed = {1: driver.cuMemsetD2D8Async, 2: driver.cuMemsetD2D16Async, 4: driver.cuMemsetD2D32Async}
    scratch = torch.zeros(64 * 1024, dtype=torch.uint8, device="cuda")
    out = torch.zeros(6, 64 * 1024, dtype=torch.uint8, device="cuda")
    # (offset, element size, width, height, pitch, value): the first through cudaMemsetAsync, as the libraries
    # call it; the rest through the driver's typed 2D memsets.
    memsets = [(0, 1, 4, 1, 4, 0xAB), (64, 2, 33, 1, 66, 0x1234), (512, 4, 300, 1, 1200, 0xDEADBEEF),
               (4096, 4, 5, 3, 1024, 0x01020304), (16384, 1, 700, 2, 2048, 0x7F), (32768, 4, 1, 1, 4, 0)]

    def record():
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for i, (offset, size, width, height, pitch, value) in enumerate(memsets):
            scratch.add_(1)  # a kernel before: the memset's bytes overwrite its result where they land
            dst = scratch.data_ptr() + offset
            if i == 0:
                assert cudart.cudaMemsetAsync(ctypes.c_void_p(dst), value, ctypes.c_size_t(width), stream) == 0
            else:
                assert typed[size](ctypes.c_uint64(dst), ctypes.c_size_t(pitch), ctypes.c_uint(value),
                                   ctypes.c_size_t(width), ctypes.c_size_t(height), stream) == 0
            out[i].copy_(scratch)  # a kernel after: reads the bytes the memset left
        return out

    stream = torch.cuda.Stream()
    results = []
    def as_captured():  # the graph with its memset nodes, as torch captures it
        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain, stream=stream):
            record()
        return plain

    for edit in (False, True):
        scratch.zero_(), out.zero_()
        graph = _Graph(record, torch.cuda.graph_pool_handle(), stream) if edit else as_captured()
        if edit:
            assert (graph.memsets_replaced, graph.memsets_left) == (len(memsets), 0)
        replays = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            replays.append(out.clone())
        results.append(replays)
    for plain, edited in zip(*results):
        assert torch.equal(plain, edited)
    assert not torch.equal(results[0][0], results[0][1])  # each replay's kernels moved the bytes: compared apart


class _FakeDriver:
    """The driver calls replace_memsets makes, on a graph held here as nodes and edges (the CUDA driver's
    semantics: a node's dependencies are the nodes with an edge into it; destroying a node drops its edges)."""

    def __init__(self, nodes: dict[int, tuple], edges: set[tuple[int, int]], refuse: str | None = None):
        self.nodes, self.edges, self.refuse = dict(nodes), set(edges), refuse
        self.next_id = 1000
        self.functions = {}

    def _fail(self, name):
        return 999 if self.refuse == name else 0

    @staticmethod
    def _out(nodes, array, count):
        count._obj.value = len(nodes)
        if array is not None:
            for i, n in enumerate(nodes):
                array[i] = n
        return 0

    def cuCtxGetCurrent(self, context):
        context._obj.value = 77
        return 0

    def cuModuleLoadData(self, module, image):
        assert b"vlaserve_fill_b32" in image.value
        module._obj.value = 5
        return 0

    def cuModuleGetFunction(self, function, module, name):
        self.functions[name.decode()] = function._obj.value = 500 + len(self.functions)
        return 0

    def cuGraphGetNodes(self, graph, array, count):
        return self._out(sorted(self.nodes), array, count)

    def cuGraphNodeGetType(self, node, kind):
        kind._obj.value = {"kernel": 0, "memset": 2}[self.nodes[node.value][0]]
        return 0

    def cuGraphMemsetNodeGetParams(self, node, params):
        for field, value in self.nodes[node.value][1].items():
            setattr(params._obj, field, value)
        return 0

    def cuGraphNodeGetDependencies(self, node, array, count):
        return self._out(sorted(a for a, b in self.edges if b == node.value), array, count)

    def cuGraphNodeGetDependentNodes(self, node, array, count):
        return self._out(sorted(b for a, b in self.edges if a == node.value), array, count)

    def cuGraphAddKernelNode(self, node, graph, deps, ndeps, params):
        p = params._obj
        values = [ctypes.cast(p.kernelParams[i], ctypes.POINTER(t)).contents.value
                  for i, t in enumerate((ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64))]
        self.next_id += 1
        node._obj.value = self.next_id
        self.nodes[self.next_id] = ("kernel", {"func": p.func, "grid": (p.gridDimX, p.gridDimY, p.gridDimZ),
                                               "block": (p.blockDimX, p.blockDimY, p.blockDimZ), "args": values})
        self.edges |= {(deps[i], self.next_id) for i in range(ndeps.value)}
        return 0

    def cuGraphAddDependencies(self, graph, sources, targets, n):
        if self.refuse == "cuGraphAddDependencies":
            return 999
        self.edges |= {(sources[i], targets[i]) for i in range(n.value)}
        return 0

    def cuGraphDestroyNode(self, node):
        del self.nodes[node.value]
        self.edges = {(a, b) for a, b in self.edges if node.value not in (a, b)}
        return 0


def _memset(dst, size, width, height=1, pitch=0, value=0):
    return ("memset", {"dst": dst, "elementSize": size, "width": width, "height": height, "pitch": pitch, "value": value})


@pytest.fixture
def fake_driver(monkeypatch):
    from vlaserve.runtime.fast import memset_nodes

    def install(*args, **kwargs):
        driver = _FakeDriver(*args, **kwargs)
        monkeypatch.setattr(memset_nodes, "_driver", lambda: driver)
        memset_nodes._module.cache_clear(), memset_nodes._kernel.cache_clear()
        return driver

    yield install
    memset_nodes._module.cache_clear(), memset_nodes._kernel.cache_clear()


def test_each_memset_becomes_a_fill_kernel_on_its_edges(fake_driver):
    """A chain as the prefix graph's (a memset between two kernels), a memset at the root and one at the end,
    and one of 8-byte elements no fill covers: the covered ones become fill kernels with the memset's edges and
    arguments (its address, pitch, value cut to the element size as cudaMemsetAsync's int is, width; a block of
    FILL_THREADS per FILL_THREADS elements of a row, a grid row per row); the other stays as it was."""
    from vlaserve.runtime.fast.memset_nodes import replace_memsets

    nodes = {1: _memset(0x1000, 1, 4, value=0x5AB), 2: ("kernel", {}), 3: _memset(0x2000, 4, 300, 2, 1280, 7),
             4: ("kernel", {}), 5: _memset(0x3000, 8, 4), 6: ("kernel", {}), 7: _memset(0x4000, 2, 1, value=0x1234)}
    chain = {(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)}
    driver = fake_driver(nodes, chain)
    assert replace_memsets(42) == (3, 1)
    kinds = {n: kind for n, (kind, _) in driver.nodes.items()}
    assert [n for n, k in kinds.items() if k == "memset"] == [5]
    fills = {driver.nodes[n][1]["args"][0]: n for n in kinds if n > 1000}
    assert sorted(fills) == [0x1000, 0x2000, 0x4000]
    first, wide, last = fills[0x1000], fills[0x2000], fills[0x4000]
    assert driver.edges == {(first, 2), (2, wide), (wide, 4), (4, 5), (5, 6), (6, last)}
    f = driver.functions
    assert driver.nodes[first][1] == {"func": f["vlaserve_fill_b8"], "grid": (1, 1, 1), "block": (FILL_THREADS, 1, 1),
                                      "args": [0x1000, 0, 0xAB, 4]}
    assert driver.nodes[wide][1] == {"func": f["vlaserve_fill_b32"], "grid": (2, 2, 1), "block": (FILL_THREADS, 1, 1),
                                     "args": [0x2000, 1280, 7, 300]}
    assert driver.nodes[last][1]["func"] == f["vlaserve_fill_b16"] and driver.nodes[last][1]["args"] == [0x4000, 0, 0x1234, 1]


def test_a_refused_edge_leaves_the_memset_and_no_fill_beside_it(fake_driver):
    """The driver refuses the fill kernel's edge to the node after: the fill kernel is removed again (left in
    place it would run beside the node after it), the memset keeps its edges, and CudaError says which call."""
    from vlaserve.runtime.fast.memset_nodes import CudaError, replace_memsets

    nodes = {1: ("kernel", {}), 2: _memset(0x1000, 4, 4), 3: ("kernel", {})}
    driver = fake_driver(nodes, {(1, 2), (2, 3)}, refuse="cuGraphAddDependencies")
    with pytest.raises(CudaError, match="cuGraphAddDependencies failed"):
        replace_memsets(42)
    assert driver.nodes == nodes and driver.edges == {(1, 2), (2, 3)}


def test_the_runner_reports_what_its_graphs_edits_did(golden_policy, monkeypatch):
    """FastRunner.memset_nodes (the runtime's stats()["graphs"]["memset_nodes"]) holds the sum over the graphs it
    captured of the memsets each replaced, those it left and the seconds its edit took; a graph that raises while
    recording (a dropped capture) adds nothing. The graphs here are stand-ins reporting fixed figures."""
    from vlaserve.runtime import graphs as graphs_module
    from vlaserve.runtime.fast.precompile import KernelNotLoaded

    reports = iter([(44, 0, 0.25), (0, 0, 0.5), (3, 1, 0.125)])

    class Reporting:
        def __init__(self, fn, pool, stream):
            fn()
            self.memsets_replaced, self.memsets_left, self.edit_s = next(reports)

    def dropped():
        raise KernelNotLoaded("a kernel not loaded yet")

    monkeypatch.setattr(graphs_module, "_Graph", Reporting)
    runner = graphs_module.FastRunner(golden_policy.model, golden_policy.config, use_graphs=False, use_triton=False)
    assert runner.memset_nodes == {"replaced": 0, "left": 0, "edit_s": 0.0}
    for _ in range(3):
        runner.new_graph(lambda: None)
    with pytest.raises(KernelNotLoaded):
        runner.new_graph(dropped)
    assert runner.memset_nodes == {"replaced": 47, "left": 1, "edit_s": 0.875}
