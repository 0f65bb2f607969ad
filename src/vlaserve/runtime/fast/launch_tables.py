"""Launch tables: the Triton kernels' tiles, warps and stages, one immutable table per architecture
family, handed to the object that launches the kernels (FastPi05 and its backends). targets.py's
matrix says which GPU takes which:
- "sm90": the sweeps' winners on an sm90 GPU, for the 227 KB parts (bench/tune_launch_tables.py);
- "sm100": sm90's for datacenter Blackwell and Thor (227 KB too), one entry changed;
- "sm80": for 163 KB a block (A100, Jetson Orin), without TMA;
- "sm89": for 99 KB a block (RTX 3090 / 4090 / 5090, L40S).
The sm80 and sm89 tables are the sm90 table with what does not fit cut down by the resource model
(not swept on those GPUs); tests/test_gpu_targets.py compiles every kernel at every configuration of
each table and checks it fits its targets' shared memory and registers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping

from .targets import Target


def _frozen(value):
    """A read-only deep view of nested dicts: a table is never assigned into after it is built."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    return value


def _thawed(value):
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class LaunchTable:
    """One family's launch configurations (read-only), and the kernels' hardware features: `pdl`
    (programmatic dependent launch) and `tma` (the attention's tiles through TMA descriptors), each
    None for "where the GPU has it" (sm90+; TMA in Triton's interpreter too, so CI runs that path)."""

    name: str
    configs: Mapping[str, Any]
    pdl: bool | None = None
    tma: bool | None = None
    batch_invariant: bool = False  # every launch's config a function of its weight's shape, never of the rows

    def __getitem__(self, family: str):
        return self.configs[family]

    def for_target(self, target: Target) -> "LaunchTable":
        """This table with `target`'s features (on an sm90 GPU, TARGETS[89]'s table runs the portable path:
        no TMA, no PDL, 99 KB tiles)."""
        return replace(self, pdl=target.pdl, tma=target.tma)

    def with_features(self, pdl: bool | None = None, tma: bool | None = None) -> "LaunchTable":
        return replace(self, pdl=pdl, tma=tma)

    def batch_invariant_table(self) -> "LaunchTable":
        """This table for `batch_invariant` serving: a GEMM's or attention's reduction order is chosen by its
        weight's shape (N, K) or the key count, never by the batch's rows. So every family takes its batch-1
        config at every row count (kernels._launch; split-K's splits those of one row tile), the attention its
        batch-1 key splits and tiles, no expert GEMM goes through cuBLAS (which picks its algorithm by M), the
        fused action step runs at every batch size, and the prefix's and SigLIP's GEMMs and SigLIP's attention
        take the fixed tiles of FIXED_TILES (backends.InvariantGemm / InvariantAttention). At batch 1 the
        expert's launches are the default table's."""
        out = _thawed(self.configs)
        out.update(attention_batched={}, prefix_attention_batched={}, cublas_from_batch={}, **FIXED_TILES)
        out["action"]["max_rows"] = float("inf")
        return replace(self, name=f"{self.name}-invariant", configs=_frozen(out), batch_invariant=True)

    def with_configs(self, **families) -> "LaunchTable":
        """A new table with the given families' configs replaced or updated ({"splitk": {...}, "batched":
        {rows: {family: {...}}}}): how the tuner and the tests try a configuration."""
        out = _thawed(self.configs)
        for family, changes in families.items():
            if family == "batched":
                for rows, per_family in changes.items():
                    for name, cfg in per_family.items():
                        out["batched"][rows][name].update(cfg)
            elif isinstance(out.get(family), dict) and isinstance(changes, Mapping):
                out[family].update(changes)
            else:
                out[family] = changes
        return replace(self, configs=_frozen(out))


# The sm90 sweeps (docs/performance.md). The single-tile GEMM configs hold for one row tile
# (batch 1: 50 rows); "batched" ones, by the row count they start at, for more rows, where each
# program covers `block_r` rows so that a weight tile is read once per 64 or 128 rows.
_SM90 = {
    "splitk": {"block_r": 64, "block_n": 32, "block_k": 256, "max_waves": 1, "warps": 4, "stages": 4},
    "geglu": {"block_r": 64, "block_n": 32, "block_k": 128, "warps": 4, "stages": 5},
    "qkv": {"block_r": 64, "block_n": 16, "block_k": 128, "warps": 4, "stages": 5},
    # The expert's attention (50 x 8 query rows per item, keys split across programs) at batch 1,
    # and from each batch size listed in "attention_batched" on (the largest key <= the batch).
    "attention": {"block_m": 64, "splits": 16, "block_t": 64, "warps": 4, "stages": 2},
    "attention_batched": {
        2: {"block_m": 64, "splits": 8, "block_t": 64, "warps": 4, "stages": 2},
        4: {"block_m": 64, "splits": 4, "block_t": 64, "warps": 4, "stages": 2},
        8: {"block_m": 128, "splits": 4, "block_t": 64, "warps": 8, "stages": 2},
    },
    # The attention's log-sum-exp merge of the key splits: queries per program.
    "merge": {"rows": 2, "warps": 4},
    # The prefix's attention at batch 1 (one key split: ~1,000 queries per head fill the GPU), and
    # from each batch size in "prefix_attention_batched" on.
    "prefix_attention": {"block_m": 64, "splits": 1, "block_t": 64, "warps": 4, "stages": 2},
    "prefix_attention_batched": {2: {"block_m": 128, "splits": 1, "block_t": 64, "warps": 8, "stages": 2}},
    # action_step up to max_rows rows (batch x horizon); past it the eager ops are faster.
    "action": {"block_r": 2, "block_k": 128, "block_w": 64, "programs": 128, "max_rows": 64, "unroll": 4},
    "batched": {
        # From 65 rows (batch 2 of a 50-step chunk), 200 (batch 4) and 400 (batch 8). block_n
        # None: the widest column tile (16..128) that still gives every SM a program across the
        # row tiles; warps None: 8 from 64-column tiles on.
        65: {"splitk": {"block_r": 64, "block_n": 64, "block_k": 128, "max_waves": 1, "warps": 4, "stages": 4},
             "geglu": {"block_r": 64, "block_n": 32, "block_k": 128, "warps": 4, "stages": 3},
             "qkv": {"block_r": 64, "block_n": 32, "block_k": 128, "warps": 8, "stages": 4}},
        200: {"splitk": {"block_r": 128, "block_n": 64, "block_k": 128, "max_waves": 1, "warps": 8, "stages": 4},
              "geglu": {"block_r": 128, "block_n": None, "block_k": 64, "stages": 3},
              "qkv": {"block_r": 128, "block_n": 32, "block_k": 64, "warps": 8, "stages": 4}},
        400: {"splitk": {"block_r": 128, "block_n": 64, "block_k": 128, "max_waves": 1, "warps": 4, "stages": 4},
              "geglu": {"block_r": 128, "block_n": None, "block_k": 64, "warps": 8, "stages": 3},
              "qkv": {"block_r": 128, "block_n": 64, "block_k": 64, "warps": 8, "stages": 4}},
    },
    # Expert GEMM families (kernels.EXPERT_GEMMS) that run through cuBLAS (F.linear, then our RoPE /
    # GeGLU / residual-norm kernel on its bf16 output: the same rounding points) from this batch size
    # on; the rest run our split-K / fused kernels.
    "cublas_from_batch": {"qkv": 4, "gate_up": 4},
}

# batch_invariant's own kernels (kernels.fixed_linear, kernels.fixed_vision_attention): one tile per operand
# dtype at every row count. 16-bit: (128 + 128) x 64 x 2 B = 32 KB a stage, 3 stages fit every target's shared
# memory (99 KB and up); fp32 (the patch embedding, multiplied in fp32): (64 + 64) x 32 x 4 B = 16 KB a stage.
# SigLIP's attention: 64 queries x 64 keys, its 72-wide heads padded to 128.
FIXED_TILES = {
    "fixed_gemm": {"half": {"block_r": 128, "block_n": 128, "block_k": 64, "warps": 8, "stages": 3},
                   "fp32": {"block_r": 64, "block_n": 64, "block_k": 32, "warps": 4, "stages": 2}},
    "fixed_attention": {"block_m": 64, "block_t": 64, "warps": 4, "stages": 2},
}

# Without TMA (sm80-89) the attention's q / k / v tiles pass through registers on their way to
# shared memory: at 4 warps a 64-query tile, and at 8 warps a 128-query one, spill; 64 queries on
# 8 warps do not. So these tables take 64-query tiles on 8 warps (sm120 runs the sm89 table with
# TMA: the same 68 KB, no spills).
_ATTENTION_8_WARPS = {"block_m": 64, "warps": 8}


def _portable(table: dict, keys: int) -> dict:
    """`table` with every attention config on 64-query tiles, 8 warps and `keys`-key tiles."""
    out = copy.deepcopy(table)
    for cfg in (out["attention"], *out["attention_batched"].values(), out["prefix_attention"],
                *out["prefix_attention_batched"].values()):
        cfg.update(_ATTENTION_8_WARPS, block_t=keys)
    return out


SM90 = LaunchTable("sm90", _frozen(_SM90))
# 163 KB: the sm90 GEMM configurations fit as they are (batch 1's split-K GEMM, the largest, takes
# 144 KB); the attention as above, 64-key tiles (104 KB).
SM80 = LaunchTable("sm80", _frozen(_portable(_SM90, 64)))
# 99 KB. Triton keeps stages - 1 tiles of a GEMM's operands in shared memory: (stages - 1) x (row
# tile + column tiles) x BLOCK_K x 2 bytes. Batch 1's split-K GEMM (64 + 32) x 256 x 2 = 48 KB a
# stage: 3 stages (96 KB), not 4; GeGLU (64 + 2 x 32) x 128 x 2 = 32 KB: 4 stages, not 5; the
# 128-row split-K tiles (128 + 64) x 128 x 2 = 48 KB: 3 stages. The attention takes 32-key tiles
# (68 KB; 64-key tiles take 104 KB).
SM89 = LaunchTable("sm89", _frozen(_portable(_SM90, 32))).with_configs(
    splitk={"stages": 3}, geglu={"stages": 4}, batched={200: {"splitk": {"stages": 3}}, 400: {"splitk": {"stages": 3}}})
# sm100 / sm110 (227 KB): every sm90 entry fits, but batch 4's 128 x 64 split-K tile on 8 warps
# spills 28 bytes a thread there (ptxas for sm_100a / sm_110a); on 4 warps, as batch 8's, it does not.
SM100 = replace(SM90, name="sm100").with_configs(batched={200: {"splitk": {"warps": 4}}})

LAUNCH_TABLES = {t.name: t for t in (SM90, SM100, SM80, SM89)}


def table_for(target: Target) -> LaunchTable:
    """The launch table `target` runs, with its features."""
    return LAUNCH_TABLES[target.launch_table].for_target(target)
