"""Batch-invariant causal attention: one function for the engine's prefill, its decode (row cache or pages) and the
trainer's packed forward (``numerics.batch_invariant``; the exact-product idea is ``batch_invariant``'s).

For a query at position ``p`` of its sequence, over that sequence's keys ``0..p`` (GQA: query head ``h`` reads kv
head ``h // G``), with ``BK = KEY_BLOCK`` and the query's block start ``p₀ = BK ⌊p / BK⌋``::

    s_j  = scale · (q̃ · k̃_j)               exact dot on per-vector grids (q over D, each key over D), then fp32
    m    = max_{j ≤ p} s_j ;  P_j = exp(s_j − m) (fp32) ;  π_j = round(P_j · 2^24)   (π integer, ≤ 2^24)
    l    = Σ_{j ≤ p} π_j                                                            exact in fp64
    O_b  = Σ_{j ∈ block b} π_j · ṽ_j           b < p₀ / BK: the full blocks, v on a per-(block, feature) grid
                                                 (exact: 24 + 26 bits + 3 for 8 keys ≤ 53)
    Δ    = ((π_{p₀} v_{p₀} + π_{p₀+1} v_{p₀+1}) + …)   the diagonal block key by key from 0 (π = 0 past p)
    O    = (((0 + O_0) + O_1) + … + O_{p₀/BK − 1}) + Δ      left to right, fp64
    out  = O / l                                 cast to the input dtype

Every quantity of a query depends on its own keys ``0..p`` and on the fixed block structure of absolute key
positions, never on the other queries, the padding or the layout: a full block's grid holds only keys below
``p₀`` (present alike in the trainer's sequence and in the engine's cache at decode time), the diagonal block
(keys ``p₀..p``, whose later keys the trainer has and the engine does not yet) is summed key by key in order
(each ``π_j v_j`` exact in fp64: 24 + 24 bits), and keys past ``p`` count ``π = 0``. The keys are rounded onto
their grid once (:func:`key_grid`: the engine stores them so), the query at each call. Padding and the keys of
queries further on contribute exact zeros, which leave sums unchanged, and the masked values must be finite
(``0 · v``): the caller's padding is zeros and the engine's caches are zero-initialised.

Memory per call: the scores ``[B, Hq, M, L]`` in fp32 and π in fp64 (12 bytes a query-key pair), the full blocks'
products ``[B, Hkv, L / BK, G·M, D]`` fp64, the grids of q, k, v (fp64 copies). :func:`varlen_attention` splits a
packed batch so that a call holds at most ``PAIRS_PER_CALL`` query-key pairs per head. Cost: fp64 GEMMs for the
scores and the full blocks (about 2x fp32 SDPA's arithmetic there), the grids (a few elementwise passes over q and
over v per call), and ``BK`` multiply-adds per query and feature for the diagonal block, elementwise in fp64 (the
largest part for short sequences: 8 keys' worth of a query's attention, whatever its position). All on CPU.

Shape legend: B sequences, M queries each, L keys each (padded to a multiple of BK), Hq/Hkv heads, G = Hq / Hkv,
D head dim, T packed tokens.
"""

from __future__ import annotations

import math

import torch

from .batch_invariant import FP64_BITS, grid_values, product_bits, to_grid
from .varlen_attention import varlen_attention_torch

KEY_BLOCK = 8  # keys per block: full blocks are exact products, the diagonal one is summed key by key
PROB_BITS = 24  # π = round(P · 2^24): the probabilities' grid
VALUE_BITS = FP64_BITS - PROB_BITS - int(math.log2(KEY_BLOCK))  # 26: the values' grid in a full block's product
PAIRS_PER_CALL = 1 << 18  # query-key pairs per head in one call of varlen_attention (12 bytes each: 3 MiB a head)
BLOCK_PRODUCTS = 1 << 22  # fp64 entries of the full blocks' products held at once (32 MiB)


def key_grid(k: torch.Tensor) -> torch.Tensor:
    """Keys on their grid (per key vector, :func:`fastgrpo.kernels.batch_invariant.grid_values`, in ``k``'s dtype):
    what :func:`attention` reads. The engine stores keys this way in its cache (rounded once, when written), the
    packed forward rounds them before its call: the same values either way."""
    return grid_values(k, product_bits(k.shape[-1]))


def attention(q_BHMD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, qpos_BM: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention of queries ``q [B, Hq, M, D]`` at positions ``qpos [B, M]`` over their sequence's keys
    ``k, v [B, Hkv, L, D]`` (key ``j`` at position ``j``; a query at ``p`` reads keys ``0..p``, ``p < L``; ``k`` on
    its grid, :func:`key_grid`), as the module docstring computes it. Returns ``[B, Hq, M, D]`` in ``q``'s dtype.
    Keys past a query's position are never read into its result (any finite values there, zeros for padding)."""
    B, Hq, M, D = q_BHMD.shape
    Hkv, L = k_BHLD.shape[1], k_BHLD.shape[2]
    G, BK = Hq // Hkv, KEY_BLOCK
    Lp = -(-L // BK) * BK
    if Lp != L:  # zero keys: a masked key's value must be finite
        pad = (0, 0, 0, Lp - L)
        k_BHLD, v_BHLD = torch.nn.functional.pad(k_BHLD, pad), torch.nn.functional.pad(v_BHLD, pad)
    R = G * M  # the G query heads of a kv head as G·M rows
    pos_B1R1 = qpos_BM.repeat(1, G).view(B, 1, R, 1)
    keys_L = torch.arange(Lp, device=q_BHMD.device)

    q_tilde = to_grid(q_BHMD.reshape(B, Hkv, R, D), -1, min(product_bits(D), 24))  # [B, Hkv, R, D] fp64
    s = torch.matmul(q_tilde, k_BHLD.double().transpose(-1, -2))  # [B, Hkv, R, Lp], exact
    s_BHRL = (s * scale).float().masked_fill_(keys_L > pos_B1R1, -math.inf)
    del s
    p_BHRL = torch.exp(s_BHRL - s_BHRL.amax(-1, keepdim=True))
    pi_BHRL = (p_BHRL * 2.0**PROB_BITS).double().round_()  # P · 2^24 exact in fp32 (a power of two)
    l_BHR1 = pi_BHRL.sum(-1, keepdim=True)  # exact: integers, at most Lp · 2^24
    start_B1R1 = pos_B1R1 - pos_B1R1 % BK  # the diagonal block's first key

    nb = Lp // BK
    full = pi_BHRL.masked_fill(keys_L >= start_B1R1, 0.0).view(B, Hkv, R, nb, BK).transpose(2, 3)  # [B,Hkv,nb,R,BK]
    v_tilde = to_grid(v_BHLD.view(B, Hkv, nb, BK, D), -2, VALUE_BITS)  # per (block, feature)
    out_BHRD = q_BHMD.new_zeros(B, Hkv, R, D, dtype=torch.float64)
    step = max(1, BLOCK_PRODUCTS // max(B * Hkv * R * D, 1))  # blocks per product: bounds [B, Hkv, step, R, D]
    for b0 in range(0, nb, step):  # the blocks left to right, exact each (blocks at and past the diagonal are 0)
        blocks = torch.matmul(full[:, :, b0 : b0 + step], v_tilde[:, :, b0 : b0 + step])  # [B, Hkv, step, R, D]
        out_BHRD = torch.cat([out_BHRD[:, :, None], blocks], 2).cumsum(2)[:, :, -1]
    del full, v_tilde
    out_BHRD += diagonal_block(pi_BHRL, v_BHLD, qpos_BM)
    return (out_BHRD / l_BHR1).view(B, Hq, M, D).to(q_BHMD.dtype)


def diagonal_block(pi_BHRL: torch.Tensor, v_BHLD: torch.Tensor, qpos_BM: torch.Tensor) -> torch.Tensor:
    """``Σ_{j=0}^{BK−1} π_{p₀+j} v_{p₀+j}`` per query row (``p₀``: the start of the block holding the query), summed
    from 0 in key order (each term exact in fp64: 24 + 24 bits): the block's π and v picked by index, then a
    ``cumsum`` over its keys when ``[B, Hkv, R, BK, D]`` fits ``BLOCK_PRODUCTS``, else key by key; the same additions
    in the same order either way. ``[B, Hkv, R, D]`` fp64."""
    B, Hkv, R, Lp = pi_BHRL.shape
    M, D, BK = qpos_BM.shape[1], v_BHLD.shape[-1], KEY_BLOCK
    G = R // M
    block_BM = qpos_BM // BK
    rows_B1 = torch.arange(B, device=qpos_BM.device)[:, None]
    v_BMHKD = v_BHLD.view(B, Hkv, Lp // BK, BK, D).transpose(1, 2)[rows_B1, block_BM]  # [B, M, Hkv, BK, D]
    v_BH1MKD = v_BMHKD.permute(0, 2, 1, 3, 4).unsqueeze(2).double()  # [B, Hkv, 1, M, BK, D]
    pi_BHGMK = pi_BHRL.view(B, Hkv, G, M, Lp // BK, BK).gather(
        4, block_BM.view(B, 1, 1, M, 1, 1).expand(B, Hkv, G, M, 1, BK)).squeeze(4)  # [B, Hkv, G, M, BK]
    if B * Hkv * R * BK * D <= BLOCK_PRODUCTS:
        return (pi_BHGMK[..., None] * v_BH1MKD).cumsum(-2)[..., -1, :].reshape(B, Hkv, R, D)
    acc_BHGMD = pi_BHRL.new_zeros(B, Hkv, G, M, D)
    for j in range(BK):
        acc_BHGMD.addcmul_(pi_BHGMK[..., j, None], v_BH1MKD[..., j, :])
    return acc_BHGMD.view(B, Hkv, R, D)


class _VarlenAttention(torch.autograd.Function):
    """The invariant forward; the backward differentiates PyTorch's attention (``varlen_attention_torch``, the
    trainer's CPU path) recomputed on the same inputs: only forward values must be invariant."""

    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, cu_seqlens, scale):
        ctx.save_for_backward(q_THD, k_THD, v_THD, cu_seqlens)
        ctx.scale = scale
        return invariant_varlen(q_THD, key_grid(k_THD), v_THD, cu_seqlens, scale)

    @staticmethod
    def backward(ctx, do_THD):
        q, k, v, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out = varlen_attention_torch(q, k, v, cu_seqlens, longest, softmax_scale=ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do_THD)
        return dq, dk, dv, None, None


def varlen_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """:func:`invariant_varlen` on the keys put on their grid (:func:`key_grid`), differentiable in q, k and v (the
    backward is PyTorch's attention's, recomputed: one more attention forward per layer in the backward)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q_THD, k_THD, v_THD)):
        return _VarlenAttention.apply(q_THD, k_THD, v_THD, cu_seqlens, scale)
    return invariant_varlen(q_THD, key_grid(k_THD), v_THD, cu_seqlens, scale)


def invariant_varlen(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of a packed batch (``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with ``k`` on its grid, sequence
    ``b`` at tokens ``[cu[b], cu[b + 1])``, positions restarting at 0): :func:`attention` on sequences of close
    length padded into batches (shortest first), a sequence too long for one call in query chunks, at most
    ``PAIRS_PER_CALL`` query-key pairs a head per call. Each query's result is the one :func:`attention` gives it in
    any batch (the split only bounds memory). Returns ``[T, Hq, D]``. One host read of ``cu_seqlens``."""
    out = torch.empty_like(q_THD)
    bounds = cu_seqlens.tolist()
    lengths = {b: bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)}
    order = sorted(lengths, key=lengths.get)
    dev = q_THD.device
    i = 0
    while i < len(order):
        group = [order[i]]
        while i + len(group) < len(order) and (len(group) + 1) * lengths[order[i + len(group)]] ** 2 <= PAIRS_PER_CALL:
            group.append(order[i + len(group)])
        i += len(group)
        L = lengths[group[-1]]
        start_B1 = torch.tensor([bounds[b] for b in group], device=dev)[:, None]
        n_B1 = torch.tensor([lengths[b] for b in group], device=dev)[:, None]
        chunk = max(1, min(L, PAIRS_PER_CALL // L))  # queries per call of a sequence too long for one
        for m0 in range(0, L, chunk):
            m1 = min(L, m0 + chunk)
            kpos_BL = torch.arange(m1, device=dev).expand(len(group), m1)
            qpos_BM = kpos_BL[:, m0:m1]
            k, v = _padded(k_THD, start_B1, kpos_BL, n_B1), _padded(v_THD, start_B1, kpos_BL, n_B1)
            q = _padded(q_THD, start_B1, qpos_BM, n_B1)
            o_BMHD = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), qpos_BM, scale).transpose(1, 2)
            live_BM = qpos_BM < n_B1
            out.index_copy_(0, (start_B1 + qpos_BM)[live_BM], o_BMHD[live_BM])
    return out


def _padded(x_THD: torch.Tensor, start_B1: torch.Tensor, pos_BL: torch.Tensor, n_B1: torch.Tensor) -> torch.Tensor:
    """Tokens ``start + pos`` of each sequence as ``[B, L, H, D]``, zeros past its length ``n`` (one gather)."""
    live_BL = pos_BL < n_B1
    rows = x_THD.index_select(0, (start_B1 + pos_BL).clamp(max=x_THD.shape[0] - 1).flatten())
    return rows.view(*pos_BL.shape, *x_THD.shape[1:]).masked_fill_(~live_BL[..., None, None], 0.0)
