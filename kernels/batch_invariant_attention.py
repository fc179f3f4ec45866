"""Batch-invariant causal attention: one function for the engine's prefill, its decode (row cache or pages) and the
trainer's packed forward (``numerics.batch_invariant``; the exact-product idea is ``batch_invariant``'s).

For a query at position ``p`` of its sequence, over that sequence's keys ``0..p`` (GQA: query head ``h`` reads kv
head ``h // G``). Keys fall in big blocks of ``BB = 64`` and small blocks of ``BK = 8`` at fixed absolute positions;
``p_B = BB ⌊p / BB⌋`` and ``p_b = BK ⌊p / BK⌋`` start the query's own big and small block::

    s_j  = scale · (q̃ · k̃_j)                 exact dot on per-vector grids (q over D, each key over D), then fp32
    m    = max_{j ≤ p} s_j ;  P_j = exp(s_j − m) (fp32) ;  π_j = round(P_j · 2^24)   (π integer, ≤ 2^24)
    l    = Σ_{j ≤ p} π_j                                                          exact in fp64
    O_c  = Σ_{j ∈ big block c} π_j ṽ_j         c < p_B / BB: exact, v on a per-(big block, feature) grid
                                                  (24 + 23 bits + 6 for 64 keys ≤ 53)
    O'_t = Σ_{j ∈ small block t} π_j ṽ_j       the small blocks of the query's big block below p_b: exact, v on a
                                                  per-(small block, feature) grid (24 + 26 + 3 ≤ 53)
    Δ    = ((0 + π_{p_b} v_{p_b}) + π_{p_b+1} v_{p_b+1}) + …     the query's small block key by key (π = 0 past p)
    O    = ((((0 + O_0) + O_1) + …) + (((0 + O'_0) + O'_1) + …)) + Δ      fixed order, fp64
    out  = O / l                                  cast to the input dtype

Every quantity of a query depends on its own keys ``0..p`` and on the fixed block structure, never on the other
queries, the padding or the layout: a block whose grid is used holds only keys below ``p_b`` (present alike in the
trainer's sequence and in the engine's cache at decode time), the query's own small block (whose later keys the
trainer has and the engine does not yet) is summed key by key in order (each ``π_j v_j`` exact in fp64: 24 + 24
bits), and keys past ``p`` count ``π = 0``. Padding, blocks past a query's and keys of queries further on
contribute exact zeros, which leave sums unchanged; the masked values must be finite (``0 · v``): the caller's
padding is zeros and the engine's caches are zero-initialised. The keys are rounded onto their grid once
(:func:`key_grid`: the engine stores them so), the query at each call. The fixed orders are loops of additions
from 0, whose association does not depend on how a call gathers its blocks: by index per query (the engine's decode
and prefill onto cached K/V: :func:`small_blocks`, :func:`diagonal_block`) or by reshaping (a packed forward,
whose queries run along the positions: :func:`dense_blocks`), the same bits (tested).

Memory per call: the scores ``[B, Hq, M, L]`` in fp32 and π in fp64 (12 bytes a query-key pair), the big blocks'
products ``[B, Hkv, L / 64, G·M, D]`` fp64 (in pieces of ``BLOCK_PRODUCTS``), the small blocks' ``[B, Hq, M, 8,
D]``, the grids of q and v (fp64 copies). :func:`varlen_attention` splits a packed batch so that a call holds at
most ``PAIRS_PER_CALL`` query-key pairs per head (a long sequence's query chunks read the keys up to their end: the
causal half of the pairs), :func:`attention` its rows so that their fp64 temporaries stay under ``CHUNK_BYTES``
(16 MiB: glibc serves 32 MiB and more fresh from the OS, zero-filled on first touch, 5x slower a byte). On CUDA the
bounds are larger (:func:`split_bounds`: 1 GiB of a call's temporaries, 2^22 pairs a head), since there each chunk
costs dozens of kernel launches from Python (counted with the ops of one decode step's attention at the 1.5B heads,
12 / 2 x 128, 28 layers: 256 rows of 4096 keys take 5 calls and about 28K ops a step, 256 rows of 16K keys 18 calls
and about 100K ops, against 1 row a call and about 1.4M ops at 256 x 4096 with the CPU's bound). Cost: fp64
GEMMs for the scores and the blocks (about 2x fp32 SDPA's arithmetic there), the fp64 copies of K and V, the grids
(a few elementwise passes over q and v per call; the engine's row cache keeps the values' grids, ``v_kept``), and
8 multiply-adds per query and feature for the query's own small block, elementwise in fp64;
measured by bench/bench_batch_invariant.py (4-10x PyTorch's SDPA on CPU, its fused kernel being one pass). The same
functions on CUDA tensors (``batch_invariant``'s module docstring: what holds there; the big blocks' ``cumsum`` runs
over a middle dim, left to right per column on CUDA as on the CPU, checked at start-up), with every index tensor made
on the inputs' device; the engine's CUDA decode reads the pages (no kept value grids).

Shape legend: B sequences, M queries each, L keys each (padded to a multiple of BK), Hq/Hkv heads, G = Hq / Hkv,
D head dim, T packed tokens.
"""

from __future__ import annotations

import math

import torch

from .batch_invariant import FP64_BITS, grid_values, product_bits, to_grid
from .varlen_attention import varlen_attention_torch, varlen_attention_unchecked

BIG_BLOCK = 64  # keys per big block: the exact products below the query's big block
KEY_BLOCK = 8  # keys per small block: exact products inside a big block; the query's own summed key by key
PROB_BITS = 24  # π = round(P · 2^24): the probabilities' grid
VALUE_BITS = FP64_BITS - PROB_BITS - int(math.log2(KEY_BLOCK))  # 26: the values' grid in a small block's product
BIG_VALUE_BITS = FP64_BITS - PROB_BITS - int(math.log2(BIG_BLOCK))  # 23: in a big block's
PAIRS_PER_CALL = 1 << 16  # query-key pairs per head in one call of varlen_attention (12 bytes each: 768 KiB a head);
# a long sequence's queries go in chunks that read the keys up to the chunk's end only (about half the pairs)
BLOCK_PRODUCTS = 1 << 21  # fp64 entries of the blocks' products held at once (16 MiB)
BLAS_MIN_MACS = 400  # ATen's CPU bmm runs products of fewer multiply-adds (rows · inner · cols) in a scalar loop, 4x
# slower than its BLAS path at twice the work on this host (a decode step's small blocks at head dim 16): _bmm pads rows
CHUNK_BYTES = 16 << 20  # fp64 bytes of a call's per-row temporaries (K, V, scores, π) computed at once: rows in chunks
# (glibc hands a block of 32 MiB or more straight from the OS, zero-filled page by page on first touch: 5x the time)
# On CUDA the bounds are set by launches, not by the allocator: every chunk is dozens of small ops launched from
# Python (5-10 us each), and the caching allocator reuses its blocks whatever their size
CUDA_PAIRS_PER_CALL = 1 << 22  # 48 MiB a head: a 16K-token sequence in 256-query chunks (64 calls a layer)
CUDA_BLOCK_PRODUCTS = 1 << 24  # 128 MiB: a decode step's big blocks in one product at the 1.5B heads up to 24K keys
CUDA_CHUNK_BYTES = 1 << 30  # 1 GiB: a decode step of 256 rows at the 1.5B heads in 2 calls at 1K keys, 18 at 16K


def key_grid(k: torch.Tensor) -> torch.Tensor:
    """Keys on their grid (per key vector, :func:`fastgrpo.kernels.batch_invariant.grid_values`, in ``k``'s dtype):
    what :func:`attention` reads. The engine stores keys this way in its cache (rounded once, when written), the
    packed forward rounds them before its call: the same values either way."""
    return grid_values(k, product_bits(k.shape[-1]))


def attention(q_BHMD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, qpos_BM: torch.Tensor,
              scale: float, dense_from: int | None = None, v_kept_BHLD: torch.Tensor | None = None,
              with_lse: bool = False):
    """Causal attention of queries ``q [B, Hq, M, D]`` at positions ``qpos [B, M]`` over their sequence's keys
    ``k, v [B, Hkv, L, D]`` (key ``j`` at position ``j``; a query at ``p`` reads keys ``0..p``, ``p < L``; ``k`` on
    its grid, :func:`key_grid`), as the module docstring computes it. Returns ``[B, Hq, M, D]`` in ``q``'s dtype.
    Keys past a query's position are never read into its result (any finite values there, zeros for padding).

    ``dense_from``: the queries of every row are the positions ``dense_from + [0, M)`` with ``dense_from`` a multiple
    of ``BIG_BLOCK`` (a packed forward's): their own big and small blocks are then read by reshaping
    (:func:`dense_blocks`) instead of by index per query; the same numbers.

    ``v_kept``: the values on the grids each query reads them on, kept by the engine with its row cache and read as
    they are instead of made again (the same numbers): its big blocks' below its own big block
    (:func:`big_value_grid`), its own big block's small blocks below its own small block (:func:`small_value_grid`);
    any finite values past those.

    ``with_lse``: also each query's log-sum-exp of its scaled scores, ``lse = m + log(l · 2^-24)`` (fp32 ``[B, Hq,
    M]``; the probabilities the output weighs by are ``π_j / l ≈ exp(s_j − lse)``): what PyTorch's flash-attention
    backward reads (:func:`varlen_attention`'s backward)."""
    B, Hq, M, D = q_BHMD.shape
    Hkv, L = k_BHLD.shape[1], k_BHLD.shape[2]
    rows = rows_per_call(q_BHMD.device, Hq, Hkv, L, M, D)
    if B > rows:  # a row's result is its own: chunks of rows keep the temporaries in the allocator's reused memory
        parts = [attention(q_BHMD[b : b + rows], k_BHLD[b : b + rows], v_BHLD[b : b + rows], qpos_BM[b : b + rows],
                           scale, dense_from, None if v_kept_BHLD is None else v_kept_BHLD[b : b + rows], with_lse)
                 for b in range(0, B, rows)]
        return tuple(map(torch.cat, zip(*parts))) if with_lse else torch.cat(parts)
    G, BK = Hq // Hkv, KEY_BLOCK
    Lp = -(-L // BK) * BK
    if Lp != L:  # zero keys: a masked key's value must be finite
        pad = (0, 0, 0, Lp - L)
        k_BHLD, v_BHLD = torch.nn.functional.pad(k_BHLD, pad), torch.nn.functional.pad(v_BHLD, pad)
        v_kept_BHLD = None if v_kept_BHLD is None else torch.nn.functional.pad(v_kept_BHLD, pad)
    R = G * M  # the G query heads of a kv head as G·M rows
    pos_B1R1 = qpos_BM.repeat(1, G).view(B, 1, R, 1)
    keys_L = torch.arange(Lp, device=q_BHMD.device)

    q_tilde = to_grid(q_BHMD.reshape(B, Hkv, R, D), -1, min(product_bits(D), 24))  # [B, Hkv, R, D] fp64
    s_BHRL = _bmm(q_tilde, k_BHLD.double().transpose(-1, -2)).mul_(scale)  # [B, Hkv, R, Lp]: exact, scaled
    p_BHRL = s_BHRL.float().masked_fill_(keys_L > pos_B1R1, -math.inf)
    del s_BHRL
    m_BHR1 = p_BHRL.amax(-1, keepdim=True)
    p_BHRL.sub_(m_BHR1).exp_().mul_(2.0**PROB_BITS)  # P · 2^24, exact in fp32 (a power of two)
    pi_BHRL = p_BHRL.round_().double()  # integers up to 2^24: exact in fp32
    del p_BHRL
    l_BHR1 = pi_BHRL.sum(-1, keepdim=True)  # exact: integers, at most Lp · 2^24
    out = big_blocks(pi_BHRL, v_BHLD, pos_B1R1 - pos_B1R1 % BIG_BLOCK, v_kept_BHLD)
    if dense_from is not None:
        small, diagonal = dense_blocks(pi_BHRL, v_BHLD, dense_from, M)
    else:
        small = small_blocks(pi_BHRL, v_BHLD, qpos_BM, v_kept_BHLD)
        diagonal = diagonal_block(pi_BHRL, v_BHLD, qpos_BM)
    out = out.add_(small).add_(diagonal).div_(l_BHR1).view(B, Hq, M, D).to(q_BHMD.dtype)  # ((S₁ + S₂) + Δ) / l
    if not with_lse:
        return out
    return out, (m_BHR1.double() + l_BHR1.log()).sub_(PROB_BITS * math.log(2.0)).float().view(B, Hq, M)


def split_bounds(device: torch.device) -> tuple[int, int, int]:
    """The work's split on ``device``: query-key pairs per head in one call of :func:`invariant_varlen`, fp64 entries
    of :func:`big_blocks`' products held at once, and bytes of :func:`attention`'s per-row fp64 temporaries (the
    CPU's ``PAIRS_PER_CALL``, ``BLOCK_PRODUCTS``, ``CHUNK_BYTES``; the ``CUDA_*`` ones on CUDA). The split never
    changes a value (a row's result is its own, the blocks' running sum is carried across products)."""
    if device.type == "cuda":
        return CUDA_PAIRS_PER_CALL, CUDA_BLOCK_PRODUCTS, CUDA_CHUNK_BYTES
    return PAIRS_PER_CALL, BLOCK_PRODUCTS, CHUNK_BYTES


def rows_per_call(device: torch.device, Hq: int, Hkv: int, L: int, M: int, D: int) -> int:
    """Rows of ``M`` queries over ``L`` keys that one :func:`attention` call computes at once on ``device``: its
    fp64 temporaries, ``8 · Hkv · L · (2 · D + 2 · M · Hq / Hkv)`` bytes a row (K and V, the scores and π), within
    :func:`split_bounds`' chunk bytes; at least 1. At DeepSeek-R1-Distill-Qwen-1.5B's heads (12 / 2 x 128) a decode row
    holds 4288 bytes a key: 70 MB at 16K keys, 15 rows in CUDA's 1 GiB. A call's peak against the count (on CPU,
    ``bench/common.peak_extra_bytes``, the 1.5B heads with CUDA's split): 0.6x for a decode step's rows (15 x 16K
    and 61 x 4K keys: K's fp64 copy is freed before the values' grids are made), 1.5x for a packed forward's call of
    1024 queries over 4096 keys (the scores, π and its masked copy)."""
    return max(1, split_bounds(device)[2] // (8 * Hkv * L * (2 * D + 2 * M * (Hq // Hkv))))


def queries_per_row(device: torch.device, Hq: int, Hkv: int, L: int, D: int) -> int:
    """Queries of one row over ``L`` keys whose fp64 temporaries (:func:`rows_per_call`'s count) fit the device's
    chunk bytes, at least 1: how a caller splits a row too long for one call (a resumed turn's new tokens onto 16K
    cached keys at the 1.5B heads: 3 MiB a query, 320 queries a call on CUDA). Each query's result is its
    own (its keys picked by index), so the split gives the same bits."""
    return max(1, (split_bounds(device)[2] // (8 * Hkv * L) - 2 * D) // (2 * (Hq // Hkv)))


def big_value_grid(v_BHLD: torch.Tensor) -> torch.Tensor:
    """Values of whole big blocks (``L`` a multiple of ``BIG_BLOCK``) on their grids, per (big block, feature) of
    ``BIG_VALUE_BITS``, in fp32: exact (a value rounded onto a power-of-two grid coarser than its own spacing keeps
    fewer significant bits, one on a finer grid is unchanged), so an fp32 copy kept for later calls reads back as the
    grid :func:`big_blocks` makes. ``[B, Hkv, L, D]``."""
    return _value_grid(v_BHLD, BIG_BLOCK, BIG_VALUE_BITS)


def small_value_grid(v_BHLD: torch.Tensor) -> torch.Tensor:
    """:func:`big_value_grid` of small blocks (``KEY_BLOCK`` keys, ``VALUE_BITS``): the grid :func:`small_blocks`
    makes, in fp32 (exact alike). ``[B, Hkv, L, D]``, ``L`` a multiple of ``KEY_BLOCK``."""
    return _value_grid(v_BHLD, KEY_BLOCK, VALUE_BITS)


def _value_grid(v_BHLD: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    B, Hkv, L, D = v_BHLD.shape
    return to_grid(v_BHLD.reshape(B, Hkv, L // block, block, D), -2, bits).float().view(B, Hkv, L, D)


def big_blocks(pi_BHRL: torch.Tensor, v_BHLD: torch.Tensor, start_B1R1: torch.Tensor,
               v_kept_BHLD: torch.Tensor | None = None) -> torch.Tensor:
    """``S₁ = ((0 + O_0) + O_1) + …``: the big blocks of ``BIG_BLOCK`` keys below each query's (``start``), each
    ``O_b = Σ_{j ∈ b} π_j ṽ_j`` exact (``v`` on a per-(block, feature) grid of ``BIG_VALUE_BITS``: 24 + 23 + 6 ≤ 53
    bits), then left to right (the blocks at and past the query's contribute exact zeros), in products of
    at most ``BLOCK_PRODUCTS`` entries (with the running sum's ``cat`` and their ``cumsum``, about three times that
    held at once: 48 MiB; ``v_kept``: ``ṽ`` kept, :func:`big_value_grid`, valid in every block below
    each query's). Only whole big blocks count (a query's are below it). ``[B, Hkv, R, D]``.
    Every "left to right" here and below is a loop of additions from 0 (here ``cumsum``'s, which writes every prefix:
    one op instead of one per block, a decode step over 4096 keys has 64)."""
    B, Hkv, R, Lp = pi_BHRL.shape
    D, nb = v_BHLD.shape[-1], Lp // BIG_BLOCK
    out_BHRD = pi_BHRL.new_zeros(B, Hkv, R, D)
    if nb == 0:
        return out_BHRD
    keys = torch.arange(nb * BIG_BLOCK, device=pi_BHRL.device)
    full = pi_BHRL[..., : nb * BIG_BLOCK].masked_fill(keys >= start_B1R1, 0.0)
    full = full.view(B, Hkv, R, nb, BIG_BLOCK).transpose(2, 3)  # [B, Hkv, nb, R, BB]
    if v_kept_BHLD is not None:  # kept on their grids (:func:`big_value_grid`)
        v_tilde = v_kept_BHLD[:, :, : nb * BIG_BLOCK].double().reshape(B, Hkv, nb, BIG_BLOCK, D)
    else:
        v_tilde = to_grid(v_BHLD[:, :, : nb * BIG_BLOCK].reshape(B, Hkv, nb, BIG_BLOCK, D), -2, BIG_VALUE_BITS)
    step = max(1, split_bounds(pi_BHRL.device)[1] // max(B * Hkv * R * D, 1))  # blocks a product: [B, Hkv, step, R, D]
    for b0 in range(0, nb, step):
        blocks = torch.matmul(full[:, :, b0 : b0 + step], v_tilde[:, :, b0 : b0 + step])  # [B, Hkv, step, R, D]
        if b0:  # the running sum first: cumsum adds left to right from 0 (self_check), so its last is the loop's
            blocks = torch.cat((out_BHRD[:, :, None], blocks), 2)
        out_BHRD = blocks.cumsum(2)[:, :, -1].contiguous()
    return out_BHRD


def _whole_big_blocks(x: torch.Tensor, dim: int, size: int = BIG_BLOCK) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of ``size`` (a query's own big block may end past the keys
    there are: its keys past the query are zeros)."""
    extra = -x.shape[dim] % size
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def small_blocks(pi_BHRL: torch.Tensor, v_BHLD: torch.Tensor, qpos_BM: torch.Tensor,
                 v_kept_BHLD: torch.Tensor | None = None) -> torch.Tensor:
    """``S₂ = ((0 + O'_0) + O'_1) + … + O'_7``: the ``KEY_BLOCK``-key blocks of each query's big block, below the
    block that holds the query (the others contribute exact zeros), each exact (``v`` on a per-(small block,
    feature) grid of ``VALUE_BITS``: 24 + 26 + 3 ≤ 53 bits), left to right. Per query its own big block is picked by
    index: at once when ``[B, M, Hkv, BIG_BLOCK, D]`` fits ``BLOCK_PRODUCTS`` (a decode step), else one small block
    at a time; with no key past the first big block, its small blocks are all the keys' (no index). ``v_kept``:
    those values kept on their grids (:func:`small_value_grid`), read as they are. ``[B, Hkv, R, D]`` fp64."""
    kept = v_kept_BHLD is not None
    v_BHLD = v_kept_BHLD if kept else v_BHLD

    def grid(v: torch.Tensor, dim: int) -> torch.Tensor:  # the small blocks' grids: kept, or made here
        return v.double() if kept else to_grid(v, dim, VALUE_BITS)

    B, Hkv, R, Lp = pi_BHRL.shape
    M, D, BK = qpos_BM.shape[1], v_BHLD.shape[-1], KEY_BLOCK
    G = R // M
    if Lp <= BIG_BLOCK:  # every query in the first big block, whose small blocks past the keys would add zeros
        nsb = Lp // BK
        below = torch.arange(nsb, device=qpos_BM.device) < (qpos_BM // BK)[..., None]  # [B, M, nsb]
        pi_s = pi_BHRL.view(B, Hkv, G, M, nsb, BK).masked_fill(~below.view(B, 1, 1, M, nsb, 1), 0.0)
        parts = _bmm(pi_s.permute(0, 1, 4, 2, 3, 5).reshape(B, Hkv, nsb, R, BK),
                     grid(v_BHLD.view(B, Hkv, nsb, BK, D), -2))  # [B, Hkv, nsb, R, D]
        out = pi_BHRL.new_zeros(B, Hkv, R, D)
        for i in range(nsb):
            out += parts[:, :, i]
        return out
    nsb = BIG_BLOCK // BK
    rows_B1 = torch.arange(B, device=qpos_BM.device)[:, None]
    base_BM = qpos_BM - qpos_BM % BIG_BLOCK  # the query's big block's first key
    below_BM = (qpos_BM % BIG_BLOCK) // BK  # how many of its small blocks lie below the query's
    out = pi_BHRL.new_zeros(B, Hkv, M, G, D)
    if B * M * Hkv * BIG_BLOCK * D <= split_bounds(pi_BHRL.device)[1]:
        # its big block's keys by index, those past the keys clamped: they lie past the query (π = 0 there)
        keys_BMK = (base_BM[..., None] + torch.arange(BIG_BLOCK, device=qpos_BM.device)).clamp_(max=Lp - 1)
        v_own = v_BHLD.transpose(1, 2)[rows_B1[..., None], keys_BMK]  # [B, M, BB, Hkv, D]
        v_tilde = grid(v_own.view(B, M, nsb, BK, Hkv, D), -3).permute(0, 4, 1, 2, 3, 5)
        pi_own = pi_BHRL.view(B, Hkv, G, M, Lp).gather(4, keys_BMK.view(B, 1, 1, M, BIG_BLOCK).expand(
            B, Hkv, G, M, BIG_BLOCK)).view(B, Hkv, G, M, nsb, BK)
        below = torch.arange(nsb, device=qpos_BM.device) < below_BM[..., None]  # [B, M, nsb]
        pi_own = pi_own.masked_fill(~below.view(B, 1, 1, M, nsb, 1), 0.0).permute(0, 1, 3, 4, 2, 5)
        parts = _bmm(pi_own, v_tilde)  # [B, Hkv, M, nsb, G, D], exact each
        for i in range(nsb):
            out += parts[:, :, :, i]
        return out.transpose(2, 3).reshape(B, Hkv, R, D)
    pi_BHRL, v_BHLD = _whole_big_blocks(pi_BHRL, 3), _whole_big_blocks(v_BHLD, 2)
    Lp = pi_BHRL.shape[-1]
    v_BSHKD = v_BHLD.view(B, Hkv, Lp // BK, BK, D).transpose(1, 2)  # [B, Lp / BK, Hkv, BK, D] view
    pi_BHGMSK = pi_BHRL.view(B, Hkv, G, M, Lp // BK, BK)
    for i in range(nsb):
        block_BM = base_BM // BK + i
        v_tilde = grid(v_BSHKD[rows_B1, block_BM], -2).transpose(1, 2)  # [B, Hkv, M, BK, D]
        pi_i = pi_BHGMSK.gather(4, block_BM.view(B, 1, 1, M, 1, 1).expand(B, Hkv, G, M, 1, BK)).squeeze(4)
        pi_i = pi_i.masked_fill((i >= below_BM).view(B, 1, 1, M, 1), 0.0)  # [B, Hkv, G, M, BK]
        out += _bmm(pi_i.permute(0, 1, 3, 2, 4), v_tilde)  # [B, Hkv, M, G, D], exact per query
    return out.transpose(2, 3).reshape(B, Hkv, R, D)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched, exact products), on CPU ``a``'s rows zero-padded (then dropped) when a product has fewer
    than ``BLAS_MIN_MACS`` multiply-adds, so that ATen takes its BLAS path: a row's exact result does not depend on the
    rows beside it. CUDA has no such scalar path: no padding there."""
    rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    need = -(-BLAS_MIN_MACS // max(inner * cols, 1))
    if rows >= need or a.device.type != "cpu":
        return torch.matmul(a, b)
    return torch.matmul(torch.nn.functional.pad(a, (0, 0, 0, need - rows)), b)[..., :rows, :]


def dense_blocks(pi_BHRL: torch.Tensor, v_BHLD: torch.Tensor, first: int, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`small_blocks` and :func:`diagonal_block` for queries at positions ``first + [0, M)`` of every row over
    keys ``[0, first + M)``, the same additions in the same order: a query's big block (and small block) is the keys'
    one at the same place, so both are read by reshaping π and v, no index per query (:func:`own_blocks`). Whole
    blocks: ``first`` and ``M`` multiples of ``BIG_BLOCK``, or ``first = 0`` and ``M ≤ BIG_BLOCK`` a multiple of
    ``KEY_BLOCK`` (a short call: its one big block holds only the small blocks there are). Two ``[B, Hkv, R, D]``
    fp64 tensors."""
    B, Hkv, R, L = pi_BHRL.shape
    G = R // M
    BB = M if first == 0 and M <= BIG_BLOCK else BIG_BLOCK
    nq = M // BB
    own = pi_BHRL.view(B, Hkv, G, nq, BB, L // BB, BB).diagonal(offset=first // BB, dim1=3, dim2=5).movedim(-1, 3)
    small, diagonal = own_blocks(own, v_BHLD[:, :, first : first + M].reshape(B, Hkv, nq, BB, -1))
    return small.reshape(B, Hkv, R, -1), diagonal.reshape(B, Hkv, R, -1)


def own_blocks(pi_BHGNQK: torch.Tensor, v_BHNKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of ``N`` whole (big) blocks over their own blocks' keys: ``π [B, Hkv, G, N, BB q, BB k]`` (query ``i``
    and key ``j`` at the same offsets of the block), ``v [B, Hkv, N, BB, D]``. Returns ``S₂`` (each query's small
    blocks below its own, each exact on its grid, added from 0 in block order) and ``Δ`` (its own small block key
    by key from 0), ``[B, Hkv, G, N, BB, D]`` fp64 each. Small block ``t``'s product is one matmul over the queries
    past it; key ``j`` of a small block is added to the queries at and past it (the others' π are 0: their skipped
    terms are exact zeros). Memory: the two results and the values' grid, ``[B, Hkv, N, BB, D]`` fp64."""
    B, Hkv, G, N, BB, _ = pi_BHGNQK.shape
    D, BK = v_BHNKD.shape[-1], KEY_BLOCK
    nsb = BB // BK
    v_tilde = to_grid(v_BHNKD.reshape(B, Hkv, N, nsb, BK, D), -2, VALUE_BITS)  # [B, Hkv, N, nsb, BK, D]
    small = pi_BHGNQK.new_zeros(B, Hkv, G, N, BB, D)
    for t in range(nsb - 1):
        q0 = BK * (t + 1)
        small[..., q0:, :] += torch.matmul(pi_BHGNQK[..., q0:, BK * t : q0], v_tilde[:, :, None, :, t])
    diagonal = pi_BHGNQK.new_zeros(B, Hkv, G, N, nsb, BK, D)
    pi_d = pi_BHGNQK.reshape(B, Hkv, G, N, nsb, BK, nsb, BK).diagonal(dim1=4, dim2=6)  # [B, Hkv, G, N, BK q, BK k, nsb]
    v_raw = v_BHNKD.reshape(B, Hkv, 1, N, nsb, BK, D)
    for j in range(BK):  # π_j v_j exact in fp64 (24 + 24 bits)
        diagonal[..., j:, :].addcmul_(pi_d[..., j:, j, :].transpose(-1, -2)[..., None], v_raw[..., j, None, :])
    return small, diagonal.view(B, Hkv, G, N, BB, D)


def diagonal_block(pi_BHRL: torch.Tensor, v_BHLD: torch.Tensor, qpos_BM: torch.Tensor) -> torch.Tensor:
    """``Σ_{j=0}^{BK−1} π_{p₀+j} v_{p₀+j}`` per query row (``p₀``: the start of the small block holding the query),
    added from 0 in key order (each term exact in fp64: 24 + 24 bits; keys past the query have π = 0): the block's
    π and v picked by index. ``[B, Hkv, R, D]`` fp64."""
    B, Hkv, R, Lp = pi_BHRL.shape
    M, D, BK = qpos_BM.shape[1], v_BHLD.shape[-1], KEY_BLOCK
    G = R // M
    block_BM = qpos_BM // BK
    rows_B1 = torch.arange(B, device=qpos_BM.device)[:, None]
    v_BMHKD = v_BHLD.view(B, Hkv, Lp // BK, BK, D).transpose(1, 2)[rows_B1, block_BM]  # [B, M, Hkv, BK, D]
    v_BH1MKD = v_BMHKD.permute(0, 2, 1, 3, 4).unsqueeze(2).double()  # [B, Hkv, 1, M, BK, D]
    pi_BHGMK = pi_BHRL.view(B, Hkv, G, M, Lp // BK, BK).gather(
        4, block_BM.view(B, 1, 1, M, 1, 1).expand(B, Hkv, G, M, 1, BK)).squeeze(4)  # [B, Hkv, G, M, BK]
    acc_BHGMD = pi_BHRL.new_zeros(B, Hkv, G, M, D)
    for j in range(BK):
        acc_BHGMD.addcmul_(pi_BHGMK[..., j, None], v_BH1MKD[..., j, :])
    return acc_BHGMD.view(B, Hkv, R, D)


class _VarlenAttention(torch.autograd.Function):
    """The invariant forward; the backward is the trainer's own attention's (only forward values must be invariant):
    on CPU PyTorch's flash-attention backward fed the invariant forward's output and log-sum-exp
    (:func:`flash_backward`); on CUDA the trainer's Triton kernel recomputed on the same inputs and differentiated
    (``fastgrpo.models.attention``'s dispatch; one more attention forward per layer). Saved for the backward besides
    q, k, v, on CPU: the output (the tensor the output projection saves as its input anyway) and the log-sum-exp,
    fp32 ``[T, Hq]`` (4 bytes a token and head: 1.1 MiB a layer for 24K tokens of the 1.5B's 12 heads)."""

    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, cu_seqlens, scale):
        if q_THD.device.type == "cpu":  # flash_backward's inputs
            out_THD, lse_TH = invariant_varlen(q_THD, key_grid(k_THD), v_THD, cu_seqlens, scale, with_lse=True)
            ctx.save_for_backward(q_THD, k_THD, v_THD, cu_seqlens, out_THD, lse_TH)
        else:
            out_THD = invariant_varlen(q_THD, key_grid(k_THD), v_THD, cu_seqlens, scale)
            ctx.save_for_backward(q_THD, k_THD, v_THD, cu_seqlens)
        ctx.scale = scale
        return out_THD

    @staticmethod
    def backward(ctx, do_THD):
        q, k, v, cu_seqlens, *out_lse = ctx.saved_tensors
        if q.device.type == "cpu":
            return (*flash_backward(do_THD, q, k, v, *out_lse, cu_seqlens, ctx.scale), None, None)
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            attend = varlen_attention_unchecked if q.is_cuda else varlen_attention_torch
            out = attend(q, k, v, cu_seqlens, longest, softmax_scale=ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do_THD)
        return dq, dk, dv, None, None


def flash_backward(do_THD: torch.Tensor, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                   out_THD: torch.Tensor, lse_TH: torch.Tensor, cu_seqlens: torch.Tensor, scale: float):
    """The gradients ``(dq, dk, dv)`` of causal attention over a packed batch (as :func:`invariant_varlen` takes it)
    by PyTorch's CPU flash-attention backward, fed the forward's output ``out`` and log-sum-exp ``lse [T, Hq]``
    instead of recomputing them: with ``P = exp(scale · q kᵀ − lse)``, ``dv = Pᵀ do``, ``dS = P ∘ (do vᵀ −
    rowsum(do ∘ out))``, ``dq = scale · dS k``, ``dk = scale · dSᵀ q`` (fp32 inside). The sequences go in the
    forward's groups (:func:`length_groups`), each padded to its longest: padding queries have ``do = 0`` and a
    finite ``lse`` (0), so they add nothing; a real query never reads a padding key (causal). GQA: k and v copied
    per query head and their gradients summed over each kv head's group (the private kernel takes ``Hq = Hkv``
    everywhere; its own GQA support is recent). Memory: the group's padded copies of q, k, v, out, do and the three
    gradients (``[B, L, Hq, D]`` each)."""
    dq_THD, dk_THD, dv_THD = (torch.zeros_like(x) for x in (q_THD, k_THD, v_THD))
    bounds = cu_seqlens.tolist()
    lengths = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    dev = q_THD.device
    for group in length_groups(lengths, split_bounds(dev)[0]):
        start_B1 = torch.tensor([bounds[b] for b in group], device=dev)[:, None]
        n_B1 = torch.tensor([lengths[b] for b in group], device=dev)[:, None]
        pos_BL = torch.arange(lengths[group[-1]], device=dev).expand(len(group), -1)
        q, k, v, o, do = (_padded(x, start_B1, pos_BL, n_B1).transpose(1, 2)
                          for x in (q_THD, k_THD, v_THD, out_THD, do_THD))  # [B, H, L, D] views
        lse_BHL = _padded(lse_TH[..., None], start_B1, pos_BL, n_B1)[..., 0].transpose(1, 2)  # [B, Hq, L]
        G = q.shape[1] // k.shape[1]  # each kv head's query heads, given their own copy: the kernel's GQA support
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # came later than the torch versions we take
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse_BHL, 0.0, True, scale=scale)
        B, Hq, L, D = dk.shape
        grads = dq, dk.view(B, Hq // G, G, L, D).sum(2), dv.view(B, Hq // G, G, L, D).sum(2)  # [B, Hkv, L, D]
        live_BL = pos_BL < n_B1
        rows = (start_B1 + pos_BL)[live_BL]
        for acc_THD, g_BHLD in zip((dq_THD, dk_THD, dv_THD), grads):
            acc_THD.index_copy_(0, rows, g_BHLD.transpose(1, 2)[live_BL])
    return dq_THD, dk_THD, dv_THD


def varlen_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """:func:`invariant_varlen` on the keys put on their grid (:func:`key_grid`), differentiable in q, k and v (the
    backward is the trainer's own attention's: :class:`_VarlenAttention`)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q_THD, k_THD, v_THD)):
        return _VarlenAttention.apply(q_THD, k_THD, v_THD, cu_seqlens, scale)
    return invariant_varlen(q_THD, key_grid(k_THD), v_THD, cu_seqlens, scale)


def length_groups(lengths: list[int], pairs: int) -> list[list[int]]:
    """The sequences (indices into ``lengths``) shortest first, in batches of close length whose padded query-key
    pairs (count × longest²) stay within ``pairs`` (:func:`split_bounds`' first; one sequence alone when it is
    longer)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups, i = [], 0
    while i < len(order):
        group = [order[i]]
        while i + len(group) < len(order) and (len(group) + 1) * lengths[order[i + len(group)]] ** 2 <= pairs:
            group.append(order[i + len(group)])
        i += len(group)
        groups.append(group)
    return groups


def query_chunk(device: torch.device, L: int, Hkv: int, D: int, Hq: int) -> int:
    """Queries per call of :func:`invariant_varlen` for a batch padded to ``L`` tokens (a multiple of
    ``BIG_BLOCK`` past one big block): all of them when the ``L²`` pairs a head fit :func:`split_bounds`' pairs and a
    row's fp64 temporaries over ``L`` keys fit its bytes (:func:`queries_per_row`: they grow with the query heads,
    e.g. 28 of them at 2048 tokens count 1.8 GiB), else whole big blocks within both (at least one)."""
    pairs = split_bounds(device)[0]
    fit = queries_per_row(device, Hq, Hkv, L, D)
    if L <= BIG_BLOCK or (L * L <= pairs and fit >= L):
        return L
    return max(BIG_BLOCK, min(pairs // L, fit) // BIG_BLOCK * BIG_BLOCK)


def invariant_varlen(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, with_lse: bool = False):
    """Causal attention of a packed batch (``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with ``k`` on its grid, sequence
    ``b`` at tokens ``[cu[b], cu[b + 1])``, positions restarting at 0): :func:`attention` on sequences of close
    length padded into batches (shortest first), a sequence too long for one call in query chunks
    (:func:`query_chunk`: at most :func:`split_bounds`' query-key pairs a head and its chunk bytes a row per call;
    empty sequences skipped). Each query's result is the one :func:`attention` gives it
    in any batch (the split only bounds memory). Returns ``[T, Hq, D]`` (``with_lse``: and each query's log-sum-exp,
    fp32 ``[T, Hq]``, :func:`attention`'s). One host read of ``cu_seqlens``."""
    out = torch.empty_like(q_THD)
    lse_TH = q_THD.new_empty(q_THD.shape[:2], dtype=torch.float32) if with_lse else None
    bounds = cu_seqlens.tolist()
    lengths = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    dev = q_THD.device
    pairs = split_bounds(dev)[0]
    for group in length_groups(lengths, pairs):
        if not lengths[group[-1]]:  # empty sequences: no token to attend
            continue
        whole = KEY_BLOCK if lengths[group[-1]] <= BIG_BLOCK else BIG_BLOCK  # dense_blocks reads whole blocks
        L = -(-lengths[group[-1]] // whole) * whole
        start_B1 = torch.tensor([bounds[b] for b in group], device=dev)[:, None]
        n_B1 = torch.tensor([lengths[b] for b in group], device=dev)[:, None]
        chunk = query_chunk(dev, L, *k_THD.shape[1:], q_THD.shape[1])
        for m0 in range(0, L, chunk):  # a sequence too long for one call: query chunks of whole big blocks
            m1 = min(L, m0 + chunk)
            kpos_BL = torch.arange(m1, device=dev).expand(len(group), m1)
            qpos_BM = kpos_BL[:, m0:m1]
            k, v = _padded(k_THD, start_B1, kpos_BL, n_B1), _padded(v_THD, start_B1, kpos_BL, n_B1)
            q = _padded(q_THD, start_B1, qpos_BM, n_B1)
            o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), qpos_BM, scale, dense_from=m0,
                          with_lse=with_lse)
            live_BM = qpos_BM < n_B1
            rows = (start_B1 + qpos_BM)[live_BM]
            if with_lse:
                o, lse_BHM = o
                lse_TH.index_copy_(0, rows, lse_BHM.transpose(1, 2)[live_BM])
            out.index_copy_(0, rows, o.transpose(1, 2)[live_BM])
    return (out, lse_TH) if with_lse else out


def _padded(x_THD: torch.Tensor, start_B1: torch.Tensor, pos_BL: torch.Tensor, n_B1: torch.Tensor) -> torch.Tensor:
    """Tokens ``start + pos`` of each sequence as ``[B, L, H, D]``, zeros past its length ``n`` (one gather)."""
    live_BL = pos_BL < n_B1
    rows = x_THD.index_select(0, (start_B1 + pos_BL).clamp(max=x_THD.shape[0] - 1).flatten())
    return rows.view(*pos_BL.shape, *x_THD.shape[1:]).masked_fill_(~live_BL[..., None, None], 0.0)
