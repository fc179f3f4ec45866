"""Packed variable-length causal attention with GQA: ``cu_seqlens`` in, no padding anywhere.

For every sequence b (tokens ``[cu[b], cu[b+1])``) and query head h, with key/value head ``h // (Hq // Hkv)``::

    O[i] = Σ_j softmax_j(scale · q_i · k_j  (j ≤ i when causal, j in the same sequence)) · v_j

q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens`` ``[B + 1]`` int32. Tokens of different sequences never see
each other. Returns ``[T, Hq, D]`` in the input dtype; differentiable in q, k and v.

Paths: the Triton kernels on CUDA and under ``TRITON_INTERPRET=1``; otherwise a plain-torch path,
how the CPU trainer runs a packed forward: causal, when the padded batch's attention arithmetic (``B · L_max²``) is
at most ``PAD_FACTOR`` times the per-sequence one (``Σ L_b²``), one ``scaled_dot_product_attention`` over the
sequences padded into a batch
(``[B, H, L_max, D]``; the padding sits after each sequence's tokens, so causality alone keeps it out of every real
query's keys); otherwise SDPA per sequence (sequences of equal length batched together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .utils import (
    FLOAT_DTYPES,
    HAS_TRITON,
    INTERPRET,
    check_cu_seqlens,
    check_tensor,
    dot_in_fp32,
    launch_first_fitting,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x · log2 e)
# the CPU path pads the sequences into one batch when that costs at most this many times the attention arithmetic
# of per-sequence calls (B · L_max² against Σ L²; the padded tokens, B · L_max, then stay within 3 T): one SDPA call
# instead of one per distinct length (a GRPO micro-batch of 32 sequences of 12-44 tokens, 21 lengths, ratio 1.8, tiny
# heads: 2.4 against 3.0 ms a layer, forward and backward); one long sequence among short ones keeps the per-length
# calls (64 + 31 x 32 tokens: ratio 3.7)
PAD_FACTOR = 3


def _check_inputs(q, k, v, cu_seqlens, max_seqlen, *, check_offsets: bool) -> None:
    """Shapes, dtypes, devices; with ``check_offsets`` also the ``cu_seqlens`` values (one host read)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    T, Hq, D = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [T={T}, Hkv, D={D}] to match q")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"q's head count {Hq} must be a multiple of k's head count {k.shape[1]} (GQA)")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {D}; supported head dims are 1..{MAX_HEAD_DIM}")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,), device=q.device)
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive int, got {max_seqlen!r}")
    if check_offsets:
        check_cu_seqlens(cu_seqlens, T)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence ({longest} tokens)")


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels. Layout: q/o/dq [T, Hq, D], k/v/dk/dv [T, Hkv, D] (last dim contiguous), lse/delta [Hq, T] fp32.
# Every grid is (blocks of the longest sequence, heads, sequences): program (i, h, b) handles block i of sequence b
# and exits at once when that block starts past the sequence's end. Scores live in base 2: s2 = q·k · scale · log2 e,
# lse2 = log2 Σ exp2(s2), so p = exp2(s2 − lse2).
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _load_rows(ptrs, rows_ok, d_ok, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
        """Load a [rows, BLOCK_D] tile; masked rows/columns read 0."""
        if ROW_MASK:
            if EVEN_D:
                x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
            else:
                x = tl.load(ptrs, mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            if EVEN_D:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
        return x

    @triton.jit
    def _seq_bounds(CU, b):
        """Start (int64, for pointer arithmetic) and length of sequence ``b`` from the offsets."""
        start = tl.load(CU + b)
        return start.to(tl.int64), (tl.load(CU + b + 1) - start).to(tl.int32)

    @triton.jit
    def _key_range(start_m, L, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys a query block starting at ``start_m`` visits: [0, full_end) need no mask, [full_end, hi) do."""
        if CAUSAL:
            full_end = start_m  # key blocks entirely left of the diagonal need no mask
            hi = tl.minimum(start_m + BLOCK_M, L)
        else:
            full_end = (L // BLOCK_N) * BLOCK_N
            hi = L
        return full_end, hi

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, lo, hi, offs_m, offs_n, offs_d, L, qk_scale,
                   HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PREC: tl.constexpr):
        """Online softmax over key blocks [lo, hi); MASKED blocks apply the end-of-sequence and causal masks."""
        d_ok = offs_d < HEAD_DIM
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n  # [BLOCK_N]
            k = _load_rows(k_base + cols[:, None] * stride_kt + offs_d[None, :], cols < L, d_ok, MASKED, EVEN_D)
            v = _load_rows(v_base + cols[:, None] * stride_kt + offs_d[None, :], cols < L, d_ok, MASKED, EVEN_D)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
            if MASKED:
                keep = (cols < L)[None, :]
                if CAUSAL:
                    keep = keep & (offs_m[:, None] >= cols[None, :])
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row has a visible key in its first block
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _varlen_fwd_kernel(Q, K, V, O, LSE, CU, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_lh,
                           HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_FP32: tl.constexpr, PREC: tl.constexpr):
        """One query block of one head: reads its q rows once and the k/v rows up to the diagonal (causal) or
        the sequence end; writes o [BLOCK_M, D] and lse2 [BLOCK_M]. Heavier (later) blocks launch first."""
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        seq_start, L = _seq_bounds(CU, tl.program_id(2))
        start_m = m_block * BLOCK_M
        if start_m >= L:
            return
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        rows_ok = offs_m < L
        q_base = Q + seq_start * stride_qt + h * stride_qh
        q = _load_rows(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], rows_ok, d_ok, True, EVEN_D)
        if DOT_FP32:
            q = q.to(tl.float32)
        kv_off = seq_start * stride_kt + (h // GROUP) * stride_kh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        full_end, hi = _key_range(start_m, L, CAUSAL, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + kv_off, V + kv_off, stride_kt, 0, full_end, offs_m, offs_n,
                                   offs_d, L, qk_scale, HEAD_DIM, False, CAUSAL, EVEN_D, BLOCK_N, DOT_FP32, PREC)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + kv_off, V + kv_off, stride_kt, full_end, hi, offs_m, offs_n,
                                   offs_d, L, qk_scale, HEAD_DIM, True, CAUSAL, EVEN_D, BLOCK_N, DOT_FP32, PREC)
        o = acc / l_i[:, None]
        o_ptrs = O + seq_start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])
        tl.store(LSE + h * stride_lh + seq_start + offs_m, m_i + tl.log2(l_i), mask=rows_ok)

    @triton.jit
    def _varlen_bwd_delta_kernel(O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
                                 HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """delta[h, t] = Σ_d o[t, h, d] · do[t, h, d]: reads two [BLOCK_T, D] tiles, writes BLOCK_T floats."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_t < T)[:, None] & (offs_d < HEAD_DIM)[None, :]
        rows = offs_t.to(tl.int64)[:, None]
        o = tl.load(O + rows * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DO + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DELTA + h * stride_lh + offs_t, tl.sum(o * do, 1), mask=offs_t < T)

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, hi,
                        offs_n, offs_m, offs_d, L, qk_scale,
                        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr, PREC: tl.constexpr):
        """dV += Pᵀ dO and dK += dSᵀ Q over query blocks [lo, hi) of one query head (the tile is transposed:
        keys on rows). One loop with the masks on every block: splitting it into masked and unmasked loops, as
        the forward does, made the compiled sm_90 kernel spill registers (three loop bodies inside the GQA loop)."""
        d_ok = offs_d < HEAD_DIM
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m  # [BLOCK_M]
            rows_ok = rows < L
            q = _load_rows(q_base + rows[:, None] * stride_qt + offs_d[None, :], rows_ok, d_ok, True, EVEN_D)
            do = _load_rows(do_base + rows[:, None] * stride_dot + offs_d[None, :], rows_ok, d_ok, True, EVEN_D)
            lse = tl.load(lse_base + rows, mask=rows_ok, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows_ok, other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            p_T = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
            keep = rows_ok[None, :]
            if CAUSAL:
                keep = keep & (rows[None, :] >= offs_n[:, None])
            p_T = tl.where(keep, p_T, 0.0)
            dv = tl.dot(p_T.to(do.dtype), do, dv, input_precision=PREC)
            dp_T = tl.dot(v, tl.trans(do), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
            ds_T = p_T * (dp_T - delta[None, :])
            dk = tl.dot(ds_T.to(q.dtype), q, dk, input_precision=PREC)
        return dk, dv

    @triton.jit
    def _varlen_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, qk_scale, sm_scale,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh, stride_lh,
                                HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                DOT_FP32: tl.constexpr, PREC: tl.constexpr):
        """One key block of one kv head: reads its k/v rows once, then q/do/lse/delta of every query head of the
        GQA group from the diagonal (causal) to the sequence end; writes dk, dv [BLOCK_N, D] (no atomics)."""
        n_block = tl.program_id(0)  # causal: early key blocks see the most queries and launch first
        kvh = tl.program_id(1).to(tl.int64)
        seq_start, L = _seq_bounds(CU, tl.program_id(2))
        start_n = n_block * BLOCK_N
        if start_n >= L:
            return
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        cols_ok = offs_n < L
        kv_off = seq_start * stride_kt + kvh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
        k = _load_rows(K + kv_off, cols_ok, d_ok, True, EVEN_D)
        v = _load_rows(V + kv_off, cols_ok, d_ok, True, EVEN_D)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo = start_n if CAUSAL else 0  # causal: queries before the key block see none of it
        for g in range(GROUP):
            h = kvh * GROUP + g
            q_base = Q + seq_start * stride_qt + h * stride_qh
            do_base = DO + seq_start * stride_dot + h * stride_doh
            lse_base = LSE + h * stride_lh + seq_start
            delta_base = DELTA + h * stride_lh + seq_start
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                     lo, L, offs_n, offs_m, offs_d, L, qk_scale,
                                     HEAD_DIM, CAUSAL, EVEN_D, BLOCK_M, DOT_FP32, PREC)
        store_mask = cols_ok[:, None] & d_ok[None, :]
        tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=store_mask)
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, lo, hi, offs_m, offs_n, offs_d, L, qk_scale,
                      HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PREC: tl.constexpr):
        """dQ += dS K over key blocks [lo, hi)."""
        d_ok = offs_d < HEAD_DIM
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n  # [BLOCK_N]
            k = _load_rows(k_base + cols[:, None] * stride_kt + offs_d[None, :], cols < L, d_ok, MASKED, EVEN_D)
            v = _load_rows(v_base + cols[:, None] * stride_kt + offs_d[None, :], cols < L, d_ok, MASKED, EVEN_D)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])  # [BLOCK_M, BLOCK_N]
            if MASKED:
                keep = (cols < L)[None, :]
                if CAUSAL:
                    keep = keep & (offs_m[:, None] >= cols[None, :])
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # [BLOCK_M, BLOCK_N]
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
        return dq

    @triton.jit
    def _varlen_bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, qk_scale, sm_scale,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh, stride_lh,
                              HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              DOT_FP32: tl.constexpr, PREC: tl.constexpr):
        """One query block of one head: reads q/do/lse/delta once and k/v up to the diagonal; writes dq."""
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        seq_start, L = _seq_bounds(CU, tl.program_id(2))
        start_m = m_block * BLOCK_M
        if start_m >= L:
            return
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        rows_ok = offs_m < L
        q_ptrs = Q + seq_start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = DO + seq_start * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :]
        q = _load_rows(q_ptrs, rows_ok, d_ok, True, EVEN_D)
        do = _load_rows(do_ptrs, rows_ok, d_ok, True, EVEN_D)
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + h * stride_lh + seq_start + offs_m, mask=rows_ok, other=0.0)
        delta = tl.load(DELTA + h * stride_lh + seq_start + offs_m, mask=rows_ok, other=0.0)
        kv_off = seq_start * stride_kt + (h // GROUP) * stride_kh
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        full_end, hi = _key_range(start_m, L, CAUSAL, BLOCK_M, BLOCK_N)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K + kv_off, V + kv_off, stride_kt, 0, full_end, offs_m, offs_n,
                           offs_d, L, qk_scale, HEAD_DIM, False, CAUSAL, EVEN_D, BLOCK_N, DOT_FP32, PREC)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K + kv_off, V + kv_off, stride_kt, full_end, hi, offs_m, offs_n,
                           offs_d, L, qk_scale, HEAD_DIM, True, CAUSAL, EVEN_D, BLOCK_N, DOT_FP32, PREC)
        tl.store(DQ + seq_start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])

# Block sizes (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages), tried in order on a GPU until one fits the
# shared memory (bigger head dims and fp32 need the smaller ones; ``_utils.launch_first_fitting``); the choice is
# remembered per kernel, head dim and dtype. The first entries were picked by compiling for sm_90 here (no GPU to
# time them): for D = 128 in bf16 they leave no register spills (ptxas stack 0 for fwd and dkdv, 24 bytes for dq)
# and fit the H200's 227 KB of shared memory. The interpreter takes the last but one entry: small tiles keep the
# numpy emulation quick and still cross block boundaries. The causal loop split needs BLOCK_M % BLOCK_N == 0 for
# fwd and dq.
_BLOCKS = {
    "fwd": [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 1)],
    "dkdv": [(32, 64, 8, 3), (32, 64, 4, 2), (16, 32, 4, 1)],
    "dq": [(128, 32, 8, 3), (64, 32, 4, 2), (32, 16, 4, 1)],
}
# fp32 with head dims above 64: the tiles above spill tens of KB per thread (fp32 q/acc tiles of 128 columns), so
# smaller ones (compiled for sm_90: dkdv and dq without spills, fwd spills 3.5 KB at the first entry, 0.7 KB next).
_BLOCKS_FP32_WIDE = {
    "fwd": [(32, 32, 4, 2), (32, 16, 4, 1), (16, 16, 4, 1)],
    "dkdv": [(16, 32, 4, 2), (16, 16, 4, 1), (16, 16, 2, 1)],
    "dq": [(32, 16, 4, 2), (16, 16, 4, 1), (16, 16, 2, 1)],
}
MAX_GRID_SEQS = 65535  # CUDA's limit on grid dims 1 and 2: more sequences than this launch as several grids


def _launch(name, kernel, grid_block, grid_len, heads, cu_seqlens, make_args, consts):
    """Launch ``kernel`` on the grids (blocks of ``grid_len`` tokens, ``heads``, sequences).

    ``make_args(cu)`` builds the kernel's arguments around the offsets ``cu``. Sequences go in groups of at most
    ``MAX_GRID_SEQS``, each grid given its slice of ``cu_seqlens`` (the offsets in it stay absolute).
    """
    num_seqs = cu_seqlens.numel() - 1
    for s0 in range(0, num_seqs, MAX_GRID_SEQS):
        n = min(MAX_GRID_SEQS, num_seqs - s0)
        _launch_grid(name, kernel, grid_block, grid_len, heads, n, make_args(cu_seqlens[s0 : s0 + n + 1]), consts)


def _launch_grid(name, kernel, grid_block, grid_len, heads, num_seqs, args, consts):
    """One grid (blocks of ``grid_len`` tokens, ``heads``, ``num_seqs``), block sizes from ``_BLOCKS[name]``.

    ``grid_block`` names the block (BLOCK_M or BLOCK_N) that tiles the grid's first axis.
    """
    if INTERPRET and not args[0].is_cuda:
        m, n, _, _ = _BLOCKS[name][-2]
        kernel[(triton.cdiv(grid_len, {"BLOCK_M": m, "BLOCK_N": n}[grid_block]), heads, num_seqs)](
            *args, **consts, BLOCK_M=m, BLOCK_N=n)
        return
    key = (name, consts["HEAD_DIM"], args[0].dtype, args[0].device.index)
    wide_fp32 = args[0].dtype == torch.float32 and consts["HEAD_DIM"] > 64

    def launch(config):
        m, n, warps, stages = config
        grid = (triton.cdiv(grid_len, {"BLOCK_M": m, "BLOCK_N": n}[grid_block]), heads, num_seqs)
        kernel[grid](*args, **consts, BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)

    launch_first_fitting(key, (_BLOCKS_FP32_WIDE if wide_fp32 else _BLOCKS)[name], launch)


def _common_consts(q, k):
    D = q.shape[-1]
    return {
        "HEAD_DIM": D,
        "GROUP": q.shape[1] // k.shape[1],
        "BLOCK_D": max(16, triton.next_power_of_2(D)),
        "DOT_FP32": dot_in_fp32(q),
        "PREC": "ieee" if q.dtype == torch.float32 or dot_in_fp32(q) else "tf32",  # tf32 is unused on bf16/fp16
    }


def _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    """o [T, Hq, D] and lse2 [Hq, T] (base-2 log-sum-exp of the scaled scores)."""
    T, Hq, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(Hq, T, device=q.device, dtype=torch.float32)
    consts = {**_common_consts(q, k), "CAUSAL": causal}
    _launch("fwd", _varlen_fwd_kernel, "BLOCK_M", max_seqlen, Hq, cu_seqlens,
            lambda cu: (q, k, v, o, lse, cu, scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                        lse.stride(0)), consts)
    return o, lse


def _varlen_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    do = do.contiguous()
    delta = torch.empty_like(lse)  # [Hq, T]
    block_t = 64
    _varlen_bwd_delta_kernel[(triton.cdiv(T, block_t), Hq)](
        o, do, delta, T, o.stride(0), o.stride(1), do.stride(0), do.stride(1), delta.stride(0),
        HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(D)))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), do.stride(0), do.stride(1), lse.stride(0))
    consts = {**_common_consts(q, k), "CAUSAL": causal}
    _launch("dkdv", _varlen_bwd_dkdv_kernel, "BLOCK_N", max_seqlen, Hkv, cu_seqlens,
            lambda cu: (q, k, v, do, dk, dv, lse, delta, cu, scale * LOG2E, scale, *strides), consts)
    _launch("dq", _varlen_bwd_dq_kernel, "BLOCK_M", max_seqlen, Hq, cu_seqlens,
            lambda cu: (q, k, v, do, dq, lse, delta, cu, scale * LOG2E, scale, *strides), consts)
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, causal, scale):
        o, lse = _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = _varlen_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


def _varlen_attention_torch(q, k, v, cu_seqlens, causal: bool, scale: float) -> torch.Tensor:
    """One padded SDPA (causal, its arithmetic within ``PAD_FACTOR`` of the per-sequence calls'), else per-sequence
    SDPA with the sequences of the same length in one batched call.

    Built from index_copy / index_select (padded) or split / stack / unbind / cat, whose backwards are one gather, one
    scatter into zeros, one concatenation or views: slicing each sequence out of the packed tensors instead would
    make autograd add one zero-filled ``[T, H, D]`` per sequence.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    gqa = q.shape[1] != k.shape[1]
    B, L_max, T = len(lengths), max(lengths, default=0), q.shape[0]
    if causal and B > 1 and B * L_max**2 <= PAD_FACTOR * sum(L * L for L in lengths):
        # token i of sequence b at row b · L_max + (i − cu[b]) of the padded batch; the padding rows stay 0 and,
        # after each sequence's tokens, only padding queries (dropped) attend to them
        seq_T = torch.repeat_interleave(torch.arange(B, device=q.device), cu_seqlens[1:] - cu_seqlens[:-1])
        row_T = seq_T * L_max + torch.arange(T, device=q.device) - cu_seqlens[:-1].long()[seq_T]

        def pad(x):  # [T, H, D] -> [B, H, L_max, D]
            rows = x.new_zeros(B * L_max, *x.shape[1:]).index_copy(0, row_T, x)
            return rows.view(B, L_max, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(B * L_max, *q.shape[1:]).index_select(0, row_T)  # [T, Hq, D]
    by_length: dict[int, list[int]] = {}
    for b, L in enumerate(lengths):
        if L > 0:
            by_length.setdefault(L, []).append(b)
    q_B, k_B, v_B = (torch.split(x, lengths) for x in (q, k, v))  # B pieces [L_b, H, D]
    outs: list[torch.Tensor | None] = [None] * len(lengths)
    for seqs in by_length.values():
        if len(seqs) == 1:
            qs, ks, vs = (x[seqs[0]].transpose(0, 1).unsqueeze(0) for x in (q_B, k_B, v_B))  # [1, H, L, D]
        else:
            qs, ks, vs = (torch.stack([x[b] for b in seqs]).transpose(1, 2) for x in (q_B, k_B, v_B))  # [n, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa)  # [n, Hq, L, D]
        for b, o_b in zip(seqs, o.transpose(1, 2).unbind(0)):
            outs[b] = o_b  # [L, Hq, D]
    return torch.cat([o for o in outs if o is not None])  # [T, Hq, D]


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """Packed causal attention; see the module docstring for the math.

    Args:
        q: ``[T, Hq, D]`` fp32/bf16/fp16 queries of all sequences, concatenated.
        k, v: ``[T, Hkv, D]`` keys and values, same dtype and device; ``Hq % Hkv == 0``.
        cu_seqlens: ``[B + 1]`` int32 offsets, ``0 = cu[0] ≤ cu[1] ≤ … ≤ cu[B] = T``.
        max_seqlen: an int ≥ the longest sequence (sizes the kernel grid).
        causal: mask keys after the query within each sequence.
        softmax_scale: defaults to ``D ** -0.5``.
    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, check_offsets=True)
    return _dispatch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale)


def varlen_attention_unchecked(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """:func:`varlen_attention` without reading ``cu_seqlens`` back to the host to check its values.

    For callers that built the offsets themselves and call once per layer (the Hugging Face integration):
    shapes, dtypes and devices are still checked; the offsets are trusted.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, check_offsets=False)
    return _dispatch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale)


def varlen_attention_torch(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """The plain-torch path of :func:`varlen_attention` on any device, offsets trusted as in the unchecked one.

    The Hugging Face integration runs it for CPU tensors even under ``TRITON_INTERPRET=1``: model-level forwards
    on CPU (the trainer, its tests) take the fast path; the kernel's own tests run the interpreter.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, check_offsets=False)
    return _varlen_attention_torch(q, k, v, cu_seqlens, bool(causal), _scale(q, softmax_scale))


def _scale(q, softmax_scale):
    return float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5


def _dispatch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    if use_triton(q):
        q, k, v, cu_seqlens = (x.contiguous() for x in (q, k, v, cu_seqlens))  # the kernels read unit strides
        return _VarlenAttention.apply(q, k, v, cu_seqlens, max_seqlen, bool(causal), _scale(q, softmax_scale))
    return _varlen_attention_torch(q, k, v, cu_seqlens, bool(causal), _scale(q, softmax_scale))
