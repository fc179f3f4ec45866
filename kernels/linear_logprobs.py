"""Log-probs (and entropy) of target tokens straight from hidden states, never materialising the logits.

Math, per token ``i`` with hidden row ``h_i`` ``[H]``, LM head ``W`` ``[V, H]``, optional bias ``b`` ``[V]``::

    z_iv   = (h_i · W_v + b_v) / T                     (T = temperature)
    lse_i  = log Σ_v exp(z_iv)
    logp_i = z_{i, y_i} − lse_i
    H_i    = −Σ_v p_iv log p_iv = lse_i − Σ_v p_iv z_iv,   p_iv = exp(z_iv − lse_i)

Backward, with upstream gradients ``g_i`` (of ``logp_i``) and ``e_i`` (of ``H_i``)::

    dz_iv  = [g_i (1[v = y_i] − p_iv) − e_i p_iv (log p_iv + H_i)] / T
    grad_h = dz @ W,   grad_W = dzᵀ @ h,   grad_b = Σ_i dz_i

Neither the ``[N, V]`` logits nor ``dz`` ever exist in memory: the forward streams vocabulary tiles with an online
log-sum-exp and keeps O(N) per-token state (the LSE, and the entropy when asked); the backward recomputes each tile's
logits from ``h`` and ``W`` (Cut Cross-Entropy, Wijmans et al. 2024).

Masking and packing: this op is per token, so it needs no ``cu_seqlens``. Pass only the rows you need (packed
``[N, H]``), or pass padded ``[B, T, H]`` (just reshaped to ``[B·T, H]``) and apply the mask to the result.

Paths (``kernels/utils.use_triton``): Triton on CUDA and under ``TRITON_INTERPRET=1``; otherwise a plain-torch path
chunked over tokens and vocabulary with the same memory promise (nothing ``[N, V]``; the only ``[V, H]`` buffer is
the one fp32 gradient accumulator). With ``numerics.batch_invariant`` on (``batch_invariant.enabled()``), the
forward is ``batch_invariant.linear_logprobs`` on CPU and CUDA (the generation engine's sampled log-probs bit for
bit) and the backward the Triton one on CUDA, the plain-torch one elsewhere (only forward values must be invariant).

The Triton functions and launch choices it shares with the distillation kernels are in ``vocab_tiles.py``.

Shape legend: N tokens, H hidden size, V vocabulary, S vocabulary splits of the forward grid.
"""

from __future__ import annotations

import math

import torch

from . import batch_invariant
from .utils import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_shape,
    check_targets,
    check_tensor,
    dot_in_fp32,
    launch_first_fitting,
    use_triton,
)
from .vocab_tiles import GROUP_N, input_precision, launch_configs, split_grid

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .vocab_tiles import accumulate_grads, grouped_tile, tile_logits

# Plain-torch path: token × vocabulary chunk. The per-chunk temporaries are two or three [TORCH_CHUNK_N, TORCH_CHUNK_V]
# fp32 tensors (8 MiB each). Smaller chunks stay in cache (faster on an idle machine), but every op over a chunk is
# one parallel region of the CPU thread pool, and on a loaded machine each region waits for its slowest thread:
# this size keeps the region count low (measured at N=4096, H=256, V=32000 against 1024×1024 and 2048×2048).
TORCH_CHUNK_N = 2048
TORCH_CHUNK_V = 1024


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _linear_logprobs_fwd_kernel(
        h_ptr, w_ptr, b_ptr, y_ptr,  # [N, H], [V, H], [V], [N]
        m_ptr, s_ptr, t_ptr, zy_ptr,  # partial states [S, N] fp32
        N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_temp, tiles_per_split,
        HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (token tile, vocabulary split): online LSE over the split's vocabulary tiles.

        Per token row, over the split: reads its hidden row once per vocabulary tile (``V_split/BLOCK_V · H``
        elements, from L2) and ``V_split · H / N_tile`` of ``W`` amortised over the tile; writes 4 fp32 partials
        (running max ``m``, ``s = Σ exp(z − m)``, ``t = Σ exp(z − m)·(z − m)``, target logit ``z_y`` when in
        range). Entropy = ``log s − t / s``: small terms, no cancellation against ``lse``.
        FLOPs: 2·H per (token, vocabulary) pair.
        """
        pid_n = tl.program_id(0).to(tl.int64)
        pid_s = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        y = tl.load(y_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)  # [BLOCK_N]
        m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        s = tl.zeros((BLOCK_N,), dtype=tl.float32)
        t = tl.zeros((BLOCK_N,), dtype=tl.float32)
        zy = tl.zeros((BLOCK_N,), dtype=tl.float32)
        v_start = pid_s * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
        for v0 in range(v_start, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            z = tile_logits(h_ptr, w_ptr, b_ptr, offs_n, mask_n, offs_v, mask_v, H, stride_hn, stride_hk,
                             stride_wv, stride_wk, inv_temp, HAS_BIAS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                             BLOCK_K)  # [BLOCK_N, BLOCK_V]
            z = tl.where(mask_v[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: every tile holds a valid column
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new[:, None])  # [BLOCK_N, BLOCK_V], 0 on masked columns
            if ENTROPY:  # t = Σ exp(z − m)·(z − m), re-centred on the new max (s = 0 while m = −inf)
                shift = s * (tl.where(s > 0, m, m_new) - m_new)
                t = alpha * (t + shift) + tl.sum(e * tl.where(mask_v[None, :], z - m_new[:, None], 0.0), axis=1)
            s = s * alpha + tl.sum(e, axis=1)
            zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), axis=1)
            m = m_new
        out = pid_s * N + offs_n
        tl.store(m_ptr + out, m, mask=mask_n)
        tl.store(s_ptr + out, s, mask=mask_n)
        tl.store(zy_ptr + out, zy, mask=mask_n)
        if ENTROPY:
            tl.store(t_ptr + out, t, mask=mask_n)

    @triton.jit
    def _linear_logprobs_bwd_kernel(
        h_ptr, w_ptr, b_ptr, y_ptr,  # [N, H], [V, H], [V], [N]
        lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,  # [N] fp32
        gh_ptr, gw_ptr, gb_ptr,  # fp32 accumulators [N, H], [V, H], [V] (contiguous, zero-initialised)
        N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_temp, filter_eps,
        HAS_BIAS: tl.constexpr, GRAD_H: tl.constexpr, GRAD_W: tl.constexpr, GRAD_B: tl.constexpr,
        ENTROPY_GRAD: tl.constexpr, FILTER: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    ):
        """Program (token tile, vocabulary tile): recompute the tile's logits, form ``dz``, accumulate the grads.

        Design: one kernel over the 2-D grid with fp32 atomics into ``grad_h`` and ``grad_W`` (as Cut Cross-Entropy),
        so each tile's logits are recomputed once. FLOPs per tile: 3 matmuls of ``2·BLOCK_N·BLOCK_V·H``
        (recompute, ``dz @ W``, ``dzᵀ @ h``) → with the forward, the 4 N×H×V matmuls of the issue's count.
        Bytes per tile: reads ``(BLOCK_N + BLOCK_V)·H`` inputs twice (mostly L2 hits), atomically adds
        ``(BLOCK_N + BLOCK_V)·H`` fp32: ``6·BN·BV·H / (4·(BN + BV)·H)`` = 96 FLOP per atomically added byte at
        128×128 (the read-modify-write happens in L2). Whole backward: 6·N·V·H FLOPs, ``4·N·V·H·(1/BN + 1/BV)``
        atomic bytes; no ``[N, V]`` buffer; one fp32 ``[V, H]`` and one fp32 ``[N, H]`` accumulator.
        Programs run grouped (``GROUP_N`` token tiles × all vocabulary tiles) so the ones in flight share ``W``
        and ``h`` tiles in L2 and spread their atomics over different rows.

        With ``FILTER``, a tile whose probabilities are all below ``filter_eps`` and which holds no target skips the
        two gradient matmuls (its ``dz`` entries are each at most ``(|g| + |e|·(|log eps| + H)) · eps / T``).
        """
        pid_n, pid_v = grouped_tile(tl.program_id(0), N, V, BLOCK_N, BLOCK_V, GROUP_N)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < N
        mask_v = offs_v < V
        z = tile_logits(h_ptr, w_ptr, b_ptr, offs_n, mask_n, offs_v, mask_v, H, stride_hn, stride_hk, stride_wv,
                         stride_wk, inv_temp, HAS_BIAS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                         BLOCK_K)  # [BLOCK_N, BLOCK_V]
        y = tl.load(y_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)
        lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
        g = tl.load(g_logp_ptr + offs_n, mask=mask_n, other=0.0)
        valid = mask_n[:, None] & mask_v[None, :]
        logp = z - lse[:, None]  # [BLOCK_N, BLOCK_V] log p
        p = tl.where(valid, tl.exp(logp), 0.0)
        is_y = (offs_v[None, :] == y[:, None]) & valid
        dz = g[:, None] * (is_y.to(tl.float32) - p)
        if ENTROPY_GRAD:
            ent = tl.load(ent_ptr + offs_n, mask=mask_n, other=0.0)
            ge = tl.load(g_ent_ptr + offs_n, mask=mask_n, other=0.0)
            dz -= ge[:, None] * p * (logp + ent[:, None])
        dz = tl.where(valid, dz * inv_temp, 0.0)

        keep = True
        if FILTER:
            keep = (tl.max(tl.max(p, axis=1), axis=0) >= filter_eps) | (tl.max(tl.max(is_y.to(tl.int32), axis=1),
                                                                               axis=0) > 0)
        if keep:
            accumulate_grads(dz, h_ptr, w_ptr, gh_ptr, gw_ptr, gb_ptr, offs_n, mask_n, offs_v, mask_v, H, stride_hn,
                             stride_hk, stride_wv, stride_wk, GRAD_H, GRAD_W, GRAD_B, DOT_FP32, INPUT_PRECISION,
                             BLOCK_K)


# Launch configurations (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages) on a GPU, largest tiles first, tried in
# order until one fits (``utils.launch_first_fitting``), keyed by the element size. Shared memory is dominated by
# the pipelined K loop of ``tile_logits``: num_stages·(BLOCK_N + BLOCK_V)·BLOCK_K elements (the backward also
# stages its dz tile and the grad tiles), so fp32 takes half the tiles of bf16/fp16. The first entries fit sm_80's
# 163 KiB and sm_90's 227 KiB per block with no register spills in bf16; `pytest -m gpu_compile` checks every entry.
FWD_CONFIGS = {
    2: [(128, 128, 64, 8, 3), (64, 128, 64, 4, 2), (32, 64, 32, 4, 1)],
    4: [(64, 128, 32, 8, 3), (64, 64, 32, 4, 2), (32, 64, 32, 4, 1)],
}
BWD_CONFIGS = {
    2: [(128, 128, 64, 8, 2), (64, 128, 64, 4, 2), (32, 64, 32, 4, 1)],
    4: [(64, 128, 32, 8, 2), (64, 64, 32, 4, 2), (32, 64, 32, 4, 1)],
}
def _launch_key(name: str, t: torch.Tensor) -> tuple:
    return ("linear_logprobs", name, t.dtype, t.device.index)


def _forward_triton(h_NH, w_VH, b_V, y_N, inv_temp, entropy):
    N, H = h_NH.shape
    V = w_VH.shape[0]
    parts = []

    def launch(config):
        block_n, block_v, block_k, warps, stages = config
        n_tiles, splits, tiles_per_split = split_grid(N, V, block_n, block_v, h_NH)
        m_SN, s_SN, t_SN, zy_SN = (torch.empty(splits, N, device=h_NH.device, dtype=torch.float32) for _ in range(4))
        _linear_logprobs_fwd_kernel[(n_tiles, splits)](
            h_NH, w_VH, b_V if b_V is not None else h_NH, y_N, m_SN, s_SN, t_SN, zy_SN,
            N, V, H, h_NH.stride(0), h_NH.stride(1), w_VH.stride(0), w_VH.stride(1), inv_temp, tiles_per_split,
            HAS_BIAS=b_V is not None, ENTROPY=entropy, DOT_FP32=dot_in_fp32(h_NH),
            INPUT_PRECISION=input_precision(h_NH), BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages,
        )
        parts[:] = [m_SN, s_SN, t_SN, zy_SN]

    launch_first_fitting(_launch_key("fwd", h_NH), launch_configs(h_NH, FWD_CONFIGS), launch)
    m_SN, s_SN, t_SN, zy_SN = parts
    # Combine the splits' partials: O(S·N). Re-centred on the global max m_N: s_s → s_s·a_s,
    # t_s → a_s·(t_s + s_s·(m_s − m_N)) with a_s = exp(m_s − m_N).
    m_N = m_SN.max(0).values
    scale_SN = torch.exp(m_SN - m_N)
    sum_N = (s_SN * scale_SN).sum(0)
    lse_N = m_N + torch.log(sum_N)
    logp_N = zy_SN.sum(0) - lse_N
    ent_N = None
    if entropy:
        ent_N = torch.log(sum_N) - (scale_SN * (t_SN + s_SN * (m_SN - m_N))).sum(0) / sum_N
    return logp_N, lse_N, ent_N


def _backward_triton(h_NH, w_VH, b_V, y_N, lse_N, ent_N, g_logp_N, g_ent_N, inv_temp, filter_eps, needs):
    N, H = h_NH.shape
    V = w_VH.shape[0]
    f32 = dict(dtype=torch.float32, device=h_NH.device)
    gh_NH = torch.zeros(N, H, **f32) if needs[0] else None
    gw_VH = torch.zeros(V, H, **f32) if needs[1] else None  # the one fp32 [V, H] accumulator
    gb_V = torch.zeros(V, **f32) if needs[2] else None
    dummy = lse_N

    def launch(config):  # a config that does not fit fails at launch, before any atomic add
        block_n, block_v, block_k, warps, stages = config
        grid = (triton.cdiv(N, block_n) * triton.cdiv(V, block_v),)
        _linear_logprobs_bwd_kernel[grid](
            h_NH, w_VH, b_V if b_V is not None else h_NH, y_N, lse_N,
            ent_N if g_ent_N is not None else lse_N, g_logp_N, g_ent_N if g_ent_N is not None else g_logp_N,
            *(x if x is not None else dummy for x in (gh_NH, gw_VH, gb_V)),
            N, V, H, h_NH.stride(0), h_NH.stride(1), w_VH.stride(0), w_VH.stride(1), inv_temp,
            filter_eps if filter_eps is not None else 0.0,
            HAS_BIAS=b_V is not None, GRAD_H=needs[0], GRAD_W=needs[1], GRAD_B=needs[2],
            ENTROPY_GRAD=g_ent_N is not None, FILTER=filter_eps is not None,
            DOT_FP32=dot_in_fp32(h_NH), INPUT_PRECISION=input_precision(h_NH), GROUP_N=GROUP_N,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )

    launch_first_fitting(_launch_key("bwd", h_NH), launch_configs(h_NH, BWD_CONFIGS), launch)
    return gh_NH, gw_VH, gb_V


# ----------------------------------------------------------------------------------------------------------------------
# Plain-torch path (CPU without the interpreter): chunked, same memory promise
# ----------------------------------------------------------------------------------------------------------------------
def chunk_logits(h_nH, w_VH, b_V, v0, v1, inv_temp, out_nv, lse_n=None):
    """``z = (h @ W[v0:v1]ᵀ + b[v0:v1]) / T`` in fp32 into ``out_nv`` ``[n, v1 − v0]``, minus ``lse_n`` per row when
    given. One ``addmm`` where it can (bias, temperature and the LSE folded into it): each pass over a chunk costs."""
    w_vH = w_VH[v0:v1].float()
    if b_V is not None:
        z_nv = torch.addmm(b_V[v0:v1].float(), h_nH, w_vH.t(), beta=inv_temp, alpha=inv_temp, out=out_nv)
        return z_nv if lse_n is None else z_nv.sub_(lse_n[:, None])
    if lse_n is not None:
        return torch.addmm(-lse_n[:, None], h_nH, w_vH.t(), alpha=inv_temp, out=out_nv)
    z_nv = torch.mm(h_nH, w_vH.t(), out=out_nv)
    return z_nv if inv_temp == 1.0 else z_nv.mul_(inv_temp)


def chunk_buffers(count, n, device):
    """``count`` flat fp32 buffers of one chunk, reused by every chunk (no allocator churn, no fresh pages)."""
    return [torch.empty(min(n, TORCH_CHUNK_N) * TORCH_CHUNK_V, dtype=torch.float32, device=device)
            for _ in range(count)]


def as_2d_view(buf, n, v):
    """The first ``n · v`` elements of a flat chunk buffer as an ``[n, v]`` view."""
    return buf[:n * v].view(n, v)


def _target_logits(h_nH, w_VH, b_V, y_n, inv_temp):
    """``z_{i, y_i} = (h_i · W_{y_i} + b_{y_i}) / T`` as a row dot product: one ``[n, H]`` gather, no logits."""
    zy_n = torch.linalg.vecdot(h_nH, w_VH[y_n].float())
    if b_V is not None:
        zy_n += b_V[y_n].float()
    return zy_n.mul_(inv_temp)


def _forward_torch(h_NH, w_VH, b_V, y_N, inv_temp, entropy):
    """Target logits as row dot products (``_target_logits``); per token chunk, stream vocabulary chunks. Each
    chunk's own log-softmax (one fused pass) gives its LSE ``lse_c = max z − max log_softmax(z)`` (exact to
    rounding: read where ``log p_c ≈ 0``) and its entropy ``H_c = −Σ p_c log p_c``. Merging parts with
    weights ``w_c = exp(lse_c − lse)``: ``lse = logaddexp(lse_a, lse_b)``, ``H = Σ_c w_c (H_c − log w_c)`` (all
    terms ≥ 0: no cancellation, unlike ``lse − E[z]``). Chunk buffers, reused: ``z``, its log-softmax (and ``p_c``
    for the entropy)."""
    N = h_NH.shape[0]
    V = w_VH.shape[0]
    f32 = dict(dtype=torch.float32, device=h_NH.device)
    lse_N, zy_N = torch.empty(N, **f32), torch.empty(N, **f32)
    ent_N = torch.empty(N, **f32) if entropy else None
    bufs = chunk_buffers(3 if entropy else 2, N, h_NH.device)
    for n0 in range(0, N, TORCH_CHUNK_N):
        n1 = min(n0 + TORCH_CHUNK_N, N)
        n = n1 - n0
        h_nH = h_NH[n0:n1].float()
        zy_N[n0:n1] = _target_logits(h_nH, w_VH, b_V, y_N[n0:n1], inv_temp)
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            z_nv = chunk_logits(h_nH, w_VH, b_V, v0, v1, inv_temp, as_2d_view(bufs[0], n, v1 - v0))
            logp_c_nv = torch.log_softmax(z_nv, 1, out=as_2d_view(bufs[1], n, v1 - v0))
            lse_c_n = z_nv.amax(1) - logp_c_nv.amax(1)  # two plain max passes: cheaper than one max with indices
            ent_c_n = None
            if entropy:
                p_c_nv = torch.exp(logp_c_nv, out=as_2d_view(bufs[2], n, v1 - v0))
                ent_c_n = torch.linalg.vecdot(p_c_nv, logp_c_nv).neg_()
            if v0 == 0:
                lse_n, ent_n = lse_c_n, ent_c_n
                continue
            lse_new = torch.logaddexp(lse_n, lse_c_n)
            if entropy:
                log_wa_n, log_wc_n = lse_n - lse_new, lse_c_n - lse_new
                ent_n = log_wa_n.exp() * (ent_n - log_wa_n) + log_wc_n.exp() * (ent_c_n - log_wc_n)
            lse_n = lse_new
        lse_N[n0:n1] = lse_n
        if entropy:
            ent_N[n0:n1] = ent_n
    return zy_N - lse_N, lse_N, ent_N


def _backward_torch(h_NH, w_VH, b_V, y_N, lse_N, ent_N, g_logp_N, g_ent_N, inv_temp, filter_eps, needs):
    """Split ``dz = dz' + (g/T) 1[v = y]``. The target term is added once per token chunk (a gather and two
    ``index_add_``). Per (token chunk, vocabulary chunk): ``log p`` from one ``addmm`` into a reused buffer, then
    ``dz'``. Without the entropy ``dz' = −(g/T) p`` has a per-row factor, which goes into the matmuls instead of a
    pass over the chunk: ``grad_h_chunk = −(g/T) ⊙ Σ_v p_v @ W_v``, ``grad_W[v] += p_vᵀ @ (−(g/T) ⊙ h_chunk)``,
    ``grad_b[v] += p_vᵀ (−g/T)``. With it, ``dz' = −p (g + e (log p + H)) / T`` is built in place."""
    N, H = h_NH.shape
    V = w_VH.shape[0]
    f32 = dict(dtype=torch.float32, device=h_NH.device)
    gh_NH = torch.zeros(N, H, **f32) if needs[0] else None
    gw_VH = torch.zeros(V, H, **f32) if needs[1] else None  # the one fp32 [V, H] accumulator, added to in place
    gb_V = torch.zeros(V, **f32) if needs[2] else None
    bufs = chunk_buffers(1 if g_ent_N is None else 2, N, h_NH.device)
    for n0 in range(0, N, TORCH_CHUNK_N):
        n1 = min(n0 + TORCH_CHUNK_N, N)
        n = n1 - n0
        h_nH, y_n, lse_n = h_NH[n0:n1].float(), y_N[n0:n1], lse_N[n0:n1]
        g_n1 = g_logp_N[n0:n1, None] * inv_temp  # [n, 1]
        if g_ent_N is None:
            neg_g_n1 = -g_n1
            hg_nH = h_nH * neg_g_n1  # −(g/T) ⊙ h
        else:
            e_n1, ent_n1 = -g_ent_N[n0:n1, None] * inv_temp, ent_N[n0:n1, None]
        right_n = neg_g_n1[:, 0] if g_ent_N is None else torch.ones(n, **f32)  # grad_b[v] += dz_vᵀ right_n
        gh_nH = gh_NH[n0:n1] if gh_NH is not None else None
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            logp_nv = chunk_logits(h_nH, w_VH, b_V, v0, v1, inv_temp, as_2d_view(bufs[0], n, v1 - v0), lse_n)
            if filter_eps is not None and not bool(((y_n >= v0) & (y_n < v1)).any()) \
                    and float(logp_nv.max()) < math.log(filter_eps):
                continue  # host read: CPU tensors, no device sync
            if g_ent_N is None:
                dz_nv, left_nH = logp_nv.exp_(), hg_nH  # p; the factor −g/T is in left_nH and applied to gh_nH
            else:  # −p (g + e (log p + H)) / T
                p_nv = torch.exp(logp_nv, out=as_2d_view(bufs[1], n, v1 - v0))
                dz_nv, left_nH = logp_nv.add_(ent_n1).mul_(e_n1).sub_(g_n1).mul_(p_nv), h_nH
            if gh_nH is not None:
                gh_nH.addmm_(dz_nv, w_VH[v0:v1].float())
            if gw_VH is not None:
                gw_VH[v0:v1].addmm_(dz_nv.t(), left_nH)
            if gb_V is not None:
                gb_V[v0:v1].addmv_(dz_nv.t(), right_n)
        if gh_nH is not None:
            if g_ent_N is None:
                gh_nH.mul_(neg_g_n1)
            gh_nH.addcmul_(w_VH[y_n].float(), g_n1)  # target term: + (g/T) W_y
        if gw_VH is not None:
            gw_VH.index_add_(0, y_n, h_nH * g_n1)  # target term: + (g/T) h into row y
        if gb_V is not None:
            gb_V.index_add_(0, y_n, g_n1[:, 0])
    return gh_NH, gw_VH, gb_V


# ----------------------------------------------------------------------------------------------------------------------
# autograd and the functional API
# ----------------------------------------------------------------------------------------------------------------------
class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NH, w_VH, b_V, y_N, temperature, return_entropy, grad_filter_eps):
        kernel = use_triton(h_NH)
        inv_temp = 1.0 / temperature
        fwd = _forward_triton if kernel else _forward_torch
        if batch_invariant.enabled():  # the engine's sampled log-probs, bit for bit; the backward stays the fast one
            fwd, kernel = batch_invariant.linear_logprobs, kernel and h_NH.is_cuda
        logp_N, lse_N, ent_N = fwd(h_NH, w_VH, b_V, y_N, inv_temp, return_entropy)
        ctx.save_for_backward(h_NH, w_VH, b_V, y_N, lse_N, ent_N)
        ctx.kernel, ctx.inv_temp, ctx.grad_filter_eps = kernel, inv_temp, grad_filter_eps
        ctx.set_materialize_grads(False)
        if return_entropy:
            return logp_N, ent_N
        return logp_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N=None):
        h_NH, w_VH, b_V, y_N, lse_N, ent_N = ctx.saved_tensors
        if g_logp_N is None and g_ent_N is None:
            return None, None, None, None, None, None, None
        if g_logp_N is None:
            g_logp_N = torch.zeros_like(lse_N)
        needs = ctx.needs_input_grad[:3]  # a frozen head skips its [V, H] accumulator and a third of the work
        if not any(needs):
            return None, None, None, None, None, None, None
        bwd = _backward_triton if ctx.kernel else _backward_torch
        grads = bwd(h_NH, w_VH, b_V, y_N, lse_N, ent_N, g_logp_N.float().contiguous(),
                    None if g_ent_N is None else g_ent_N.float().contiguous(), ctx.inv_temp, ctx.grad_filter_eps,
                    needs)
        grads = [None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (h_NH, w_VH, b_V))]
        return *grads, None, None, None, None


def _check_inputs(hidden, weight, targets, bias, temperature, grad_filter_eps, ignore_index=None):
    check_tensor("hidden", hidden, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("targets", targets, device=hidden.device)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: its dim 1 must equal hidden's last dim "
                         f"{hidden.shape[-1]}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(hidden.dtype,), device=hidden.device)
        check_shape("bias", bias, (weight.shape[0],), "weight's vocabulary dim")
    check_shape("targets", targets, tuple(hidden.shape[:-1]), "hidden's leading dims")
    check_targets("targets", targets, weight.shape[0], ignore_index)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if grad_filter_eps is not None and not (isinstance(grad_filter_eps, float) and 0.0 < grad_filter_eps < 1.0):
        raise ValueError(f"grad_filter_eps must be None or a float in (0, 1), got {grad_filter_eps!r}")


def fused_linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False,
                          grad_filter_eps=None):
    """Log-prob of ``targets`` under ``softmax((hidden @ weightᵀ + bias) / temperature)``, without the logits.

    Args:
        hidden: ``[N, H]`` (packed) or ``[B, T, H]`` (padded; reshaped, masking is the caller's) fp32/bf16/fp16.
            Any strides: the kernel reads through them (a 3-D input is reshaped, which copies only when its
            layout requires).
        weight: ``[V, H]`` LM head, same dtype and device; any strides (targets and bias too). Tied embeddings
            need nothing special: autograd adds this op's gradient to the embedding's.
        targets: int64/int32 token ids in ``[0, V)``, shape ``hidden.shape[:-1]``.
        bias: optional ``[V]``, same dtype.
        temperature: ``T > 0``; the logits are divided by it.
        return_entropy: also return the entropy ``H = −Σ_v p_v log p_v`` of the same distribution (differentiable).
        grad_filter_eps: off (``None``) by default. When set, the backward skips vocabulary tiles (chunks on the
            torch path) whose probabilities are all below it and that hold no target. The dropped gradient entries
            are each bounded by ``(|∂/∂logp| + |∂/∂H|·(|log eps| + H)) · eps / T``; the forward is exact.

    Returns:
        fp32 ``logp`` with ``targets``' shape, or ``(logp, entropy)``. No ``cu_seqlens`` is needed: the op is per
        token. Memory: O(N) per-token state; nothing of size N×V in the forward or the backward; the backward
        allocates one fp32 ``[V, H]`` gradient accumulator (and fp32 ``[N, H]``).
    """
    _check_inputs(hidden, weight, targets, bias, temperature, grad_filter_eps)
    h_NH = hidden.reshape(-1, hidden.shape[-1])
    y_N = targets.reshape(-1).contiguous()  # the kernels read targets and bias with unit stride
    b_V = None if bias is None else bias.contiguous()
    out = _LinearLogprobs.apply(h_NH, weight, b_V, y_N, float(temperature), bool(return_entropy), grad_filter_eps)
    if return_entropy:
        return out[0].view(targets.shape), out[1].view(targets.shape)
    return out.view(targets.shape)


def fused_linear_cross_entropy(hidden, weight, targets, *, bias=None, ignore_index=-100, reduction="mean",
                               grad_filter_eps=None):
    """SFT loss ``−logp(y)`` from hidden states without logits; tokens whose target is ``ignore_index`` count 0.

    ``reduction``: ``"mean"`` = Σ over kept tokens / number of kept tokens (0 when none is kept), ``"sum"``, or
    ``"none"`` (fp32, ``targets``' shape, 0 at ignored tokens). Ignored rows are dropped before the vocabulary
    work, so prompt tokens cost nothing. Other arguments as :func:`fused_linear_logprobs`.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    _check_inputs(hidden, weight, targets, bias, 1.0, grad_filter_eps, ignore_index=ignore_index)
    keep = targets != ignore_index  # [...]
    h_NH = hidden.reshape(-1, hidden.shape[-1])
    keep_N = keep.reshape(-1)
    # a zero that still reaches hidden, weight and bias, so backward works when every token is ignored
    zero = h_NH[:1, :1].float().sum() * 0.0 + weight[:1, :1].float().sum() * 0.0
    if bias is not None:
        zero = zero + bias[:1].float().sum() * 0.0
    nll_N = zero + torch.zeros(keep_N.shape, dtype=torch.float32, device=hidden.device)
    if bool(keep_N.any()):  # host read: the kept rows' count sets the shape of the work
        kept = keep_N.nonzero().squeeze(1)
        logp_K = fused_linear_logprobs(h_NH.index_select(0, kept), weight, targets.reshape(-1)[kept], bias=bias,
                                       grad_filter_eps=grad_filter_eps)
        nll_N = nll_N.index_put((kept,), -logp_K)
    if reduction == "none":
        return nll_N.view(targets.shape)
    if reduction == "sum":
        return nll_N.sum()
    return nll_N.sum() / keep_N.sum().clamp(min=1)


def masked_linear_logprobs(hidden, weight, targets, keep, *, bias=None, temperature=1.0, return_entropy=False):
    """``fused_linear_logprobs`` on the rows where ``keep`` is True only, 0 elsewhere (fp32, ``keep``'s shape).

    Masked-out rows (prompt tokens, padding) cost no vocabulary work and their targets are never read. The kept
    rows are gathered (a copy of ``K × H`` hidden values); their count is read back to the host once per call,
    since it sets the shape of the work. With no kept row the result is zeros that still reach ``hidden``,
    ``weight`` and ``bias`` (so that backward runs and gives zero gradients).
    """
    h_NH = hidden.reshape(-1, hidden.shape[-1])
    keep_N = keep.reshape(-1)
    kept = keep_N.nonzero().squeeze(1)  # [K], host sync: K sets the shape of the work
    zero = h_NH[:1, :1].float().sum() * 0.0 + weight[:1, :1].float().sum() * 0.0  # 0-d, reaches the parameters
    if bias is not None:
        zero = zero + bias[:1].float().sum() * 0.0
    outs = [zero + torch.zeros(keep_N.shape, device=hidden.device, dtype=torch.float32)
            for _ in range(2 if return_entropy else 1)]  # [N] each
    if kept.numel():
        res = fused_linear_logprobs(h_NH.index_select(0, kept), weight, targets.reshape(-1)[kept], bias=bias,
                                    temperature=temperature, return_entropy=return_entropy)
        res = res if return_entropy else (res,)
        outs = [o.index_put((kept,), r) for o, r in zip(outs, res)]
    outs = [o.view(keep.shape) for o in outs]
    return tuple(outs) if return_entropy else outs[0]
