"""The device code of the fast path's Triton kernels: every `@triton.jit` function, and nothing else.

kernels.py and fp8_kernels.py launch them (and say what each computes and why). They live apart, importing
Triton but not torch, because a compile worker (fast/precompile.py) imports the module of each kernel it
compiles: with the kernels beside their torch launchers, each worker of an empty-cache start would import
torch before its first compile, adding seconds to each worker's first compile.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fast path then uses stock kernels
    triton = None

try:  # Triton >= 3.4 (torch 2.11 ships 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

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
    def _residual_norm(delta_ptr, h_ptr, gate_ptr, scale_ptr, shift_ptr, y_ptr, s_ptr, R, eps,
                       SPLITS: tl.constexpr, N: tl.constexpr, HAS_DELTA: tl.constexpr,
                       HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr, PDL: tl.constexpr,
                       QUANTIZE: tl.constexpr):
        # One row per program: h += gate * delta (delta = sum of SPLITS partials, or one bf16 row),
        # with the eager path's bf16 rounding points; then y = rms_norm(h) * scale (+ shift), stored
        # in h's dtype or (QUANTIZE) as that row quantized for an fp8 GEMM: e4m3 into y, its scale into s.
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
        if QUANTIZE:
            _quantize_row(y.to(h_ptr.dtype.element_ty).to(tl.float32), y_ptr + row * N, s_ptr + row, cols, cols < N)
        else:
            tl.store(y_ptr + row * N + cols, y.to(h_ptr.dtype.element_ty))

    @triton.jit
    def _residual_layer_norm(delta_ptr, h_ptr, w_ptr, b_ptr, y_ptr, s_ptr, N, eps,
                             BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, QUANTIZE: tl.constexpr):
        # SigLIP: h += delta; y = LayerNorm(h) with fp32 statistics and parameters, stored in h's dtype
        # or (QUANTIZE) as that row quantized for an fp8 GEMM: e4m3 into y, its scale into s.
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
        if QUANTIZE:
            _quantize_row(y.to(h_ptr.dtype.element_ty).to(tl.float32), y_ptr + row * N, s_ptr + row, cols, mask)
        else:
            tl.store(y_ptr + row * N + cols, y.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_flat(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # y = gelu_tanh(x) over n elements, in fp32 between the loads and the stores (torch's
        # rounding points: bit-identical to F.gelu at SigLIP's shapes, and faster).
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
    def _geglu_quantized(x_ptr, q_ptr, s_ptr, M, BLOCK: tl.constexpr):
        # x [R, 2M] = [gate | up] -> _geglu_rows's row, quantized for the fp8 GEMM that takes it as
        # _quantize_rows would from the stored row: one row a program, held in registers from its loads
        # to its e4m3 store (M <= BLOCK), so the activation never goes to memory in bf16 and back.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < M
        g = tl.load(x_ptr + row * 2 * M + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * M + M + cols, mask=mask, other=0.0).to(tl.float32)
        act = gelu_tanh(g).to(x_ptr.dtype.element_ty).to(tl.float32) * u
        _quantize_row(act.to(x_ptr.dtype.element_ty).to(tl.float32), q_ptr + row * M, s_ptr + row, cols, mask)

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
        same in either unit), which saves a multiply per score."""
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

    @triton.jit(do_not_specialize=["R"])
    def _fixed_gemm(x_ptr, w_ptr, b_ptr, o_ptr, R, N, K, stride_x, stride_w,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    IEEE: tl.constexpr):
        # batch_invariant's GEMM: o = x @ w^T (+ bias), one output tile a program, K reduced in BLOCK_K steps
        # from 0 up in one fp32 accumulator (no split): every row's sums run in the same order whatever R is
        # (R is not specialized on: one compiled kernel for every row count). IEEE: fp32 operands multiplied
        # in fp32 (not tf32).
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < R) & (ks[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                        other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + rows[:, None] * N + cols[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=(rows[:, None] < R) & (cols[None, :] < N))

    @triton.jit
    def _fixed_mha(qkv_ptr, o_ptr, P, scale2, HEADS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
        # batch_invariant's SigLIP attention: qkv [N * P, 3 * HEADS * D] (q heads, k heads, v heads), one
        # image, head and query block a program, its P keys in BLOCK_T tiles from 0 up: an image's sums run
        # in the same order whatever N is. D padded to DP (a power of two) with zeros. -> o [N * P, HEADS * D].
        pid_m, head, image = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        qs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, DP)
        width = 3 * HEADS * D
        base = qkv_ptr + image * P * width + head * D
        q = tl.load(base + qs[:, None] * width + d[None, :], mask=(qs[:, None] < P) & (d[None, :] < D), other=0.0)
        m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, DP), dtype=tl.float32)
        for t0 in range(0, P, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            live = (ts[:, None] < P) & (d[None, :] < D)
            k = tl.load(base + HEADS * D + ts[:, None] * width + d[None, :], mask=live, other=0.0)
            v = tl.load(base + 2 * HEADS * D + ts[:, None] * width + d[None, :], mask=live, other=0.0)
            bias = tl.where(ts < P, 0.0, -3.0e38)
            m_i, l_i, acc = _online_softmax_step(q, k, v, bias, m_i, l_i, acc, scale2)
        out = o_ptr + (image * P + qs[:, None]) * HEADS * D + head * D + d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=(qs[:, None] < P) & (d[None, :] < D))

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


# The fp8 quantizer (fp8_kernels.py) and its rounding, which the norms and the GeGLU share
if triton is not None:

    @triton.jit
    def _round_e4m3(y):
        """fp32 y, |y| <= 448 -> the nearest e4m3 value (ties to even), as fp32, its sign kept (-0
        too, as torch's cast). The step is 2^(e - 3) for |y| in [2^e, 2^(e+1)), and 2^-9 below 2^-6
        (subnormals); |y| / step is then below 16, where adding and subtracting 1.5 * 2^23 rounds it
        to an integer, ties to even."""
        bits = y.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
        rounded = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
        # y's sign bit onto |result| by bits: on the GPU `where(bits < 0, -rounded, rounded)` gives +0
        # for negatives that round to zero, where torch's cast gives -0.
        sign = (bits >> 31) << 31
        return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_scale(row_max):
        """The per-row scale of model/fp8.py scales_for: amax / 448 correctly rounded, 1 for an all-zero row."""
        return tl.where(row_max > 0, tl.math.div_rn(row_max, 448.0), 1.0)

    @triton.jit
    def _e4m3_values(v, scale):
        """v / scale correctly rounded, saturated at +-448, rounded to e4m3 (as fp32)."""
        return _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))

    @triton.jit
    def _quantize_row(y, q_row_ptr, scale_ptr, cols, mask):
        """One row's values (fp32 holding the activation dtype's values) -> its e4m3 values at q_row_ptr
        and its scale at scale_ptr: what _quantize_rows gives that row, stored, with a per-row scale.

        The e4m3 row is stored 8 values at a time, as the producer's 2-byte loads read its inputs.
        Stored as one contiguous run, Triton would give every thread 16 consecutive values (a 16-byte
        store) and lay the whole producer out so, reordering its reductions: the LayerNorm's mean and
        variance then differ in their last bits from its bf16 twin's, and so does the row quantized
        on the GPU. `cols // 8 * 8 + cols % 8` is `cols` with runs of 8 for Triton's
        contiguity analysis, which keeps the layout of the loads (8 a thread)."""
        scale = _e4m3_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
        tl.store(scale_ptr, scale)
        runs_of_8 = cols // 8 * 8 + cols % 8
        tl.store(q_row_ptr + runs_of_8, _e4m3_values(y, scale).to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _quantize_rows(x_ptr, q_ptr, s_ptr, static_ptr, M, K, stride_x, STATIC: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
        cols = tl.arange(0, BLOCK)[None, :]
        if STATIC:
            scale = tl.zeros([ROWS], dtype=tl.float32) + tl.load(static_ptr).to(tl.float32)
        if ONE_PASS:  # K <= BLOCK: the rows stay in registers from their amax to their rounding
            mask = row_ok[:, None] & (cols < K)
            v = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
            if not STATIC:
                scale = _e4m3_scale(tl.max(tl.abs(v), axis=1))
            tl.store(s_ptr + rows, scale, mask=row_ok)
            tl.store(q_rows + cols, _e4m3_values(v, scale[:, None]).to(tl.float8e4nv), mask=mask)
        else:  # a wide row: its amax, then its rounding, reading it again (mostly from L2)
            if not STATIC:
                amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
                for k0 in range(0, K, BLOCK):
                    mask = row_ok[:, None] & (k0 + cols < K)
                    v = tl.load(x_rows + k0 + cols, mask=mask, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(v))
                scale = _e4m3_scale(tl.max(amax, axis=1))
            tl.store(s_ptr + rows, scale, mask=row_ok)
            for k0 in range(0, K, BLOCK):
                mask = row_ok[:, None] & (k0 + cols < K)
                v = tl.load(x_rows + k0 + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_rows + k0 + cols, _e4m3_values(v, scale[:, None]).to(tl.float8e4nv), mask=mask)
