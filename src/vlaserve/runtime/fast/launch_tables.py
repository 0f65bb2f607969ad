"""Launch tables per architecture family: the Triton kernels' tiles, warps and stages, by the
shared memory a block may use (targets.py's matrix says which GPU takes which):
- "sm90": the H200 sweeps' winners (kernels.TUNING as committed), for the 227 KB parts;
- "sm100": sm90's for datacenter Blackwell and Thor (227 KB too), one entry changed;
- "sm80": for 163 KB a block (A100, Jetson Orin), without TMA;
- "sm89": for 99 KB a block (RTX 3090 / 4090 / 5090, L40S).
The sm80 and sm89 tables are the sm90 table with what does not fit cut down by the resource model
(not swept on those GPUs); tests/test_gpu_targets.py compiles every kernel at
every configuration for every target and checks each fits its shared memory and registers.
"""

from __future__ import annotations

import copy

from . import kernels
from .targets import Target


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

# sm100 / sm110 (227 KB): every sm90 entry fits, but batch 4's 128 x 64 split-K tile on 8 warps
# spills 28 bytes a thread there (ptxas for sm_100a / sm_110a); on 4 warps, as batch 8's, it does not.
_SM100 = _override(_SM90, batched={200: {"splitk": {"warps": 4}}})

LAUNCH_TABLES = {"sm90": _SM90, "sm100": _SM100, "sm80": _SM80, "sm89": _SM89}


def use_launch_table(target: Target) -> None:
    """Makes the kernels launch with `target`'s table and features (kernels.TUNING, process-wide).
    On an H200 `use_launch_table(TARGETS[89])` forces the portable path: no TMA, no PDL, 99 KB tiles."""
    kernels.TUNING.clear()
    kernels.TUNING.update(copy.deepcopy(LAUNCH_TABLES[target.launch_table]))
    kernels.TUNING["pdl"], kernels.TUNING["tma"] = target.pdl, target.tma
