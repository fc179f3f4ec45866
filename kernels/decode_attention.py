"""Paged decode attention: one new query per sequence against its live keys in a paged KV cache (no autograd).

For sequence s, kv head h, and each of its G query heads g (query head ``h·G + g``)::

    O[s, h, g] = Σ_{j < len[s]} softmax_j(scale · q[s, h, g] · K[s, j, h]) · V[s, j, h]
    K[s, j] = k_pages[table[s, j // page_size], j % page_size]   (the same for V)

q ``[S, Hkv, G, D]`` (the G query heads of a kv head act as G query rows: no K/V repeat for GQA), k/v pages
``[pages, page_size, Hkv, D]`` (any strides but unit stride on D), ``block_table`` ``[S, P]`` int32 (the pages of
each sequence in token order), ``lengths`` ``[S]`` int32/int64 with ``1 ≤ len[s] ≤ P · page_size`` (not checked:
reading them would synchronise with the host, and the engine calls this inside a CUDA graph). Returns
``[S, Hkv, G, D]`` in q's dtype. Inference only: nothing is saved for a backward.

Paths: on CUDA and under ``TRITON_INTERPRET=1``, a split-K kernel (each program reads one slice of a
sequence's live keys through its block table, nothing past ``len[s]``) then a combine kernel; otherwise the pages
of the table are gathered into a contiguous ``[Hkv, S, P·page_size, D]`` copy and :func:`masked_attention` (SDPA
with the keys past each length masked) runs on it. The engine's CPU path uses ``masked_attention`` on its row cache.

Shape legend: S sequences, Hkv key/value heads, G query heads per kv head, P block-table width, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .utils import FLOAT_DTYPES, HAS_TRITON, check_tensor, dot_in_fp32, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_HEAD_DIM = 256
BLOCK_N = 64  # keys per inner step of the split kernel
MIN_PROGRAMS = 1024  # split the keys until about this many programs run (fills the GPU at small batch)


if HAS_TRITON:

    @triton.jit
    def _decode_attention_split_kernel(  # fmt: skip
        Q, K, V, TABLE, LEN,  # q [S, Hkv, G, D], k/v pages [pages, PAGE, Hkv, D], table [S, P], live length [S]
        O_part, M_part, L_part,  # [S, Hkv, splits, BLOCK_G, BLOCK_D], [S, Hkv, splits, BLOCK_G] ×2 (fp32)
        stride_qs, stride_qh, stride_qg,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_table, split_len, scale, PAGE,
        G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        FP32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One (sequence, kv head, split): the G query heads of the kv head against keys [split·len, (split+1)·len)
        ∩ [0, LEN[s]), each key found through the block table (page = table[s, j // PAGE], row j % PAGE). Reads G·D
        of q, n/PAGE table entries and 2·n·D of K/V (n = the live keys of the split, nothing past the length);
        writes the unnormalised output, row max and row sum of the online softmax for the combine."""
        s = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        n_splits = tl.num_programs(2)
        length = tl.load(LEN + s).to(tl.int32)
        start = split * split_len
        end = tl.minimum(start + split_len, length)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < D
        q = tl.load(
            Q + s * stride_qs + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
            mask=(offs_g[:, None] < G) & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_G, BLOCK_D]
        if FP32_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table = TABLE + s * stride_table
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            n_ok = n < end
            kv_ok = n_ok[:, None] & d_ok[None, :]
            page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)  # [BLOCK_N]
            row = n % PAGE
            k_ptr = K + page * stride_kp + row * stride_kt + h * stride_kh
            v_ptr = V + page * stride_vp + row * stride_vt + h * stride_vh
            k = tl.load(k_ptr[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
            if FP32_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N] fp32
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        part = (s * tl.num_programs(1) + h) * n_splits + split
        tl.store(O_part + part * BLOCK_G * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :], acc)
        tl.store(M_part + part * BLOCK_G + offs_g, m_i)
        tl.store(L_part + part * BLOCK_G + offs_g, l_i)

    @triton.jit
    def _decode_attention_combine_kernel(  # fmt: skip
        O_part, M_part, L_part, Out,  # partials as above; out [S, Hkv, G, D]
        n_splits, num_kv_heads, stride_os, stride_oh, stride_og,
        G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One (slot, kv head): out = Σ_i e^(m_i − m) o_i / Σ_i e^(m_i − m) l_i over the splits (m = max m_i).
        Reads the splits' partials (fp32), writes G·D. Split 0 always holds key 0 (len ≥ 1), so m is finite."""
        row = tl.program_id(0).to(tl.int64)
        s = row // num_kv_heads
        h = row % num_kv_heads
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for i in range(n_splits):
            part = row * n_splits + i
            m_i = tl.load(M_part + part * BLOCK_G + offs_g)
            l_i = tl.load(L_part + part * BLOCK_G + offs_g)
            o_i = tl.load(O_part + part * BLOCK_G * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :])
            m_new = tl.maximum(m, m_i)
            a = tl.exp(m - m_new)  # 0 at the first split (m = −inf, m_i finite)
            b = tl.exp(m_i - m_new)  # 0 for an empty split (m_i = −inf, m finite)
            acc = acc * a[:, None] + o_i * b[:, None]
            l = l * a + l_i * b
            m = m_new
        out = acc / l[:, None]
        ok = (offs_g[:, None] < G) & (offs_d[None, :] < D)
        ptr = Out + s * stride_os + h * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :]
        tl.store(ptr, out.to(Out.dtype.element_ty), mask=ok)


def _check_inputs(q, k_pages, v_pages, block_table, lengths) -> None:
    """Shapes, dtypes, devices and the unit stride on D; never the values of the table or lengths (no host sync)."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k_pages", k_pages, ndim=4, dtypes=(q.dtype,), device=q.device)
    check_tensor("v_pages", v_pages, ndim=4, dtypes=(q.dtype,), device=q.device)
    S, Hkv, _, D = q.shape
    if tuple(k_pages.shape) != tuple(v_pages.shape):
        raise ValueError(f"k_pages and v_pages must have the same shape, got {tuple(k_pages.shape)} and "
                         f"{tuple(v_pages.shape)}")
    if k_pages.shape[2] != Hkv or k_pages.shape[3] != D:
        raise ValueError(f"k_pages has shape {tuple(k_pages.shape)}, expected [pages, page_size, Hkv={Hkv}, D={D}]")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {D}; supported head dims are 1..{MAX_HEAD_DIM}")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride on its last (head) dim, got strides {t.stride()}")
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=q.device)
    if block_table.shape[0] != S or block_table.stride(1) != 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)} and strides {block_table.stride()}, "
                         f"expected [S={S}, P] with unit stride on P")
    check_tensor("lengths", lengths, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    if lengths.shape[0] != S:
        raise ValueError(f"lengths has shape {tuple(lengths.shape)}, expected [S={S}] to match q")


def _paged_decode_attention_triton(q_SHGD, k_pages, v_pages, table_SP, len_S, scale: float) -> torch.Tensor:
    S, Hkv, G, D = q_SHGD.shape
    page = k_pages.shape[1]
    T = table_SP.shape[1] * page  # the most keys a sequence can have
    BLOCK_G = max(16, triton.next_power_of_2(G))  # tl.dot wants 16 rows at least
    BLOCK_D = max(16, triton.next_power_of_2(D))
    splits = max(1, min(triton.cdiv(T, BLOCK_N), triton.cdiv(MIN_PROGRAMS, S * Hkv)))  # ≤ 1024
    split_len = triton.cdiv(triton.cdiv(T, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(T, split_len)
    dev = q_SHGD.device
    o_part = torch.empty(S, Hkv, splits, BLOCK_G, BLOCK_D, device=dev, dtype=torch.float32)
    m_part = torch.empty(S, Hkv, splits, BLOCK_G, device=dev, dtype=torch.float32)
    l_part = torch.empty(S, Hkv, splits, BLOCK_G, device=dev, dtype=torch.float32)
    _decode_attention_split_kernel[(S, Hkv, splits)](
        q_SHGD, k_pages, v_pages, table_SP, len_S, o_part, m_part, l_part,
        q_SHGD.stride(0), q_SHGD.stride(1), q_SHGD.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        table_SP.stride(0), split_len, scale, page,
        G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, FP32_DOT=dot_in_fp32(q_SHGD),
        DOT_PRECISION="ieee" if q_SHGD.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32 rounding)
        num_warps=4 if BLOCK_D >= 64 else 2,  # small heads: 4 warps spilled 24 B on sm_90 (bf16, D = 16)
    )  # fmt: skip
    out = torch.empty_like(q_SHGD, memory_format=torch.contiguous_format)  # [S, Hkv, G, D]
    _decode_attention_combine_kernel[(S * Hkv,)](
        o_part, m_part, l_part, out, splits, Hkv, out.stride(0), out.stride(1), out.stride(2),
        G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, num_warps=4,
    )  # fmt: skip
    return out


def paged_decode_attention_torch(q, k_pages, v_pages, block_table, lengths, *, softmax_scale=None) -> torch.Tensor:
    """The plain-torch path: gather the table's pages head-major into ``[Hkv, S, P·page_size, D]``, then
    :func:`masked_attention` with the keys past each length left out. Reads and copies ``P · page_size`` keys per
    sequence (all the table's columns).

    The gather is an ``index_select`` over the pool viewed ``[Hkv, pages, page_size, D]``: a block copy per page
    when the pool is stored head-major (the engine's layout, passed here as its ``[pages, page_size, Hkv, D]``
    permuted view); other strides are copied element-wise.
    """
    S, Hkv, G, D = q.shape
    T = block_table.shape[1] * k_pages.shape[1]
    pages = block_table.reshape(-1)
    k_HSTD = k_pages.permute(2, 0, 1, 3).index_select(1, pages).view(Hkv, S, T, D)
    v_HSTD = v_pages.permute(2, 0, 1, 3).index_select(1, pages).view(Hkv, S, T, D)
    live_1S1T = (torch.arange(T, device=q.device) < lengths[:, None]).view(1, S, 1, T)
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    return masked_attention(q.transpose(0, 1), k_HSTD, v_HSTD, live_1S1T, scale).transpose(0, 1)


def masked_attention(q, k, v, live, scale: float) -> torch.Tensor:
    """``softmax(scale · q kᵀ) v`` over the last two dims with only the keys where ``live`` is True (the plain-torch
    decode attention of this module and of the engine's CPU row cache): ``scaled_dot_product_attention`` with a
    boolean mask, the training forward's CPU attention (``varlen_attention``'s torch path), so generation and
    training round alike. On CPU this is the fused flash kernel (online softmax, no ``[.., G, T]`` scores stored):
    in the engine's decode step at ``bench_generation.py``'s sizes it took 227 µs a layer against 310 µs for
    explicit fp32 products and an in-place softmax (the previous path, 11 ops), the K/V cache-cold as in the step.

    q ``[B1, B2, G, D]``, k/v ``[B1, B2, T, D]`` (unit stride on D), ``live`` broadcastable to ``[B1, B2, G, T]``
    with at least one live key per row (a row with none would be NaN): bool (True = attend), or the additive mask
    SDPA makes of it, 0 where live and -inf elsewhere (the engine's, built once per step: the same result); the output
    ``[B1, B2, G, D]`` has q's dtype. The dead keys weigh exactly 0, but enter ``P V`` as ``0 · v``: they must be
    finite (the engine's caches are zero-filled).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=live, scale=scale)


def paged_decode_attention(q, k_pages, v_pages, block_table, lengths, *, softmax_scale=None) -> torch.Tensor:
    """``softmax(scale · q Kᵀ) V`` over each sequence's first ``lengths[s]`` keys, found through ``block_table`` (see
    the module docstring). q ``[S, Hkv, G, D]``, k/v pages ``[pages, page_size, Hkv, D]``, block_table ``[S, P]``
    int32, lengths ``[S]``; ``softmax_scale`` defaults to ``D ** -0.5``. Static shapes and no host synchronisation
    on any path, so it can run inside a CUDA graph.
    """
    _check_inputs(q, k_pages, v_pages, block_table, lengths)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if use_triton(q):
        return _paged_decode_attention_triton(q, k_pages, v_pages, block_table, lengths.contiguous(), scale)
    return paged_decode_attention_torch(q, k_pages, v_pages, block_table, lengths, softmax_scale=scale)
