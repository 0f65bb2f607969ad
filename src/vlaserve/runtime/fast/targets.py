"""Which GPUs the fast path supports, with what: the support matrix (docs/gpus.md).

Per compute capability: the per-block limits the Triton kernels must fit (shared memory a block
may opt in to, registers per thread and per block, threads per block: the CUDA C++ Programming
Guide, "Compute Capabilities", technical specifications table), the features the kernels use
(TMA descriptors and programmatic dependent launch from sm90 on, as kernels.pdl_enabled /
tma_enabled gate them; FP8 tensor cores from sm89 on, which precision fp8 needs) and the
launch table the kernels take their tiles, warps and stages from.

The launch tables themselves are in launch_tables.py (this module imports no Triton: the startup
decision is made before the fast path loads). docs/gpus.md says which targets were measured; every
launch table is compiled and resource-checked by tests/test_gpu_targets.py.

Below sm80 (no bf16 tensor cores) the fast path does not run: the eager model serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...errors import ConfigError

log = logging.getLogger(__name__)

KB = 1024


@dataclass(frozen=True)
class Target:
    """One compute capability of the support matrix."""

    capability: int  # major * 10 + minor: 90 = sm_90
    gpus: str  # examples, for messages and docs
    launch_table: str  # a key of LAUNCH_TABLES
    shared_per_block: int  # bytes a block may opt in to
    integrated: bool = False  # Jetson: the GPU shares the board's memory with the CPU
    registers_per_thread: int = 255
    registers_per_block: int = 64 * KB
    threads_per_block: int = 1024

    @property
    def name(self) -> str:
        return f"sm{self.capability}"

    @property
    def tma(self) -> bool:
        """TMA descriptors for the attention's tiles (the tensor memory accelerator: sm90+)."""
        return self.capability >= 90

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch between the expert's kernels (sm90+)."""
        return self.capability >= 90

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores (sm89+): precision fp8's GEMMs (torch._scaled_mm) and its Triton kernels'
        e4m3 type; refused elsewhere (require_fp8)."""
        return self.capability >= 89

    @property
    def cute_libraries(self) -> bool:
        """Whether --gemm-library quack / --attention-library fa4 may run: the pinned versions build
        for Hopper (sm90a) and datacenter Blackwell (sm100a) only."""
        return self.capability in (90, 100)


TARGETS = {t.capability: t for t in (
    Target(80, "A100, A30", "sm80", 163 * KB),
    Target(86, "RTX 3090, RTX A6000, A10", "sm89", 99 * KB),
    Target(87, "Jetson AGX Orin, Orin NX / Nano", "sm80", 163 * KB, integrated=True),
    Target(89, "RTX 4090, L40S, L4", "sm89", 99 * KB),
    Target(90, "H100, H200, GH200", "sm90", 227 * KB),
    Target(100, "B200, GB200", "sm100", 227 * KB),
    Target(110, "Jetson AGX Thor", "sm100", 227 * KB, integrated=True),
    Target(120, "RTX 5090, RTX PRO 6000", "sm89", 99 * KB),
)}

MIN_CAPABILITY = 80  # bf16 tensor cores; below, the eager model serves

def target_for(capability: tuple[int, int]) -> Target | None:
    """The matrix's entry for a (major, minor) capability: its own, else the nearest lower one of
    the same major (sm_103 runs sm100's), else the newest one below (a new major); None below sm80."""
    cap = capability[0] * 10 + capability[1]
    if cap < MIN_CAPABILITY:
        return None
    known = [c for c in TARGETS if c <= cap and c // 10 == capability[0]]
    if not known:
        known = [c for c in TARGETS if c <= cap]
    return TARGETS[max(known)]


def device_target(device: torch.device) -> Target | None:
    """The matrix's entry for `device`'s GPU; None off CUDA or below sm80."""
    if device.type != "cuda":
        return None
    return target_for(torch.cuda.get_device_capability(device))


def choose_target(device: torch.device) -> Target | None:
    """The fast path's target for a CUDA device; None below sm80 (the eager model serves). Logs one
    line: the GPU, its capability and the path chosen."""
    major, minor = torch.cuda.get_device_capability(device)
    gpu = f"GPU {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    target = target_for((major, minor))
    if target is None:
        log.warning("%s: eager model; the fast path needs sm80 or newer (bf16 tensor cores)", gpu)
        return None
    features = ", ".join(f for f, on in (("TMA", target.tma), ("PDL", target.pdl)) if on) or "no TMA, no PDL"
    shared = "; memory shared with the CPU" if target.integrated else ""
    log.info("%s: fast path, %s launch table, %s%s", gpu, target.launch_table, features, shared)
    return target


def require_cute(device: torch.device, option: str, default: str) -> None:
    """Raises ConfigError naming `option` unless the device runs the CuTe DSL libraries (sm90, sm100);
    default: the option that does without them."""
    cuda = device.type == "cuda"
    major, minor = torch.cuda.get_device_capability(device) if cuda else (0, 0)
    target = target_for((major, minor)) if cuda else None
    if target is None or not target.cute_libraries:
        found = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})" if cuda else f"the {device.type} device"
        raise ConfigError(f"{option} runs on Hopper (sm90) and datacenter Blackwell (sm100) GPUs only, not on "
                          f"{found}: serve with {default}")


def require_fp8(device: torch.device, precision: str) -> None:
    """Raises ConfigError unless a CUDA device has FP8 tensor cores (sm89+). Without them neither
    torch._scaled_mm nor the fast path's e4m3 kernels run there, and fp8 computed by dequantizing
    (model/fp8.py's emulation, the CPU's path) would be slower than bf16. Other devices pass."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    target = target_for((major, minor))
    if target is None or not target.fp8:
        raise ConfigError(f"precision {precision!r} needs FP8 tensor cores (compute capability 8.9 or later: Ada, "
                          f"Hopper, Blackwell), which {torch.cuda.get_device_name(device)} (sm_{major}{minor}) "
                          "lacks: serve with --precision bf16")
