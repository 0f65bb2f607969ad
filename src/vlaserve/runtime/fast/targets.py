"""Which GPUs the fast path supports, with what: the support matrix (docs/gpus.md).

Per compute capability: the per-block limits the Triton kernels must fit (shared memory a block
may opt in to, registers per thread and per block, threads per block: the CUDA C++ Programming
Guide, "Compute Capabilities", technical specifications table), the features the kernels use
(TMA descriptors and programmatic dependent launch from sm90 on, as kernels.pdl_enabled /
tma_enabled gate them; FP8 tensor cores from sm89 on, which vlaserve does not use yet) and the
launch table the kernels take their tiles, warps and stages from.

Launch tables are per shared-memory class, named after the GPU they are sized for:
- "sm90": the H200 sweeps' winners (kernels.TUNING as committed), for the 227 KB parts;
- "sm80": for 163 KB a block (A100, Jetson Orin);
- "sm89": for 99 KB a block (RTX 3090 / 4090 / 5090, L40S).
The sm80 and sm89 tables are the sm90 table with the entries that do not fit cut down by the
resource model (shared memory = stages x (row tile + column tile) x BLOCK_K x 2 bytes for the
GEMMs: fewer stages first, then a shallower K tile); tests/test_gpu_targets.py compiles every
kernel at every configuration for every target and checks each fits. Measured only on an H200.

Below sm80 (no bf16 tensor cores) the fast path does not run: the eager model serves.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from . import kernels

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
        """FP8 tensor cores (sm89+). Not used by vlaserve today: listed for the matrix."""
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
    Target(100, "B200, GB200", "sm90", 227 * KB),
    Target(110, "Jetson AGX Thor", "sm90", 227 * KB, integrated=True),
    Target(120, "RTX 5090, RTX PRO 6000", "sm89", 99 * KB),
)}

MIN_CAPABILITY = 80  # bf16 tensor cores; below, the eager model serves

# The H200 table: kernels.TUNING exactly as committed (its sweeps' winners), copied at import.
_SM90 = copy.deepcopy(kernels.TUNING)


def _override(table: dict, **families) -> dict:
    """`table` with the given GEMM families' configs updated: {"splitk": {...}, "batched": {rows: {family: {...}}}}."""
    out = copy.deepcopy(table)
    for family, changes in families.items():
        if family == "batched":
            for rows, per_family in changes.items():
                for name, cfg in per_family.items():
                    out["batched"][rows][name].update(cfg)
        else:
            out[family].update(changes)
    return out


# Without TMA (sm80-89) the attention's q / k / v tiles pass through registers on their way to
# shared memory: at 4 warps a 64-query tile, and at 8 warps a 128-query one, spill (128 and 84-252
# bytes a thread); 64 queries on 8 warps do not. So these tables take 64-query tiles on 8 warps
# (sm120 runs the sm89 table with TMA: the same 68 KB, no spills).
_ATTENTION_8_WARPS = {"block_m": 64, "warps": 8}

# 163 KB: the sm90 GEMM configurations fit as they are (batch 1's split-K GEMM, the largest, takes
# 144 KB); the attention as above, 64-key tiles (104 KB).
_SM80 = copy.deepcopy(_SM90)

# 99 KB. Triton keeps stages - 1 tiles of a GEMM's operands in shared memory: (stages - 1) x (row
# tile + column tiles) x BLOCK_K x 2 bytes. Batch 1's split-K GEMM (64 + 32) x 256 x 2 = 48 KB a
# stage: 3 stages (96 KB), not 4; GeGLU (64 + 2 x 32) x 128 x 2 = 32 KB: 4 stages, not 5; the
# 128-row split-K tiles (128 + 64) x 128 x 2 = 48 KB: 3 stages. The attention takes 32-key tiles
# (68 KB; 64-key tiles take 104 KB).
_SM89 = _override(
    _SM90,
    splitk={"stages": 3},
    geglu={"stages": 4},
    batched={200: {"splitk": {"stages": 3}}, 400: {"splitk": {"stages": 3}}},
)
for _table, _keys in ((_SM80, 64), (_SM89, 32)):
    for _cfg in (_table["attention"], *_table["attention_batched"].values(), _table["prefix_attention"],
                 *_table["prefix_attention_batched"].values()):
        _cfg.update(_ATTENTION_8_WARPS, block_t=_keys)

LAUNCH_TABLES = {"sm90": _SM90, "sm80": _SM80, "sm89": _SM89}


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


def use(target: Target) -> None:
    """Makes the kernels launch with `target`'s table and features (kernels.TUNING, process-wide).
    On an H200 `use(TARGETS[89])` forces the portable path: no TMA, no PDL, 99 KB tiles."""
    kernels.TUNING.clear()
    kernels.TUNING.update(copy.deepcopy(LAUNCH_TABLES[target.launch_table]))
    kernels.TUNING["pdl"], kernels.TUNING["tma"] = target.pdl, target.tma


def gpu_target(device: torch.device) -> Target | None:
    """The fast path's target for a CUDA device, its launch table put in use; None below sm80 (the
    eager model serves). Logs one line: the GPU, its capability and the path chosen."""
    major, minor = torch.cuda.get_device_capability(device)
    gpu = f"GPU {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    target = target_for((major, minor))
    if target is None:
        log.warning("%s: eager model; the fast path needs sm80 or newer (bf16 tensor cores)", gpu)
        return None
    use(target)
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
