"""Triton kernels for the action expert's Euler steps (the latency-bound part of a call).

At batch 1 an expert GEMM has 50 rows: stock kernels tile over N only and leave most SMs idle,
reading the weights far below memory bandwidth. These kernels split K as well, and fuse what
follows each GEMM into the pass that reduces its partial sums:
- qkv:     split-K GEMM -> reduce + RoPE + write q, and k/v straight into the K/V cache tail
- attention: MQA with the 8 query heads folded into one query axis, keys split across programs,
           then a log-sum-exp merge
- o, down: split-K GEMM -> reduce + gated residual + the next AdaRMS norm (one row per program)
- gate_up: one GEMM with both halves in the same program -> GeGLU in the epilogue
Partial sums are written, not atomically added, so results are bit-reproducible.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fast path then uses stock kernels
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _splitk_gemm(x_ptr, w_ptr, p_ptr, R, N, K, K_SPLIT, stride_x, stride_w,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            ks = pid_k * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=rows[:, None] < R, other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=cols[:, None] < N, other=0.0)
            acc += tl.dot(x, tl.trans(w))
        out = p_ptr + pid_k * R * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc, mask=(rows[:, None] < R) & (cols[None, :] < N))

    @triton.jit
    def _gemm_two_column_blocks(x_ptr, w_ptr, rows, cols, offset, R, K, stride_x, stride_w,
                                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """x[rows] @ w[cols]^T and x[rows] @ w[cols + offset]^T in fp32, sharing each x tile: the gate
        and up halves of a GeGLU, or the two halves of RoPE pairs."""
        acc_a = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=rows[:, None] < R, other=0.0)
            w_a = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :])
            w_b = tl.load(w_ptr + (cols[:, None] + offset) * stride_w + ks[None, :])
            acc_a += tl.dot(x, tl.trans(w_a))
            acc_b += tl.dot(x, tl.trans(w_b))
        return acc_a, acc_b

    @triton.jit
    def _geglu_gemm(x_ptr, w_ptr, o_ptr, R, M, K, stride_x, stride_w,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_g, acc_u = _gemm_two_column_blocks(x_ptr, w_ptr, rows, cols, M, R, K, stride_x, stride_w,
                                               BLOCK_R, BLOCK_N, BLOCK_K)
        # Same rounding points as the eager path: each GEMM output is bf16 before the GeGLU.
        g = acc_g.to(o_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(o_ptr.dtype.element_ty).to(tl.float32)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # tanh
        act = (0.5 * g * (1.0 + t)).to(o_ptr.dtype.element_ty).to(tl.float32) * u
        tl.store(o_ptr + rows[:, None] * M + cols[None, :], act.to(o_ptr.dtype.element_ty), mask=rows[:, None] < R)

    @triton.jit
    def _residual_norm(delta_ptr, h_ptr, gate_ptr, scale_ptr, shift_ptr, y_ptr, R, eps,
                       SPLITS: tl.constexpr, N: tl.constexpr, HAS_DELTA: tl.constexpr,
                       HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr):
        # One row per program: h += gate * delta (delta = sum of SPLITS partials, or one bf16 row),
        # with the eager path's bf16 rounding points; then y = rms_norm(h) * scale (+ shift).
        row = tl.program_id(0)
        cols = tl.arange(0, N)
        h = tl.load(h_ptr + row * N + cols).to(tl.float32)
        if HAS_DELTA:
            acc = tl.zeros((N,), dtype=tl.float32)
            for s in range(SPLITS):
                acc += tl.load(delta_ptr + s * R * N + row * N + cols).to(tl.float32)
            update = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
            if HAS_GATE:
                gate = tl.load(gate_ptr + cols).to(tl.float32)
                update = (update * gate).to(h_ptr.dtype.element_ty).to(tl.float32)
            h = (h + update).to(h_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + row * N + cols, h.to(h_ptr.dtype.element_ty))
        var = tl.sum(h * h, axis=0) / N
        y = h * (1.0 / tl.sqrt(var + eps)) * tl.load(scale_ptr + cols)
        if HAS_SHIFT:
            y = y + tl.load(shift_ptr + cols)
        tl.store(y_ptr + row * N + cols, y.to(h_ptr.dtype.element_ty))

    @triton.jit
    def _residual_layer_norm(delta_ptr, h_ptr, w_ptr, b_ptr, y_ptr, N, eps,
                             BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
        # SigLIP: h += delta; y = LayerNorm(h) with fp32 statistics and parameters.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        h = tl.load(h_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            h = (h + d).to(h_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + row * N + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
        mean = tl.sum(h, axis=0) / N
        centred = tl.where(mask, h - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / N
        y = centred / tl.sqrt(var + eps) * tl.load(w_ptr + cols, mask=mask, other=0.0) \
            + tl.load(b_ptr + cols, mask=mask, other=0.0)
        tl.store(y_ptr + row * N + cols, y.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _geglu_rows(x_ptr, y_ptr, M, BLOCK: tl.constexpr):
        # x [R, 2M] = [gate | up] -> y [R, M] = gelu_tanh(gate) * up, rounding as the eager path.
        row, pid = tl.program_id(0), tl.program_id(1)
        cols = pid * BLOCK + tl.arange(0, BLOCK)
        mask = cols < M
        g = tl.load(x_ptr + row * 2 * M + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * M + M + cols, mask=mask, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        act = (0.5 * g * (1.0 + t)).to(y_ptr.dtype.element_ty).to(tl.float32) * u
        tl.store(y_ptr + row * M + cols, act.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qkv_rope_gemm(x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, R, K, H, stride_x, stride_w,
                       k_batch_stride, q_batch_stride, HQ: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Each program owns BLOCK_N rotary pairs (d, d + HALF) of one head slot (q heads, then k,
        # then v), so RoPE and the scatter into q / the K/V cache happen in the GEMM's epilogue.
        pid = tl.program_id(0)
        per_head = HALF // BLOCK_N
        slot, j = pid // per_head, pid % per_head
        d = j * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = slot * 2 * HALF + d
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc_lo, acc_hi = _gemm_two_column_blocks(x_ptr, w_ptr, rows, cols, HALF, R, K, stride_x, stride_w,
                                                 BLOCK_R, BLOCK_N, BLOCK_K)
        dt = q_ptr.dtype.element_ty
        lo = acc_lo.to(dt).to(tl.float32)
        hi = acc_hi.to(dt).to(tl.float32)
        b, tok = rows // H, rows % H
        live = rows[:, None] < R
        if slot <= HQ:  # q heads and k rotate; v does not
            c = tl.load(cos_ptr + rows[:, None] * HALF + d[None, :], mask=live, other=0.0)
            s_ = tl.load(sin_ptr + rows[:, None] * HALF + d[None, :], mask=live, other=0.0)
            new_lo = (lo * c).to(dt).to(tl.float32) - (hi * s_).to(dt).to(tl.float32)
            hi = (hi * c).to(dt).to(tl.float32) + (lo * s_).to(dt).to(tl.float32)
            lo = new_lo
        if slot < HQ:
            base = q_ptr + b[:, None] * q_batch_stride + (slot * H + tok[:, None]) * 2 * HALF + d[None, :]
        elif slot == HQ:
            base = k_ptr + b[:, None] * k_batch_stride + tok[:, None] * 2 * HALF + d[None, :]
        else:
            base = v_ptr + b[:, None] * k_batch_stride + tok[:, None] * 2 * HALF + d[None, :]
        tl.store(base, lo.to(dt), mask=live)
        tl.store(base + HALF, hi.to(dt), mask=live)

    @triton.jit
    def _qkv_rope(p_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, R, H, HQ: tl.constexpr,
                  SPLITS: tl.constexpr, HALF: tl.constexpr, NQP: tl.constexpr,
                  k_batch_stride, q_batch_stride):
        # One program per action token: sum the split-K partials of its q/k/v row, rotate q and k.
        row = tl.program_id(0)
        b, tok = row // H, row % H
        n = (HQ + 2) * 2 * HALF
        heads = tl.arange(0, NQP)  # HQ query heads + k, padded to a power of two
        lo = heads[:, None] * 2 * HALF + tl.arange(0, HALF)[None, :]
        valid = heads[:, None] < HQ + 1
        x_lo = tl.zeros((NQP, HALF), dtype=tl.float32)
        x_hi = tl.zeros((NQP, HALF), dtype=tl.float32)
        v_lo = tl.zeros((HALF,), dtype=tl.float32)
        v_hi = tl.zeros((HALF,), dtype=tl.float32)
        vcols = (HQ + 1) * 2 * HALF + tl.arange(0, HALF)
        for s in range(SPLITS):
            base = p_ptr + s * R * n + row * n
            x_lo += tl.load(base + lo, mask=valid, other=0.0).to(tl.float32)
            x_hi += tl.load(base + lo + HALF, mask=valid, other=0.0).to(tl.float32)
            v_lo += tl.load(base + vcols).to(tl.float32)
            v_hi += tl.load(base + vcols + HALF).to(tl.float32)
        x_lo = x_lo.to(q_ptr.dtype.element_ty).to(tl.float32)
        x_hi = x_hi.to(q_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_ptr + row * HALF + tl.arange(0, HALF))[None, :]
        s_ = tl.load(sin_ptr + row * HALF + tl.arange(0, HALF))[None, :]
        out_lo = (x_lo * c).to(q_ptr.dtype.element_ty).to(tl.float32) - (x_hi * s_).to(q_ptr.dtype.element_ty).to(tl.float32)
        out_hi = (x_hi * c).to(q_ptr.dtype.element_ty).to(tl.float32) + (x_lo * s_).to(q_ptr.dtype.element_ty).to(tl.float32)
        d = tl.arange(0, HALF)[None, :]
        # q layout [B, HQ * H, D]: head-major, so the 8 heads fold into one query axis
        q_off = b * q_batch_stride + (heads[:, None] * H + tok) * 2 * HALF + d
        is_q = heads[:, None] < HQ
        tl.store(q_ptr + q_off, out_lo.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(q_ptr + q_off + HALF, out_hi.to(q_ptr.dtype.element_ty), mask=is_q)
        kv_off = b * k_batch_stride + tok * 2 * HALF + d + heads[:, None] * 0
        is_k = heads[:, None] == HQ
        tl.store(k_ptr + kv_off, out_lo.to(q_ptr.dtype.element_ty), mask=is_k)
        tl.store(k_ptr + kv_off + HALF, out_hi.to(q_ptr.dtype.element_ty), mask=is_k)
        vd = tl.arange(0, HALF)
        tl.store(v_ptr + b * k_batch_stride + tok * 2 * HALF + vd, v_lo.to(q_ptr.dtype.element_ty))
        tl.store(v_ptr + b * k_batch_stride + tok * 2 * HALF + vd + HALF, v_hi.to(q_ptr.dtype.element_ty))

    @triton.jit
    def _mqa_split(q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, lse_ptr, NQ, H, T, T_SPLIT, scale,
                   q_batch_stride, kv_batch_stride, HQ: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr):
        # Flash attention over one key range. Every query of an item shares the key bias [T], so
        # the mask costs a vector, not a matrix. DIRECT (one split): write the normalized output
        # token-major [B, H, HQ * D] for o_proj; else fp32 partials + log-sum-exp for _mqa_merge.
        pid_m, pid_s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        qs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * q_batch_stride + qs[:, None] * D + d[None, :], mask=qs[:, None] < NQ, other=0.0)
        m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for t0 in range(0, T_SPLIT, BLOCK_T):
            ts = pid_s * T_SPLIT + t0 + tl.arange(0, BLOCK_T)
            inside = ts < T
            k = tl.load(k_ptr + b * kv_batch_stride + ts[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            bias = tl.load(bias_ptr + b * T + ts, mask=inside, other=-3.0e38)
            scores = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + b * kv_batch_stride + ts[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        if DIRECT:
            head, tok = qs // H, qs % H
            out = o_ptr + (b * H + tok[:, None]) * HQ * D + head[:, None] * D + d[None, :]
            tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=qs[:, None] < NQ)
        else:
            out = o_ptr + ((b * SPLITS + pid_s) * NQ + qs[:, None]) * D + d[None, :]
            tl.store(out, acc / l_i[:, None], mask=qs[:, None] < NQ)
            tl.store(lse_ptr + (b * SPLITS + pid_s) * NQ + qs, m_i + tl.log(l_i), mask=qs < NQ)

    @triton.jit
    def _mqa_merge(o_ptr, lse_ptr, out_ptr, NQ, H, HQ: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr):
        # One program per (batch, query); writes [B, H tokens, HQ * D] token-major for o_proj.
        pid = tl.program_id(0)
        b, q = pid // NQ, pid % NQ
        d = tl.arange(0, D)
        splits = tl.arange(0, SPLITS)
        lse = tl.load(lse_ptr + (b * SPLITS + splits) * NQ + q)
        w = tl.exp(lse - tl.max(lse, axis=0))
        parts = tl.load(o_ptr + ((b * SPLITS + splits[:, None]) * NQ + q) * D + d[None, :])
        merged = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
        head, tok = q // H, q % H
        tl.store(out_ptr + (b * H + tok) * HQ * D + head * D + d, merged.to(out_ptr.dtype.element_ty))


# Launch configurations for the expert-step kernels (bench/bench_gpu.py --tune sweeps them).
# Defaults: the winners of that sweep on an H200 (docs/benchmarks.md), timed with every layer's
# weights in turn so that they stream from HBM as in a real step.
TUNING = {
    "splitk": {"block_n": 32, "block_k": 256, "max_waves": 1, "warps": 4, "stages": 4},
    "geglu": {"block_n": 32, "block_k": 128, "warps": 4, "stages": 5},
    "qkv": {"block_n": 16, "block_k": 128, "warps": 4, "stages": 5},
    "attention": {"block_m": 32, "splits": 8, "block_t": 64, "warps": 4, "stages": 2},
}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _row_block(rows: int) -> int:
    """Rows per program: all of them up to 64 (batch 1), else tiles of 64, the size the launch
    configs were tuned (and their shared memory sized) for."""
    return max(16, _pow2(min(rows, 64)))


def gemm_config(n: int, k: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_N, splits, BLOCK_K): split K until the grid fills about `max_waves` waves."""
    cfg = TUNING["splitk"]
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    tiles = (n + block_n - 1) // block_n
    splits = 1
    while tiles * splits * 2 <= cfg["max_waves"] * num_sms and k % (splits * 2 * block_k) == 0:
        splits *= 2
    return block_n, splits, block_k


def splitk_partials(x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2d [R, K] bf16, w [N, K] -> fp32 partial sums [splits, R, N]."""
    r, k = x2d.shape
    n = w.shape[0]
    block_n, splits, block_k = gemm_config(n, k)
    out = torch.empty(splits, r, n, dtype=torch.float32, device=x2d.device)
    block_r = _row_block(r)
    _splitk_gemm[(triton.cdiv(n, block_n), splits, triton.cdiv(r, block_r))](
        x2d, w, out, r, n, k, k // splits, x2d.stride(0), w.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=TUNING["splitk"]["warps"],
        num_stages=TUNING["splitk"]["stages"])
    return out


def supported(dims) -> bool:
    """The expert kernels tile K by up to 256 and norm power-of-two rows (Gemma dims)."""
    inner = (dims.width, dims.mlp_dim, dims.num_heads * dims.head_dim)
    return (available() and all(k % 256 == 0 for k in inner) and dims.width & (dims.width - 1) == 0
            and dims.head_dim % 32 == 0)


def geglu_linear(x2d: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ Wg^T) * (x @ Wu^T) with W = [Wg; Wu] ([2M, K]) -> [R, M] bf16."""
    r, k = x2d.shape
    m = w_gate_up.shape[0] // 2
    out = torch.empty(r, m, dtype=x2d.dtype, device=x2d.device)
    cfg = TUNING["geglu"]
    block_r = _row_block(r)
    _geglu_gemm[(triton.cdiv(m, cfg["block_n"]), triton.cdiv(r, block_r))](
        x2d, w_gate_up, out, r, m, k, x2d.stride(0), w_gate_up.stride(0),
        BLOCK_R=block_r, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["warps"],
        num_stages=cfg["stages"])
    return out


def residual_norm(h2d, scale, shift=None, delta=None, gate=None, eps: float = 1e-6) -> torch.Tensor:
    """h += gate * delta in place (if delta), returns rms_norm(h) * scale (+ shift) [R, N].

    delta: fp32 split-K partials [S, R, N] or a [R, N] tensor in h's dtype; N a power of two.
    """
    y = torch.empty_like(h2d)
    splits = 1 if delta is None or delta.dim() == 2 else delta.shape[0]
    _residual_norm[(h2d.shape[0],)](h2d if delta is None else delta, h2d, h2d if gate is None else gate, scale,
                                    scale if shift is None else shift, y, h2d.shape[0], eps, SPLITS=splits,
                                    N=h2d.shape[1], HAS_DELTA=delta is not None, HAS_GATE=gate is not None,
                                    HAS_SHIFT=shift is not None, num_warps=4 if h2d.shape[1] <= 1024 else 8)
    return y


def linear_residual_norm(x2d, w, h2d, gate, scale1p, shift, eps: float) -> torch.Tensor:
    """Expert: h += gate * (x @ w^T) in place (split-K); returns AdaRMS(h) [R, N]."""
    return residual_norm(h2d, scale1p, shift, delta=splitk_partials(x2d, w), gate=gate, eps=eps)


def residual_layer_norm(h2d, weight, bias, eps: float, delta=None) -> torch.Tensor:
    y = torch.empty_like(h2d)
    n = h2d.shape[1]
    _residual_layer_norm[(h2d.shape[0],)](h2d if delta is None else delta, h2d, weight, bias, y, n, eps,
                                          BLOCK=_pow2(n), HAS_DELTA=delta is not None, num_warps=4)
    return y


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    r, two_m = gate_up.shape
    m = two_m // 2
    out = torch.empty(r, m, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _geglu_rows[(r, triton.cdiv(m, block))](gate_up, out, m, BLOCK=block, num_warps=4)
    return out


def qkv_rope_into_cache(qkv, cos, sin, k_out, v_out, num_heads: int, tokens: int, w_qkv=None) -> torch.Tensor:
    """RoPE on q and k; k and v written into cache views k_out/v_out ([B, tokens, D]).

    qkv: the projection output [R, (num_heads + 2) D], or, with `w_qkv`, its input (the
    projection then runs as a split-K GEMM here). cos/sin: [R, D / 2] fp32, R = B * tokens.
    Returns q [B, num_heads * tokens, D] (head-major: the heads fold into one query axis).
    """
    r = qkv.shape[0]
    d = k_out.shape[-1]
    b = r // tokens
    q = torch.empty(b, num_heads * tokens, d, dtype=k_out.dtype, device=qkv.device)
    if w_qkv is not None:
        cfg = TUNING["qkv"]
        block_r = _row_block(r)
        grid = ((num_heads + 2) * (d // 2 // cfg["block_n"]), triton.cdiv(r, block_r))
        _qkv_rope_gemm[grid](qkv, w_qkv, cos, sin, q, k_out, v_out, r, qkv.shape[1], tokens, qkv.stride(0),
                             w_qkv.stride(0), k_out.stride(0), q.stride(0), HQ=num_heads, HALF=d // 2,
                             BLOCK_R=block_r, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                             num_warps=cfg["warps"], num_stages=cfg["stages"])
        return q
    _qkv_rope[(r,)](qkv, cos, sin, q, k_out, v_out, r, tokens, HQ=num_heads, SPLITS=1,
                    HALF=d // 2, NQP=_pow2(num_heads + 1), k_batch_stride=k_out.stride(0),
                    q_batch_stride=q.stride(0), num_warps=4)
    return q


def mqa_attention(q, k_cache, v_cache, bias, num_heads: int, tokens: int, splits: int | None = None) -> torch.Tensor:
    """q [B, num_heads * tokens, D] (head-major), k/v [B, T, D], bias [B, T] fp32
    -> [B, tokens, num_heads * D] (token-major, ready for o_proj). splits=None: the tuned
    key split for short query sets (the expert); 1 for long ones (the prefix)."""
    b, nq, d = q.shape
    t = k_cache.shape[1]
    cfg = TUNING["attention"]
    if splits is None:
        splits, block_m, block_t, warps, stages = cfg["splits"], cfg["block_m"], cfg["block_t"], cfg["warps"], cfg["stages"]
    else:
        block_m, block_t, warps, stages = 64, 64, 8, 2
    t_split = triton.cdiv(triton.cdiv(t, splits), block_t) * block_t
    out = torch.empty(b, tokens, num_heads * d, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(nq, block_m), splits, b)
    if splits == 1:
        _mqa_split[grid](q, k_cache, v_cache, bias, out, out, nq, tokens, t, t_split, d**-0.5, q.stride(0),
                         k_cache.stride(0), HQ=num_heads, SPLITS=1, BLOCK_M=block_m, BLOCK_T=block_t, D=d,
                         DIRECT=True, num_warps=warps, num_stages=stages)
        return out
    parts = torch.empty(b, splits, nq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, splits, nq, dtype=torch.float32, device=q.device)
    _mqa_split[grid](q, k_cache, v_cache, bias, parts, lse, nq, tokens, t, t_split, d**-0.5, q.stride(0),
                     k_cache.stride(0), HQ=num_heads, SPLITS=splits, BLOCK_M=block_m, BLOCK_T=block_t, D=d,
                     DIRECT=False, num_warps=warps, num_stages=stages)
    _mqa_merge[(b * nq,)](parts, lse, out, nq, tokens, HQ=num_heads, SPLITS=splits, D=d, num_warps=4)
    return out
