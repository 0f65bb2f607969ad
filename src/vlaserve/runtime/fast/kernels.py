"""Triton kernels for the action expert's Euler steps (the latency-bound part of a call).

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
Partial sums are written, not atomically added, so results are bit-reproducible.

On Hopper the expert kernels are launched with programmatic dependent launch (PDL): kernel k+1 is
launched and its programs placed on the SMs while kernel k runs; each waits
(`griddepcontrol.wait`) before its first load, so it still computes only after its predecessor
has finished and written everything: PDL hides the launch, never changes a result. (Every
variant that reads weights before the wait measured slower than these kernels: the first tile or
an L2 prefetch, runs 27-28; a program's whole weight slice, in registers or through TMA, on these
grids or on one-tile grids, runs 91-94: docs/benchmarks.md.)
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fast path then uses stock kernels
    triton = None


def interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs the kernels on the CPU (its interpreter; tests only)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None and (torch.cuda.is_available() or interpreted())


try:  # Triton >= 3.4 (torch 2.11 ships 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    gdc_launch_dependents = gdc_wait = TensorDescriptor = None

if triton is not None:

    @triton.jit
    def _await_inputs(PDL: tl.constexpr):
        # Wait for the previous kernel (its writes become visible), then let the next one be
        # scheduled: at most two kernels are in flight, so everything before the previous one has
        # finished when a kernel starts.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def gelu_tanh(g):
        """GELU, tanh form, in fp32 (tanh(z) as 2 / (1 + exp(-2z)) - 1)."""
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        return 0.5 * g * (1.0 + t)

    @triton.jit
    def _splitk_gemm(x_ptr, w_ptr, p_ptr, R, N, K, K_SPLIT, stride_x, stride_w,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _await_inputs(PDL)
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
                                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                PDL: tl.constexpr):
        """x[rows] @ w[cols]^T and x[rows] @ w[cols + offset]^T in fp32, sharing each x tile: the gate
        and up halves of a GeGLU, or the two halves of RoPE pairs (after waiting for the inputs)."""
        _await_inputs(PDL)
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
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_g, acc_u = _gemm_two_column_blocks(x_ptr, w_ptr, rows, cols, M, R, K, stride_x, stride_w,
                                               BLOCK_R, BLOCK_N, BLOCK_K, PDL)
        # Same rounding points as the eager path: each GEMM output is bf16 before the GeGLU.
        g = acc_g.to(o_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(o_ptr.dtype.element_ty).to(tl.float32)
        act = gelu_tanh(g).to(o_ptr.dtype.element_ty).to(tl.float32) * u
        tl.store(o_ptr + rows[:, None] * M + cols[None, :], act.to(o_ptr.dtype.element_ty), mask=rows[:, None] < R)

    @triton.jit
    def _residual_norm(delta_ptr, h_ptr, gate_ptr, scale_ptr, shift_ptr, y_ptr, R, eps,
                       SPLITS: tl.constexpr, N: tl.constexpr, HAS_DELTA: tl.constexpr,
                       HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr, PDL: tl.constexpr):
        # One row per program: h += gate * delta (delta = sum of SPLITS partials, or one bf16 row),
        # with the eager path's bf16 rounding points; then y = rms_norm(h) * scale (+ shift).
        row = tl.program_id(0)
        cols = tl.arange(0, N)
        _await_inputs(PDL)
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
    def _gelu_flat(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # y = gelu_tanh(x) over n elements, in fp32 between the loads and the stores (torch's
        # rounding points; run 80: bit-identical to F.gelu at SigLIP's shapes, 30.2 vs 34.7 us at batch 8).
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, gelu_tanh(x).to(y_ptr.dtype.element_ty), mask=offs < n)

    @triton.jit
    def _geglu_rows(x_ptr, y_ptr, M, BLOCK: tl.constexpr):
        # x [R, 2M] = [gate | up] -> y [R, M] = gelu_tanh(gate) * up, rounding as the eager path.
        row, pid = tl.program_id(0), tl.program_id(1)
        cols = pid * BLOCK + tl.arange(0, BLOCK)
        mask = cols < M
        g = tl.load(x_ptr + row * 2 * M + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * M + M + cols, mask=mask, other=0.0).to(tl.float32)
        act = gelu_tanh(g).to(y_ptr.dtype.element_ty).to(tl.float32) * u
        tl.store(y_ptr + row * M + cols, act.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qkv_rope_gemm(x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, R, K, H, stride_x, stride_w,
                       k_batch_stride, q_batch_stride, HQ: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # Each program owns BLOCK_N rotary pairs (d, d + HALF) of one head slot (q heads, then k,
        # then v), so RoPE and the scatter into q / the K/V cache happen in the GEMM's epilogue.
        pid = tl.program_id(0)
        per_head = HALF // BLOCK_N
        slot, j = pid // per_head, pid % per_head
        d = j * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = slot * 2 * HALF + d
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc_lo, acc_hi = _gemm_two_column_blocks(x_ptr, w_ptr, rows, cols, HALF, R, K, stride_x, stride_w,
                                                 BLOCK_R, BLOCK_N, BLOCK_K, PDL)
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
    def _qkv_rope(p_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, R, H, HQ: tl.constexpr,
                  SPLITS: tl.constexpr, HALF: tl.constexpr, NQP: tl.constexpr,
                  k_batch_stride, q_batch_stride, SLOTS: tl.constexpr, PDL: tl.constexpr):
        # One program per token: sum the split-K partials of its q/k/v row, rotate q and k. Its
        # K/V go to cache row slot[row] with SLOTS, else to its own token index.
        row = tl.program_id(0)
        _await_inputs(PDL)
        b, tok = row // H, row % H
        kv_row = tl.load(slot_ptr + row) if SLOTS else tok
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
        kv_off = b * k_batch_stride + kv_row * 2 * HALF + d + heads[:, None] * 0
        is_k = heads[:, None] == HQ
        tl.store(k_ptr + kv_off, out_lo.to(q_ptr.dtype.element_ty), mask=is_k)
        tl.store(k_ptr + kv_off + HALF, out_hi.to(q_ptr.dtype.element_ty), mask=is_k)
        vd = tl.arange(0, HALF)
        tl.store(v_ptr + b * k_batch_stride + kv_row * 2 * HALF + vd, v_lo.to(q_ptr.dtype.element_ty))
        tl.store(v_ptr + b * k_batch_stride + kv_row * 2 * HALF + vd + HALF, v_hi.to(q_ptr.dtype.element_ty))

    @triton.jit
    def _online_softmax_step(q, k, v, bias, m_i, l_i, acc, scale2):
        """One key tile of flash attention: running max m_i, denominator l_i, fp32 accumulator. The
        scores are in log2 units (scale2 = scale * log2 e; a bias of 0 or the mask value means the
        same in either unit), which saves a multiply per score (run 79: 1-3% of the attention)."""
        scores = tl.dot(q, tl.trans(k)) * scale2 + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc

    @triton.jit
    def _rows(src, b, start, limit, batch_stride, ROWS: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
        """Rows [start, start + ROWS) of item b of a [B, limit, D] tensor, zeros past `limit`: through
        a TMA descriptor (the copy engine fills shared memory; out-of-range rows come back zero), or
        through pointers (`src` the tensor, `batch_stride` its item stride)."""
        if TMA:
            tile = src.load([b, start, 0]).reshape(ROWS, D)
        else:
            rows = start + tl.arange(0, ROWS)
            d = tl.arange(0, D)
            tile = tl.load(src + b * batch_stride + rows[:, None] * D + d[None, :], mask=rows[:, None] < limit,
                           other=0.0)
        return tile

    @triton.jit
    def _mqa_split(q_src, k_src, v_src, bias_ptr, o_ptr, lse_ptr, NQ, H, T, T_SPLIT, scale2,
                   q_batch_stride, kv_batch_stride, HQ: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr,
                   TMA: tl.constexpr, PDL: tl.constexpr):
        # Flash attention over one key range. Every query of an item shares the key bias [T], so
        # the mask costs a vector, not a matrix. DIRECT (one split): write the normalized output
        # token-major [B, H, HQ * D] for o_proj; else fp32 partials + log-sum-exp for _mqa_merge.
        pid_m, pid_s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        qs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        _await_inputs(PDL)
        q = _rows(q_src, b, pid_m * BLOCK_M, NQ, q_batch_stride, BLOCK_M, D, TMA)
        m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for t0 in range(0, T_SPLIT, BLOCK_T):
            start = pid_s * T_SPLIT + t0
            k = _rows(k_src, b, start, T, kv_batch_stride, BLOCK_T, D, TMA)
            v = _rows(v_src, b, start, T, kv_batch_stride, BLOCK_T, D, TMA)
            ts = start + tl.arange(0, BLOCK_T)
            bias = tl.load(bias_ptr + b * T + ts, mask=ts < T, other=-3.0e38)
            m_i, l_i, acc = _online_softmax_step(q, k, v, bias, m_i, l_i, acc, scale2)
        if DIRECT:
            head, tok = qs // H, qs % H
            out = o_ptr + (b * H + tok[:, None]) * HQ * D + head[:, None] * D + d[None, :]
            tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=qs[:, None] < NQ)
        else:
            out = o_ptr + ((b * SPLITS + pid_s) * NQ + qs[:, None]) * D + d[None, :]
            tl.store(out, acc / l_i[:, None], mask=qs[:, None] < NQ)
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural units for the merge
            tl.store(lse_ptr + (b * SPLITS + pid_s) * NQ + qs, lse, mask=qs < NQ)

    @triton.jit
    def _mqa_merge(o_ptr, lse_ptr, out_ptr, NQ, H, HQ: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
                   ROWS: tl.constexpr, PDL: tl.constexpr):
        # ROWS queries of one item per program; writes [B, H tokens, HQ * D] token-major for o_proj.
        b, qs = tl.program_id(1), tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        _await_inputs(PDL)
        live = qs < NQ
        d = tl.arange(0, D)
        splits = tl.arange(0, SPLITS)
        rows = (b * SPLITS + splits[None, :]) * NQ + qs[:, None]  # [ROWS, SPLITS]
        lse = tl.load(lse_ptr + rows, mask=live[:, None], other=0.0)
        w = tl.exp(lse - tl.max(lse, axis=1)[:, None])
        parts = tl.load(o_ptr + rows[:, :, None] * D + d[None, None, :], mask=live[:, None, None], other=0.0)
        merged = tl.sum(parts * w[:, :, None], axis=1) / tl.sum(w, axis=1)[:, None]
        head, tok = qs // H, qs % H
        out = out_ptr + ((b * H + tok) * HQ * D + head * D)[:, None] + d[None, :]
        tl.store(out, merged.to(out_ptr.dtype.element_ty), mask=live[:, None])


if triton is not None:

    @triton.jit
    def _action_step(y_ptr, x_ptr, x_out_ptr, h_ptr, w_out_ptr, b_out_ptr, w_in_ptr, b_in_ptr, prev_ptr,
                     rtc_w_ptr, guide_ptr, R, H, dt, t, W: tl.constexpr, A: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, W_PER: tl.constexpr, HAS_OUT: tl.constexpr,
                     HAS_IN: tl.constexpr, HAS_RTC: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
        # Between two expert passes, in fp32 as the eager path: v = y @ W_out^T + b_out (y the
        # final-normed expert output), RTC guidance on v, x_out = x + dt * v, then the next step's
        # h = bf16(x_out @ W_in^T + b_in). Program (i, j) owns rows block i and h's columns
        # [j * W_PER, (j + 1) * W_PER); every j recomputes its rows' v (the same code, so the same
        # bits) rather than waiting for one program to, and j == 0 writes x_out (x and x_out are
        # two buffers: no program can see another's update).
        pid_r, pid_w = tl.program_id(0), tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows[:, None] < R
        a = tl.arange(0, A)
        _await_inputs(PDL)
        x = tl.load(x_ptr + rows[:, None] * A + a[None, :], mask=live, other=0.0)
        if HAS_OUT:
            v = tl.zeros((BLOCK_R, A), dtype=tl.float32)
            # Unrolled: the loads of every K block are independent, and issuing them together
            # hides their latency (a plain loop waits on each in turn; no dot to pipeline it).
            for k0 in tl.range(0, W, BLOCK_K, loop_unroll_factor=UNROLL):
                ks = k0 + tl.arange(0, BLOCK_K)
                y = tl.load(y_ptr + rows[:, None] * W + ks[None, :], mask=live, other=0.0).to(tl.float32)
                w_out = tl.load(w_out_ptr + a[:, None] * W + ks[None, :])  # [A, BLOCK_K]
                v += tl.sum(y[:, None, :] * w_out[None, :, :], axis=2)
            v += tl.load(b_out_ptr + a)[None, :]
            if HAS_RTC:
                prev = tl.load(prev_ptr + rows[:, None] * A + a[None, :], mask=live, other=0.0)
                weight = tl.load(rtc_w_ptr + rows, mask=rows < R, other=0.0)
                guide = tl.load(guide_ptr + rows // H, mask=rows < R, other=0.0)
                error = (prev - (x - t * v)) * weight[:, None]
                v = v - guide[:, None] * error
            x = x + dt * v
            if pid_w == 0:
                tl.store(x_out_ptr + rows[:, None] * A + a[None, :], x, mask=live)
        if HAS_IN:
            for w0 in tl.range(pid_w * W_PER, (pid_w + 1) * W_PER, BLOCK_W, loop_unroll_factor=UNROLL):
                ws = w0 + tl.arange(0, BLOCK_W)
                w_in = tl.load(w_in_ptr + ws[None, :] * A + a[:, None])  # [A, BLOCK_W]
                h = tl.sum(x[:, :, None] * w_in[None, :, :], axis=1) + tl.load(b_in_ptr + ws)[None, :]
                tl.store(h_ptr + rows[:, None] * W + ws[None, :], h.to(h_ptr.dtype.element_ty), mask=live)


# Launch configurations for the expert-step kernels. Defaults: the winners of sweeps on an H200
# (docs/performance.md): the single-tile GEMMs from `bench/bench_gpu.py --tune` (each kernel timed
# with every layer's weights in turn, so that they stream from HBM as in a real step); attention,
# "batched", "action" and the prefix attention from `bench/tune_batches.py` at commit 0bdbea4 (run 42:
# each batch size's denoise graph, one family at a time). Other GPUs' tables: launch_tables.py. The single-tile GEMM configs hold for one row tile
# (batch 1: 50 rows); "batched" ones, by the row count they start at, for more rows, where each
# program covers `block_r` rows so that a weight tile is read once per 64 or 128 rows.
TUNING = {
    "splitk": {"block_r": 64, "block_n": 32, "block_k": 256, "max_waves": 1, "warps": 4, "stages": 4},
    "geglu": {"block_r": 64, "block_n": 32, "block_k": 128, "warps": 4, "stages": 5},
    "qkv": {"block_r": 64, "block_n": 16, "block_k": 128, "warps": 4, "stages": 5},
    # The expert's attention (50 x 8 query rows per item, keys split across programs) at batch 1,
    # and from each batch size listed in "attention_batched" on (the largest key <= the batch).
    # (SDPA instead was slower at every batch size, run 42: 22.7 vs 15.9 ms of denoise at batch 8.)
    # With TMA loads (run 71, bench/attention_tma.py, the denoise graph) 16 key splits win at batch
    # 1 (6.62 ms vs 6.71 at 8); batch 2 keeps 8, and 4 and 8 keep run 42's configs (the bests again).
    "attention": {"block_m": 64, "splits": 16, "block_t": 64, "warps": 4, "stages": 2},
    "attention_batched": {
        2: {"block_m": 64, "splits": 8, "block_t": 64, "warps": 4, "stages": 2},
        4: {"block_m": 64, "splits": 4, "block_t": 64, "warps": 4, "stages": 2},
        8: {"block_m": 128, "splits": 4, "block_t": 64, "warps": 8, "stages": 2},
    },
    # The attention's log-sum-exp merge of the key splits: queries per program. Run 63
    # (bench/rows_per_program.py), denoise ms 1 -> 2 queries: b1 6.86 -> 6.77, b2 8.68 -> 8.38,
    # b4 10.42 -> 10.01, b8 14.02 -> 13.34 (4 or 8 per program: no better; 16: slower).
    "merge": {"rows": 2, "warps": 4},
    # The prefix's attention at batch 1 (one key split: ~1,000 queries per head fill the GPU), and
    # from each batch size in "prefix_attention_batched" on. Run 71 (bench/attention_tma.py, one
    # layer at 864 tokens, us, TMA / pointer loads / SDPA-cuDNN): b1 29.4 / 34.1 / 54.8, b2 (128
    # queries a tile) 37.5 / 47.9 / 57.8, b4 71.1 / 90.3 / 109.0, b8 150.4 / 186.9 / 214.0. So the
    # prefix no longer goes through SDPA at batch >= 2 (runs 48-57 chose it over 64-query tiles).
    "prefix_attention": {"block_m": 64, "splits": 1, "block_t": 64, "warps": 4, "stages": 2},
    "prefix_attention_batched": {2: {"block_m": 128, "splits": 1, "block_t": 64, "warps": 8, "stages": 2}},
    # action_step up to max_rows rows (batch x horizon): at batch 1 it beats the eager ops (fp32
    # cuBLAS + elementwise: 445 -> 269 us per call, run 28); from batch 2 on they are faster.
    "action": {"block_r": 2, "block_k": 128, "block_w": 64, "programs": 128, "max_rows": 64, "unroll": 4},
    "batched": {
        # From 65 rows (batch 2 of a 50-step chunk), 200 (batch 4) and 400 (batch 8). block_n
        # None: the widest column tile (16..128) that still gives every SM a program across the
        # row tiles; warps None: 8 from 64-column tiles on.
        # (65 rows: geglu and qkv take 128-deep K tiles since run 120, denoise 8.25 -> 8.07 ms at batch 2.)
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
    # Expert GEMM families (EXPERT_GEMMS) that run through cuBLAS (F.linear, then our RoPE / GeGLU /
    # residual-norm kernel on its bf16 output: the same rounding points) from this batch size on;
    # the rest run our split-K / fused kernels. Run 52 (bench/expert_gemms.py,
    # every subset of {qkv, o, gate_up, down} at every batch): qkv + gate_up through cuBLAS, denoise
    # 10.88 -> 10.41 ms at batch 4 and 14.63 -> 14.03 at 8; at 2 a tie (8.68 vs 8.64), at 1 ours
    # win (all four through cuBLAS: 6.81 -> 8.94); o and down through cuBLAS buy < 0.1 ms at 8.
    "cublas_from_batch": {"qkv": 4, "gate_up": 4},
    # Programmatic dependent launch: None = where the GPU has it (sm90+), else as given.
    "pdl": None,
    # The attention's q/k/v tiles through TMA descriptors: None = where the GPU has them (sm90+),
    # else as given. Bit-identical to the pointer loads, and faster (runs 70-71).
    "tma": None,
}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _hopper() -> bool:
    """An NVIDIA GPU of compute capability 9 or later (PDL, TMA)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pdl_enabled() -> bool:
    if gdc_wait is None:
        return False
    if TUNING["pdl"] is not None:
        return bool(TUNING["pdl"])
    return not interpreted() and _hopper()


def tma_enabled() -> bool:
    """Whether the attention loads its tiles through TMA descriptors: None = where the GPU has the
    copy engine for them (sm90+; the interpreter too, so that CI runs this path), else as given."""
    if TensorDescriptor is None:
        return False
    if TUNING["tma"] is not None:
        return bool(TUNING["tma"])
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


def through_cublas(family: str, batch: int) -> bool:
    """Whether the expert's `family` GEMM (one of EXPERT_GEMMS) runs through cuBLAS at this batch size."""
    if family not in EXPERT_GEMMS:
        raise KeyError(family)
    start = TUNING["cublas_from_batch"].get(family)
    return start is not None and batch >= start


def batched_config(rows: int) -> dict:
    """The batched GEMM configs for `rows` rows: the entry with the largest start <= rows (or the
    first entry)."""
    table = TUNING["batched"]
    starts = [r for r in table if r <= rows]
    return table[max(starts) if starts else min(table)]


def _launch(name: str, rows: int, columns: int, programs: int = 128) -> tuple[dict, int]:
    """The launch config of GEMM family `name` for `rows` x `columns` outputs, and its rows per
    program. One row tile (batch 1) has its own tuned config; more rows take the "batched" table's
    row tiles, and column tiles sized for about `programs` programs (one per SM of an H200's 132)
    where its block_n is None."""
    single = TUNING[name]
    if rows <= single["block_r"]:
        return single, max(16, _pow2(rows))
    cfg = dict(batched_config(rows)[name])
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


def splitk_partials(x2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2d [R, K] bf16, w [N, K] -> fp32 partial sums [splits, R, N]."""
    r, k = x2d.shape
    n = w.shape[0]
    cfg, block_r = _launch("splitk", r, n)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    splits = _split_k(cfg, block_r, n, k, r)
    out = torch.empty(splits, r, n, dtype=torch.float32, device=x2d.device)
    pdl = pdl_enabled()
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


def geglu_linear(x2d: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ Wg^T) * (x @ Wu^T) with W = [Wg; Wu] ([2M, K]) -> [R, M] bf16."""
    r, k = x2d.shape
    m = w_gate_up.shape[0] // 2
    out = torch.empty(r, m, dtype=x2d.dtype, device=x2d.device)
    cfg, block_r = _launch("geglu", r, m)
    pdl = pdl_enabled()
    _geglu_gemm[(triton.cdiv(m, cfg["block_n"]), triton.cdiv(r, block_r))](
        x2d, w_gate_up, out, r, m, k, x2d.stride(0), w_gate_up.stride(0),
        BLOCK_R=block_r, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], PDL=pdl,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **launch_options(pdl))
    return out


def residual_norm(h2d, scale, shift=None, delta=None, gate=None, eps: float = 1e-6) -> torch.Tensor:
    """h += gate * delta in place (if delta), returns rms_norm(h) * scale (+ shift) [R, N].

    delta: fp32 split-K partials [S, R, N] or a [R, N] tensor in h's dtype; N a power of two.
    """
    y = torch.empty_like(h2d)
    splits = 1 if delta is None or delta.dim() == 2 else delta.shape[0]
    pdl = pdl_enabled()
    _residual_norm[(h2d.shape[0],)](h2d if delta is None else delta, h2d, h2d if gate is None else gate, scale,
                                    scale if shift is None else shift, y, h2d.shape[0], eps, SPLITS=splits,
                                    N=h2d.shape[1], HAS_DELTA=delta is not None, HAS_GATE=gate is not None,
                                    HAS_SHIFT=shift is not None, PDL=pdl,
                                    num_warps=4 if h2d.shape[1] <= 1024 else 8, **launch_options(pdl))
    return y


def linear_residual_norm(x2d, w, h2d, gate, scale1p, shift, eps: float) -> torch.Tensor:
    """Expert: h += gate * (x @ w^T) in place (split-K); returns AdaRMS(h) [R, N]."""
    return residual_norm(h2d, scale1p, shift, delta=splitk_partials(x2d, w), gate=gate, eps=eps)


def residual_layer_norm(h2d, weight, bias, eps: float, delta=None) -> torch.Tensor:
    y = torch.empty_like(h2d)
    n = h2d.shape[1]
    _residual_layer_norm[(h2d.shape[0],)](h2d if delta is None else delta, h2d, weight, bias, y, n, eps,
                                          BLOCK=_pow2(n), HAS_DELTA=delta is not None, num_warps=4,
                                          **launch_options())
    return y


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
                        slots: torch.Tensor | None = None) -> torch.Tensor:
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
    pdl = pdl_enabled()
    if w_qkv is not None:
        if slots is not None:
            raise ValueError("qkv_rope_into_cache: slots need the projection's output, not w_qkv")
        cfg, block_r = _launch("qkv", r, (num_heads + 2) * (d // 2))
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


def attention_config(batch: int):
    """The expert attention's launch config at this batch size."""
    return _by_batch("attention", batch)


def prefix_attention_config(batch: int):
    """The prefix attention's launch config at this batch size."""
    return _by_batch("prefix_attention", batch)


def _by_batch(family: str, batch: int):
    # TUNING[family] at batch 1, TUNING[family + "_batched"][s] from batch size s on.
    table = TUNING[f"{family}_batched"]
    sizes = [s for s in table if s <= batch]
    return table[max(sizes)] if sizes else TUNING[family]


def mqa_attention(q, k_cache, v_cache, bias, num_heads: int, tokens: int, cfg: dict) -> torch.Tensor:
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
    pdl, tma = pdl_enabled(), tma_enabled() and d <= 256 and (d * q.element_size()) % 16 == 0
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
    merge = TUNING["merge"]
    _mqa_merge[(triton.cdiv(nq, merge["rows"]), b)](parts, lse, out, nq, tokens, HQ=num_heads, SPLITS=splits, D=d,
                                                     ROWS=merge["rows"], PDL=pdl, num_warps=merge["warps"],
                                                     **launch_options(pdl))
    return out


def action_step(x: torch.Tensor, h: torch.Tensor | None, w_in, b_in, y=None, w_out=None, b_out=None,
                x_out: torch.Tensor | None = None, dt: float = 0.0, t: float = 0.0, rtc=None) -> None:
    """fp32 x [R, A], bf16 h [R, W] (R = B * horizon). With `y` (the expert's output [R, W]):
    x_out = x + dt * v, v = y @ w_out^T + b_out (with real-time chunking's guidance, rtc = (prev
    [R, A], weights [R], guidance [B]) at time t); then, if `h` is given, h = x_out @ w_in^T + b_in
    (x_out is x without `y`)."""
    r, a = x.shape
    width = w_in.shape[0] if w_in is not None else w_out.shape[1]
    cfg = TUNING["action"]
    block_r, block_w = cfg["block_r"], cfg["block_w"]
    row_blocks = triton.cdiv(r, block_r)
    # Split h's columns over programs until about `programs` of them run: more at batch 1 (few
    # rows), none at large batches, where the recomputed v would cost more than it hides.
    chunks = 1
    while h is not None and chunks * 2 * block_w <= width and row_blocks * chunks * 2 <= cfg["programs"]:
        chunks *= 2
    pdl = pdl_enabled()
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
