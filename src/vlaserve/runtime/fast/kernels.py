"""Triton kernels for the action expert's Euler steps (the latency-bound part of a call): their launches
and configurations here, their device code in kernel_code.py.

At batch 1 an expert GEMM has 50 rows: stock kernels tile over N only and leave most SMs idle,
reading the weights far below memory bandwidth. These kernels split K as well, and fuse what
follows each GEMM into the pass that reduces its partial sums:
- qkv:     split-K GEMM -> reduce + RoPE + write q, and k/v straight into the K/V cache tail
- attention: MQA with the 8 query heads folded into one query axis, keys split across programs,
           then a log-sum-exp merge; the prefix's attention too (one split); on Hopper the q/k/v
           tiles come in through TMA descriptors
- o, down: split-K GEMM -> reduce + gated residual + the next AdaRMS norm (one row per program)
- gate_up: one GEMM with both halves in the same program -> GeGLU in the epilogue
- action in/out: the fp32 projections between the expert and the Euler update, with the update
           (and real-time chunking's guidance) in between: one kernel per step
Partial sums are written, not atomically added, so results are bit-reproducible. Every launch takes
its configuration from a LaunchTable (launch_tables.py) passed in: the sm90 table by default.

On Hopper the expert kernels are launched with programmatic dependent launch (PDL): kernel k+1 is
launched and its programs placed on the SMs while kernel k runs; each waits
(`griddepcontrol.wait`) before its first load, so it still computes only after its predecessor
has finished and written everything: PDL hides the launch, never changes a result (variants that
read weights before the wait measured slower: docs/performance.md).
"""

from __future__ import annotations

import os

import torch

from ...model.fp8 import E4M3, QuantizedRows
from .kernel_code import gdc_wait, triton
from .launch_tables import SM90, LaunchTable

if triton is not None:
    from .kernel_code import (_action_step, _fixed_gemm, _fixed_mha, _geglu_gemm, _geglu_rows, _gelu_flat, _mqa_merge,
                              _mqa_split, _qkv_rope, _qkv_rope_gemm, _residual_layer_norm, _residual_norm, _splitk_gemm)

try:  # Triton >= 3.4 (torch 2.11 ships 3.6)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


def interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs the kernels on the CPU (its interpreter; tests only)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None and (torch.cuda.is_available() or interpreted())


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _hopper() -> bool:
    """An NVIDIA GPU of compute capability 9 or later (PDL, TMA)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pdl_enabled(table: LaunchTable = SM90) -> bool:
    if gdc_wait is None:
        return False
    if table.pdl is not None:
        return table.pdl
    return not interpreted() and _hopper()


def tma_enabled(table: LaunchTable = SM90) -> bool:
    """Whether the attention loads its tiles through TMA descriptors: None = where the GPU has the
    copy engine for them (sm90+; the interpreter too, so that CI runs this path), else as given."""
    if TensorDescriptor is None:
        return False
    if table.tma is not None:
        return table.tma
    return interpreted() or _hopper()


def _rows_descriptor(x: torch.Tensor, rows: int):
    """A TMA descriptor over x [B, N, D] (rows contiguous) that loads [1, rows, D] boxes."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, x.shape[2]])


def launch_options(pdl: bool = False) -> dict:
    """Every launch's options. FP fusion pinned on: Triton contracts a * b + c into one FMA (one rounding,
    not two) by default, and every gate of these kernels' bits (golden cases, bit-identical actions) was
    measured so; Triton 3.9 warns that the default turns off in 3.10, and TRITON_DEFAULT_FP_FUSION in
    the environment moves it too (TRITON_FORCE_DISABLE_FP_FUSION, a debugging switch, still wins). PDL's
    option only when on (older Triton has no such option)."""
    return {"enable_fp_fusion": True, **({"launch_pdl": True} if pdl else {})}


EXPERT_GEMMS = ("qkv", "o", "gate_up", "down")


def through_cublas(family: str, batch: int, table: LaunchTable = SM90) -> bool:
    """Whether the expert's `family` GEMM (one of EXPERT_GEMMS) runs through cuBLAS at this batch size."""
    if family not in EXPERT_GEMMS:
        raise KeyError(family)
    start = table["cublas_from_batch"].get(family)
    return start is not None and batch >= start


def batched_config(rows: int, table: LaunchTable = SM90) -> dict:
    """The batched GEMM configs for `rows` rows: the entry with the largest start <= rows (or the
    first entry)."""
    batched = table["batched"]
    starts = [r for r in batched if r <= rows]
    return batched[max(starts) if starts else min(batched)]


def _launch(name: str, rows: int, columns: int, table: LaunchTable, programs: int = 128) -> tuple[dict, int]:
    """The launch config of GEMM family `name` for `rows` x `columns` outputs, and its rows per
    program. One row tile (batch 1) has its own tuned config; more rows take the "batched" table's
    row tiles, and column tiles sized for about `programs` programs (one per SM of a 132-SM sm90 part)
    where its block_n is None. A batch-invariant table takes the single-tile config at every row count."""
    single = table[name]
    if table.batch_invariant:
        return single, single["block_r"]
    if rows <= single["block_r"]:
        return single, max(16, _pow2(rows))
    cfg = dict(batched_config(rows, table)[name])
    block_r = cfg["block_r"]
    if cfg["block_n"] is None:
        wide = columns * -(-rows // block_r) // programs
        cfg["block_n"] = min(128, max(16, 1 << max(wide, 1).bit_length() - 1))
    if cfg.get("warps") is None:
        cfg["warps"] = 8 if cfg["block_n"] >= 64 else 4
    return cfg, block_r


def _split_k(cfg: dict, block_r: int, n: int, k: int, rows: int, num_sms: int = 132) -> int:
    """How many K splits: doubled until the grid (column tiles x row tiles x splits) fills about
    `max_waves` waves."""
    tiles = -(-n // cfg["block_n"]) * -(-rows // block_r)
    splits = 1
    while tiles * splits * 2 <= cfg["max_waves"] * num_sms and k % (splits * 2 * cfg["block_k"]) == 0:
        splits *= 2
    return splits


def splitk_partials(x2d: torch.Tensor, w: torch.Tensor, table: LaunchTable = SM90) -> torch.Tensor:
    """x2d [R, K] bf16, w [N, K] -> fp32 partial sums [splits, R, N]."""
    r, k = x2d.shape
    n = w.shape[0]
    cfg, block_r = _launch("splitk", r, n, table)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    # batch-invariant: the splits of one row tile, whatever the rows (a function of N and K only)
    splits = _split_k(cfg, block_r, n, k, block_r if table.batch_invariant else r)
    out = torch.empty(splits, r, n, dtype=torch.float32, device=x2d.device)
    pdl = pdl_enabled(table)
    _splitk_gemm[(triton.cdiv(n, block_n), splits, triton.cdiv(r, block_r))](
        x2d, w, out, r, n, k, k // splits, x2d.stride(0), w.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options(pdl))
    return out


def supported(dims) -> bool:
    """The expert kernels tile K by up to 256 and norm power-of-two rows (Gemma dims)."""
    inner = (dims.width, dims.mlp_dim, dims.num_heads * dims.head_dim)
    return (available() and all(k % 256 == 0 for k in inner) and dims.width & (dims.width - 1) == 0
            and dims.head_dim % 32 == 0)


def geglu_linear(x2d: torch.Tensor, w_gate_up: torch.Tensor, table: LaunchTable = SM90) -> torch.Tensor:
    """gelu_tanh(x @ Wg^T) * (x @ Wu^T) with W = [Wg; Wu] ([2M, K]) -> [R, M] bf16."""
    r, k = x2d.shape
    m = w_gate_up.shape[0] // 2
    out = torch.empty(r, m, dtype=x2d.dtype, device=x2d.device)
    cfg, block_r = _launch("geglu", r, m, table)
    pdl = pdl_enabled(table)
    _geglu_gemm[(triton.cdiv(m, cfg["block_n"]), triton.cdiv(r, block_r))](
        x2d, w_gate_up, out, r, m, k, x2d.stride(0), w_gate_up.stride(0),
        BLOCK_R=block_r, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], PDL=pdl,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options(pdl))
    return out


def _norm_outputs(h2d: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm kernel's outputs for rows like h2d: a row in h's dtype, or (quantize) an e4m3 row and its
    scale; without quantize h stands in for the scales' pointer, which the kernel then never touches."""
    if not quantize:
        return torch.empty_like(h2d), h2d
    return (torch.empty(h2d.shape, dtype=E4M3, device=h2d.device),
            torch.empty(h2d.shape[0], 1, dtype=torch.float32, device=h2d.device))


def residual_norm(h2d, scale, shift=None, delta=None, gate=None, eps: float = 1e-6,
                  quantize: bool = False, table: LaunchTable = SM90) -> "torch.Tensor | QuantizedRows":
    """h += gate * delta in place (if delta), returns rms_norm(h) * scale (+ shift) [R, N]; with
    `quantize`, that quantized per row for an fp8 GEMM (the bits fp8_kernels.quantize_rows gives it).

    delta: fp32 split-K partials [S, R, N] or a [R, N] tensor in h's dtype; N a power of two.
    """
    y, scales = _norm_outputs(h2d, quantize)
    splits = 1 if delta is None or delta.dim() == 2 else delta.shape[0]
    pdl = pdl_enabled(table)
    _residual_norm[(h2d.shape[0],)](h2d if delta is None else delta, h2d, h2d if gate is None else gate, scale,
                                    scale if shift is None else shift, y, scales, h2d.shape[0], eps, SPLITS=splits,
                                    N=h2d.shape[1], HAS_DELTA=delta is not None, HAS_GATE=gate is not None,
                                    HAS_SHIFT=shift is not None, PDL=pdl, QUANTIZE=quantize,
                                    num_warps=4 if h2d.shape[1] <= 1024 else 8, **launch_options(pdl))
    return QuantizedRows(y, scales, h2d.dtype) if quantize else y


def linear_residual_norm(x2d, w, h2d, gate, scale1p, shift, eps: float, table: LaunchTable = SM90) -> torch.Tensor:
    """Expert: h += gate * (x @ w^T) in place (split-K); returns AdaRMS(h) [R, N]."""
    return residual_norm(h2d, scale1p, shift, delta=splitk_partials(x2d, w, table), gate=gate, eps=eps, table=table)


def residual_layer_norm(h2d, weight, bias, eps: float, delta=None,
                        quantize: bool = False) -> "torch.Tensor | QuantizedRows":
    """SigLIP: h += delta in place (if delta), returns LayerNorm(h) [R, N]; with `quantize`, that quantized
    per row for an fp8 GEMM (the bits fp8_kernels.quantize_rows gives it)."""
    y, scales = _norm_outputs(h2d, quantize)
    n = h2d.shape[1]
    _residual_layer_norm[(h2d.shape[0],)](h2d if delta is None else delta, h2d, weight, bias, y, scales, n, eps,
                                          BLOCK=_pow2(n), HAS_DELTA=delta is not None, QUANTIZE=quantize,
                                          num_warps=4, **launch_options())
    return QuantizedRows(y, scales, h2d.dtype) if quantize else y


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh form) of a contiguous tensor, in place: SigLIP's MLP between fc1 and fc2."""
    block = 2048
    _gelu_flat[(triton.cdiv(x.numel(), block),)](x, x, x.numel(), BLOCK=block, num_warps=4, **launch_options())
    return x


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    r, two_m = gate_up.shape
    m = two_m // 2
    out = torch.empty(r, m, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _geglu_rows[(r, triton.cdiv(m, block))](gate_up, out, m, BLOCK=block, num_warps=4, **launch_options())
    return out


def qkv_rope_into_cache(qkv, cos, sin, k_out, v_out, num_heads: int, tokens: int, w_qkv=None,
                        slots: torch.Tensor | None = None, table: LaunchTable = SM90) -> torch.Tensor:
    """RoPE on q and k; k and v written into cache views k_out/v_out ([B, tokens, D]).

    qkv: the projection output [R, (num_heads + 2) D], or, with `w_qkv`, its input (the
    projection then runs as a split-K GEMM here). cos/sin: [R, D / 2] fp32, R = B * tokens.
    Returns q [B, num_heads * tokens, D] (head-major: the heads fold into one query axis).
    num_heads 0: qkv holds only k and v (a layer whose queries are not needed).
    slots: [R] int32, the cache row of each token's K/V (a permutation of each item's rows); else
    a token's own index. Not with `w_qkv`.
    """
    r = qkv.shape[0]
    d = k_out.shape[-1]
    b = r // tokens
    q = torch.empty(b, num_heads * tokens, d, dtype=k_out.dtype, device=qkv.device)
    pdl = pdl_enabled(table)
    if w_qkv is not None:
        if slots is not None:
            raise ValueError("qkv_rope_into_cache: slots need the projection's output, not w_qkv")
        cfg, block_r = _launch("qkv", r, (num_heads + 2) * (d // 2), table)
        grid = ((num_heads + 2) * (d // 2 // cfg["block_n"]), triton.cdiv(r, block_r))
        _qkv_rope_gemm[grid](qkv, w_qkv, cos, sin, q, k_out, v_out, r, qkv.shape[1], tokens, qkv.stride(0),
                             w_qkv.stride(0), k_out.stride(0), q.stride(0), HQ=num_heads, HALF=d // 2,
                             BLOCK_R=block_r, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], PDL=pdl,
                             num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options(pdl))
        return q
    _qkv_rope[(r,)](qkv, cos, sin, q, k_out, v_out, q if slots is None else slots, r, tokens, HQ=num_heads,
                    SPLITS=1, HALF=d // 2, NQP=_pow2(num_heads + 1), k_batch_stride=k_out.stride(0),
                    q_batch_stride=q.stride(0), SLOTS=slots is not None, PDL=pdl, num_warps=4, **launch_options(pdl))
    return q


def attention_config(batch: int, table: LaunchTable = SM90):
    """The expert attention's launch config at this batch size."""
    return _by_batch("attention", batch, table)


def prefix_attention_config(batch: int, table: LaunchTable = SM90):
    """The prefix attention's launch config at this batch size."""
    return _by_batch("prefix_attention", batch, table)


def _by_batch(family: str, batch: int, table: LaunchTable):
    # table[family] at batch 1, table[family + "_batched"][s] from batch size s on.
    batched = table[f"{family}_batched"]
    sizes = [s for s in batched if s <= batch]
    return batched[max(sizes)] if sizes else table[family]


def mqa_attention(q, k_cache, v_cache, bias, num_heads: int, tokens: int, cfg,
                  table: LaunchTable = SM90) -> torch.Tensor:
    """q [B, num_heads * tokens, D] (head-major), k/v [B, T, D] (any item stride), bias [B, T] fp32
    -> [B, tokens, num_heads * D] (token-major, ready for o_proj). cfg: block_m, splits, block_t,
    warps, stages (several key splits add a log-sum-exp merge)."""
    b, nq, d = q.shape
    t = k_cache.shape[1]
    splits, block_m, block_t = cfg["splits"], cfg["block_m"], cfg["block_t"]
    t_split = triton.cdiv(triton.cdiv(t, splits), block_t) * block_t
    out = torch.empty(b, tokens, num_heads * d, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(nq, block_m), splits, b)
    # A TMA box holds at most 256 elements a side, rows of a multiple of 16 bytes (Gemma: D = 256)
    pdl, tma = pdl_enabled(table), tma_enabled(table) and d <= 256 and (d * q.element_size()) % 16 == 0
    sources = (_rows_descriptor(q, block_m), _rows_descriptor(k_cache, block_t),
               _rows_descriptor(v_cache, block_t)) if tma else (q, k_cache, v_cache)
    launch = dict(num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options(pdl))
    scale2 = d**-0.5 * 1.4426950408889634  # the softmax scale times log2 e
    if splits == 1:
        _mqa_split[grid](*sources, bias, out, out, nq, tokens, t, t_split, scale2,
                         q.stride(0), k_cache.stride(0), HQ=num_heads, SPLITS=1, BLOCK_M=block_m, BLOCK_T=block_t,
                         D=d, DIRECT=True, TMA=tma, PDL=pdl, **launch)
        return out
    parts = torch.empty(b, splits, nq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, splits, nq, dtype=torch.float32, device=q.device)
    _mqa_split[grid](*sources, bias, parts, lse, nq, tokens, t, t_split, scale2,
                     q.stride(0), k_cache.stride(0), HQ=num_heads, SPLITS=splits, BLOCK_M=block_m, BLOCK_T=block_t,
                     D=d, DIRECT=False, TMA=tma, PDL=pdl, **launch)
    merge = table["merge"]
    _mqa_merge[(triton.cdiv(nq, merge["rows"]), b)](parts, lse, out, nq, tokens, HQ=num_heads, SPLITS=splits, D=d,
                                                     ROWS=merge["rows"], PDL=pdl, num_warps=merge["warps"],
                                                     **launch_options(pdl))
    return out


def fixed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, table: LaunchTable) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias) in x's dtype, with the table's "fixed_gemm" tile for that dtype at
    every row count (batch_invariant's GEMM: kernel_code._fixed_gemm)."""
    k, n = x.shape[-1], w.shape[0]
    x2d = x.reshape(-1, k)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    ieee = x.dtype == torch.float32
    cfg = table["fixed_gemm"]["fp32" if ieee else "half"]
    r = x2d.shape[0]
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    _fixed_gemm[(triton.cdiv(n, cfg["block_n"]), triton.cdiv(r, cfg["block_r"]))](
        x2d, w, w if bias is None else bias, out, r, n, k, x2d.stride(0), w.stride(0), BLOCK_R=cfg["block_r"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], HAS_BIAS=bias is not None, IEEE=ieee,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options())
    return out.view(*x.shape[:-1], n)


def fixed_vision_attention(qkv: torch.Tensor, images: int, patches: int, heads: int, head_dim: int,
                           table: LaunchTable) -> torch.Tensor:
    """SigLIP's attention over qkv [images * patches, 3 * heads * head_dim] -> [images * patches, heads *
    head_dim], with the table's "fixed_attention" tiles at every image count (kernel_code._fixed_mha)."""
    cfg = table["fixed_attention"]
    out = torch.empty(qkv.shape[0], heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    scale2 = head_dim**-0.5 * 1.4426950408889634  # the softmax scale times log2 e
    _fixed_mha[(triton.cdiv(patches, cfg["block_m"]), heads, images)](
        qkv, out, patches, scale2, HEADS=heads, D=head_dim, DP=_pow2(head_dim), BLOCK_M=cfg["block_m"],
        BLOCK_T=cfg["block_t"], num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options())
    return out


def action_step(x: torch.Tensor, h: torch.Tensor | None, w_in, b_in, y=None, w_out=None, b_out=None,
                x_out: torch.Tensor | None = None, dt: float = 0.0, t: float = 0.0, rtc=None,
                table: LaunchTable = SM90) -> None:
    """fp32 x [R, A], bf16 h [R, W] (R = B * horizon). With `y` (the expert's output [R, W]):
    x_out = x + dt * v, v = y @ w_out^T + b_out (with real-time chunking's guidance, rtc = (prev
    [R, A], weights [R], guidance [B]) at time t); then, if `h` is given, h = x_out @ w_in^T + b_in
    (x_out is x without `y`)."""
    r, a = x.shape
    width = w_in.shape[0] if w_in is not None else w_out.shape[1]
    cfg = table["action"]
    block_r, block_w = cfg["block_r"], cfg["block_w"]
    row_blocks = triton.cdiv(r, block_r)
    # Split h's columns over programs until about `programs` of them run: more at batch 1 (few
    # rows), none at large batches, where the recomputed v would cost more than it hides.
    chunks = 1
    while h is not None and chunks * 2 * block_w <= width and row_blocks * chunks * 2 <= cfg["programs"]:
        chunks *= 2
    pdl = pdl_enabled(table)
    prev, weights, guidance = rtc if rtc is not None else (x, x, x)
    horizon = r // guidance.shape[0] if rtc is not None else r
    grid = (row_blocks, chunks)
    _action_step[grid](
        x if y is None else y, x, x if x_out is None else x_out, x if h is None else h,
        x if w_out is None else w_out, x if b_out is None else b_out, x if w_in is None else w_in,
        x if b_in is None else b_in, prev, weights, guidance, r, horizon, dt, t, W=width, A=a, BLOCK_R=block_r,
        BLOCK_K=cfg["block_k"], BLOCK_W=block_w, W_PER=width // chunks, HAS_OUT=y is not None,
        HAS_IN=h is not None, HAS_RTC=rtc is not None, UNROLL=cfg.get("unroll", 1), PDL=pdl, num_warps=4,
        **launch_options(pdl))
