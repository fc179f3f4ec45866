"""Batch-invariant causal attention: one function for the engine's prefill, its decode (row cache or pages) and the
trainer's packed forward (``numerics.batch_invariant``; the exact-product idea is ``batch_invariant``'s).

For a query at position ``p`` of its sequence, over that sequence's keys ``0..p`` (GQA: query head ``h`` reads kv
head ``h // G``), with ``BK = KEY_BLOCK`` and the query's block start ``p₀ = BK ⌊p / BK⌋``::

    s_j  = scale · (q̃ · k̃_j)               exact dot on per-vector grids (q over D, each key over D), then fp32
    m    = max_{j ≤ p} s_j ;  P_j = exp(s_j − m) (fp32) ;  π_j = round(P_j · 2^24)   (π integer, ≤ 2^24)
    l    = Σ_{j ≤ p} π_j                                                            exact in fp64
    O_b  = Σ_{j ∈ block b} π_j · ṽ_j           b < p₀ / BK: the full blocks, v on a per-(block, feature) grid
                                                 (exact: 24 + 25 bits + 4 for 16 keys ≤ 53)
    O    = ((O_0 + O_1) + … + O_{p₀/BK − 1}) + Σ_{j = p₀}^{p} π_j v_j        left to right, fp64
    out  = O / l                                 cast to the input dtype

Every quantity of a query depends on its own keys ``0..p`` and on the fixed block structure of absolute key
positions, never on the other queries, the padding or the layout: a full block's grid holds only keys below
``p₀`` (present alike in the trainer's sequence and in the engine's cache at decode time), the diagonal block
(keys ``p₀..p``, whose later keys the trainer has and the engine does not yet) is summed key by key in order
(each ``π_j v_j`` exact in fp64: 24 + 24 bits), and keys past ``p`` count ``π = 0``. Padding and the keys of
queries further on contribute exact zeros, which leave sums unchanged, and the masked values must be finite
(``0 · v``): the caller's padding is zeros and the engine's caches are zero-initialised.

Memory per call: the scores ``[B, Hq, M, L]`` in fp32 and π in fp64 (12 bytes a query-key pair), the full blocks'
products ``[B, Hkv, L / BK, G·M, D]`` fp64, the grids of q, k, v (fp64 copies). :func:`varlen_attention` splits a
packed batch so that a call holds at most ``PAIRS_PER_CALL`` query-key pairs per head. Cost: about 3x the scores'
and 2x the values' arithmetic of fp32 SDPA, plus ``BK`` elementwise steps over ``[B, Hq, M, D]`` for the diagonal
block, all on CPU.

Shape legend: B sequences, M queries each, L keys each (padded to a multiple of BK), Hq/Hkv heads, G = Hq / Hkv,
D head dim, T packed tokens.
"""

from __future__ import annotations

import math

import torch

from .batch_invariant import FP64_BITS, product_bits, to_grid

KEY_BLOCK = 16  # keys per block: full blocks are exact products, the diagonal one is summed key by key
PROB_BITS = 24  # π = round(P · 2^24): the probabilities' grid
VALUE_BITS = FP64_BITS - PROB_BITS - int(math.log2(KEY_BLOCK))  # 25: the values' grid in a full block's product
PAIRS_PER_CALL = 1 << 18  # query-key pairs per head in one call of varlen_attention (12 bytes each: 3 MiB a head)
BLOCK_PRODUCTS = 1 << 22  # fp64 entries of the full blocks' products held at once (32 MiB)


def attention(q_BHMD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, qpos_BM: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention of queries ``q [B, Hq, M, D]`` at positions ``qpos [B, M]`` over their sequence's keys
    ``k, v [B, Hkv, L, D]`` (key ``j`` at position ``j``; a query at ``p`` reads keys ``0..p``, ``p < L``), as the
    module docstring computes it. Returns ``[B, Hq, M, D]`` in ``q``'s dtype. Keys past a query's position are
    never read into its result (any finite values there, zeros for padding)."""
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

    bits = product_bits(D)
    q_int, q_unit = to_grid(q_BHMD.reshape(B, Hkv, R, D), -1, bits)  # [B, Hkv, R, D], [B, Hkv, R, 1]
    k_int, k_unit = to_grid(k_BHLD, -1, bits)  # [B, Hkv, Lp, D], [B, Hkv, Lp, 1]
    s = torch.matmul(q_int, k_int.transpose(-1, -2)).mul_(q_unit).mul_(k_unit.transpose(-1, -2))  # exact
    s_BHRL = (s * scale).float().masked_fill_(keys_L > pos_B1R1, -math.inf)
    del s
    p_BHRL = torch.exp(s_BHRL - s_BHRL.amax(-1, keepdim=True))
    pi_BHRL = (p_BHRL.double() * 2.0**PROB_BITS).round_()
    l_BHR1 = pi_BHRL.sum(-1, keepdim=True)  # exact: integers, at most Lp · 2^24
    start_B1R1 = pos_B1R1 - pos_B1R1 % BK  # the diagonal block's first key

    nb = Lp // BK
    full = pi_BHRL.masked_fill(keys_L >= start_B1R1, 0.0).view(B, Hkv, R, nb, BK).transpose(2, 3)  # [B,Hkv,nb,R,BK]
    v_int, v_unit = to_grid(v_BHLD.view(B, Hkv, nb, BK, D), -2, VALUE_BITS)  # per (block, feature)
    out_BHRD = q_BHMD.new_zeros(B, Hkv, R, D, dtype=torch.float64)
    step = max(1, BLOCK_PRODUCTS // max(B * Hkv * R * D, 1))  # blocks per product: bounds [B, Hkv, step, R, D]
    for b0 in range(0, nb, step):  # the blocks left to right, exact each (blocks at and past the diagonal are 0)
        part = slice(b0, b0 + step)
        blocks = torch.matmul(full[:, :, part], v_int[:, :, part]).mul_(v_unit[:, :, part])  # [B, Hkv, step, R, D]
        out_BHRD = torch.cat([out_BHRD[:, :, None], blocks], 2).cumsum(2)[:, :, -1]
    del full, v_int

    for j in range(BK):  # the diagonal block, key by key in order: π_j v_j exact, the sum in a fixed order
        key_B1R1 = start_B1R1 + j
        pi_j = pi_BHRL.gather(-1, key_B1R1.expand(B, Hkv, R, 1))  # [B, Hkv, R, 1] (0 past the query)
        v_j = v_BHLD.gather(2, key_B1R1.expand(B, Hkv, R, D)).double()  # [B, Hkv, R, D]
        out_BHRD.addcmul_(pi_j, v_j)
    return (out_BHRD / l_BHR1).view(B, Hq, M, D).to(q_BHMD.dtype)


def varlen_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of a packed batch (``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, sequence ``b`` at tokens
    ``[cu[b], cu[b + 1])``, positions restarting at 0): :func:`attention` on sequences of close length padded into
    batches (shortest first), a sequence too long for one call in query chunks, at most ``PAIRS_PER_CALL``
    query-key pairs a head per call. Each query's result is the one :func:`attention` gives it in any batch (the
    split only bounds memory). Returns ``[T, Hq, D]``. One host read of ``cu_seqlens``."""
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
            k, v = (_padded(x, start_B1, kpos_BL, n_B1) for x in (k_THD, v_THD))
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
