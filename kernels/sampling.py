"""Temperature sampling by the Gumbel-max trick, one token per row of logits, with one random stream per row.

For row r of ``logits`` ``[S, V]`` with ``x = logits / temperature``::

    token_r = argmax_v (x_v + g_v),   g_v = −log(−log u_rv),  u_rv = U(seeds[r], v) ∈ [0, 1)
    logp_r  = x_token − logsumexp(x)  (= log_softmax(x)[token])

so ``token_r`` is distributed as ``softmax(x)``. Returns ``(token [S] int64, logp [S] fp32)``. ``u = 0`` gives
``g = −inf``: never picked. The uniforms of a row depend on its seed alone (counter-based: ``U(seed, v)``), not on
the row's index or the batch: the generation engine derives the seed from (call seed, sample, position), so a
sample draws the same noise whatever batch it runs in, and after a preemption.

Paths: on CUDA and under ``TRITON_INTERPRET=1``, one kernel per row that draws ``u`` in registers
(philox keyed by ``seeds[r]`` with counter ``v``: ``seeds`` is an int64 device tensor, so no host synchronisation
happens) and reads the row twice; otherwise torch ops with a ``torch.Generator`` seeded with ``seeds[r]`` per row
(one host read). Both draw from the same distribution; the draws themselves differ between the paths.
:func:`uniform_rows` gives the same uniforms as a tensor (the engine's top-k/top-p path on CUDA).

:func:`inverse_cdf_sample` is the engine's draw where the kernel does not run (CPU): the same distribution from one
uniform per row instead of V, with the CDF in fp64.

Shape legend: S rows (slots), V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import gumbel_sample_ref
from .utils import FLOAT_DTYPES, HAS_TRITON, check_tensor, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK_V = 2048  # logits per inner step of the kernel
SEED_MASK = (1 << 31) - 1  # row seeds are taken modulo 2^31 (philox's key; a torch.Generator seed)


if HAS_TRITON:

    @triton.jit
    def _gumbel_sample_kernel(
        LOGITS, SEEDS, TOK, LOGP, V, stride_row, inv_temperature, BLOCK_V: tl.constexpr
    ):
        """Row r: x = logits / T; token = argmax_v (x_v + g_v) with g_v = −log(−log u_v), u_v = philox(seeds[r],
        v) ~ U[0, 1); logp = x_token − logsumexp(x). Two reads of the row's V logits (max, then sum and argmax),
        two scalars written: no noise tensor, no softmax tensor."""
        r = tl.program_id(0).to(tl.int64)
        seed = tl.load(SEEDS + r) & 0x7FFFFFFF  # SEED_MASK
        offs = tl.arange(0, BLOCK_V)
        row = LOGITS + r * stride_row
        m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32) * inv_temperature
            m_vec = tl.maximum(m_vec, x)
        m = tl.max(m_vec, axis=0)  # finite: logits are finite
        l_vec = tl.zeros([BLOCK_V], tl.float32)
        best_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_x_vec = tl.zeros([BLOCK_V], tl.float32)
        best_i_vec = tl.zeros([BLOCK_V], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            x = tl.load(row + v, mask=v < V, other=float("-inf")).to(tl.float32) * inv_temperature
            l_vec += tl.exp(x - m)
            u = tl.rand(seed, v.to(tl.int32))
            score = x - tl.log(-tl.log(u))  # u = 0 gives −inf: never picked
            better = score > best_vec
            best_vec = tl.where(better, score, best_vec)
            best_x_vec = tl.where(better, x, best_x_vec)
            best_i_vec = tl.where(better, v, best_i_vec)
        lane = tl.argmax(best_vec, axis=0)
        pick = offs == lane
        token = tl.sum(tl.where(pick, best_i_vec, 0), axis=0)
        x_token = tl.sum(tl.where(pick, best_x_vec, 0.0), axis=0)
        tl.store(TOK + r, token.to(tl.int64))
        tl.store(LOGP + r, x_token - m - tl.log(tl.sum(l_vec, axis=0)))

    @triton.jit
    def _uniform_rows_kernel(SEEDS, U, V, BLOCK_V: tl.constexpr):
        """Row r, block b: u[r, v] = philox(seeds[r], v) for the block's v (the gumbel kernel's uniforms). Writes V
        floats per row, reads one seed."""
        r = tl.program_id(0).to(tl.int64)
        v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        seed = tl.load(SEEDS + r) & 0x7FFFFFFF  # SEED_MASK
        tl.store(U + r * V + v, tl.rand(seed, v), mask=v < V)


def _check_seeds(seeds, rows: int, device) -> None:
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,), device=device)
    if seeds.shape[0] != rows:
        raise ValueError(f"seeds has shape {tuple(seeds.shape)}, expected [S={rows}] (one seed per row)")


def _check_inputs(logits, temperature, seeds) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have unit stride on the vocabulary dim, got strides {logits.stride()}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    _check_seeds(seeds, logits.shape[0], logits.device)


def _gumbel_sample_triton(logits_SV, temperature: float, seeds_S):
    S, V = logits_SV.shape
    tok_S = torch.empty(S, dtype=torch.long, device=logits_SV.device)
    logp_S = torch.empty(S, dtype=torch.float32, device=logits_SV.device)
    _gumbel_sample_kernel[(S,)](
        logits_SV, seeds_S.contiguous(), tok_S, logp_S, V, logits_SV.stride(0), 1.0 / temperature,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=8,
    )  # fmt: skip
    return tok_S, logp_S


def uniform_rows_torch(seeds_S: torch.Tensor, V: int) -> torch.Tensor:
    """``u [S, V]`` fp32 in [0, 1): row r from a ``torch.Generator`` seeded with ``seeds[r] mod 2^31`` (one host
    read of the seeds; the CPU path)."""
    u_SV = torch.empty(seeds_S.shape[0], V, device=seeds_S.device)
    gen = torch.Generator(device=seeds_S.device)
    for r, seed in enumerate((seeds_S & SEED_MASK).tolist()):
        u_SV[r].uniform_(generator=gen.manual_seed(seed))
    return u_SV


def _uniform_rows_triton(seeds_S: torch.Tensor, V: int) -> torch.Tensor:
    u_SV = torch.empty(seeds_S.shape[0], V, device=seeds_S.device)
    block = min(BLOCK_V, triton.next_power_of_2(V))
    _uniform_rows_kernel[(seeds_S.shape[0], triton.cdiv(V, block))](seeds_S.contiguous(), u_SV, V, BLOCK_V=block)
    return u_SV


def uniform_rows(seeds: torch.Tensor, V: int) -> torch.Tensor:
    """The uniforms :func:`gumbel_sample` draws, as a tensor ``[S, V]`` fp32: ``u[r, v] = U(seeds[r], v)``."""
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,))
    if use_triton(seeds):
        return _uniform_rows_triton(seeds, V)
    return uniform_rows_torch(seeds, V)


def inverse_cdf_sample(weights_SV: torch.Tensor, u_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw, one token per row, from unnormalised weights; returns ``(token [S] int64, Σ_v w [S] fp64)``.

    With ``C_r[v] = Σ_{v' ≤ v} w_rv'``, token r is the ``v`` with ``C_r[v−1] ≤ u_r · C_r[V−1] < C_r[v]``: for
    ``u_r ~ U[0, 1)`` it is distributed as ``w_r / Σ w_r``, and a zero weight is never drawn; where the sums are
    exact (integer weights), ``u_r · C_r[V−1]`` exactly on a boundary ``C_r[k]`` draws the next positive weight, at
    both levels below. One uniform per row instead of Gumbel-max's V (the engine's path where the fused kernel does
    not run: no ``[S, V]`` noise, no two logs over the vocabulary).

    ``weights_SV``: non-negative and finite, fp32 or wider, at least one positive entry per row, row-major or
    vocabulary-major (strides (1, S): a transposed ``[V, S]`` tensor); ``u_S``: fp64 in
    [0, 1). The CDF is fp64 in two levels: blocks of ``B`` entries, then the entries of the chosen block. So the
    draw stays within fp64 rounding of the exact distribution at any vocabulary size, where an fp32 CDF of 150K
    entries would round every boundary to ~6e-8 of the total, the size of a typical token's probability. A block's
    own sum is fp32 (relative error ~1e-7 of the block's mass: the weights' own precision). ``B ≈ √V``, a power of
    two (128 for V = 16K, 512 for 152K): after the block sums each level touches about √V entries per row. Extra
    memory: ``[S, V / B]`` + ``[S, B]``, nothing of ``[S, V]``.
    """
    S, V = weights_SV.shape
    B = 1 << (V.bit_length() // 2)
    nb, tail = divmod(V, B)
    sums = []
    if nb and weights_SV.stride(1) == 1:  # row-major
        sums.append(weights_SV[:, : nb * B].unflatten(1, (nb, B)).sum(-1))
    elif nb:  # vocabulary-major (the engine's CPU logits): reduce over the middle dim, vectorised across rows
        sums.append(weights_SV.t()[: nb * B].unflatten(0, (nb, B)).sum(1).t())
    if tail:
        sums.append(weights_SV[:, nb * B :].sum(-1, keepdim=True))
    # C at each block's start and end, [S, blocks + 1] (C[:, 0] = 0); the ops are few on purpose: on CPU each costs
    # more than its arithmetic here (see the engine's decode step)
    bounds_SN = F.pad(sums[0] if len(sums) == 1 else torch.cat(sums, dim=1), (1, 0)).cumsum(1, dtype=torch.float64)
    total_S = bounds_SN[:, -1]
    if not total_S.is_cuda and not torch.isfinite(total_S).all():  # on CPU a host check costs nothing
        rows = (~torch.isfinite(total_S)).nonzero().flatten().tolist()
        raise ValueError(f"sampling: non-finite weights (logits) in rows {rows[:8]}: the model's activations "
                         "overflowed or are NaN")
    t_S = u_S * total_S
    i_S = _first_above(bounds_SN, t_S)  # block i − 1 is chosen: C[i − 1] <= t < C[i] (i >= 1: C[0] = 0 <= t)
    lo_hi_S2 = bounds_SN.gather(1, i_S[:, None] + torch.arange(-1, 1, device=i_S.device))  # its [C_lo, C_hi)
    lo_S = lo_hi_S2[:, 0]
    mass_S = lo_hi_S2[:, 1] - lo_S  # > 0: a block of positive mass is chosen
    cols_SB = torch.arange(-B, 0, device=weights_SV.device).add(i_S[:, None], alpha=B)  # its columns
    if tail:
        w_SB = weights_SV.gather(1, cols_SB.clamp(max=V - 1)).masked_fill(cols_SB >= V, 0.0)
    else:
        w_SB = weights_SV.gather(1, cols_SB)
    c_SB = w_SB.cumsum(dim=1, dtype=torch.float64)
    # where t falls inside the chosen block, on the scale of the block's own CDF: its offset times (fine sum / coarse
    # mass), a ratio of exactly 1 where the two sums agree, so that a boundary hit exactly stays exact (a fraction
    # offset / mass times the fine sum rounds, e.g. (1 / 49) · 49 < 1, and would draw the token before the boundary)
    j_S = _first_above(c_SB, (t_S - lo_S) * (c_SB[:, -1] / mass_S))
    return j_S + cols_SB[:, 0], total_S


def _first_above(c_SN: torch.Tensor, t_S: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose (non-decreasing) ``c`` exceeds ``t``, never past the last index where ``c``
    grows (so rounding at ``t ≈ c[-1]`` cannot land on a zero-weight entry)."""
    first = torch.searchsorted(c_SN, t_S[:, None], right=True).squeeze(1)
    last_growth = (c_SN < c_SN[:, -1:]).sum(dim=1)  # index of the first entry equal to the total
    return torch.minimum(first, last_growth)


def _gumbel_sample_torch(logits_SV, temperature: float, seeds_S):
    return gumbel_sample_ref(logits_SV, temperature, uniform_rows_torch(seeds_S, logits_SV.shape[1]))


def gumbel_sample(logits, temperature: float, seeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``softmax(logits / temperature)``; returns ``(token [S] int64, logp [S] fp32)``.

    ``seeds``: ``[S]`` int64 on the logits' device, one per row (computed there, so the CUDA path never
    synchronises with the host); row r's draw depends on ``seeds[r]`` and ``logits[r]`` alone.
    """
    _check_inputs(logits, temperature, seeds)
    if use_triton(logits):
        return _gumbel_sample_triton(logits, float(temperature), seeds)
    return _gumbel_sample_torch(logits, float(temperature), seeds)
