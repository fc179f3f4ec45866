"""Temperature sampling by the Gumbel-max trick, one token per row of logits (no autograd).

For row r of ``logits`` ``[S, V]`` with ``x = logits / temperature``::

    token_r = argmax_v (x_v + g_v),   g_v = −log(−log u_v),  u_v ~ U[0, 1)
    logp_r  = x_token − logsumexp(x)  (= log_softmax(x)[token])

so ``token_r`` is distributed as ``softmax(x)``. Returns ``(token [S] int64, logp [S] fp32)``. ``u = 0`` gives
``g = −inf``: never picked.

Paths (DESIGN.md): on CUDA and under ``TRITON_INTERPRET=1``, one kernel per row that draws ``u`` in registers
(philox keyed by ``seed`` and the flat index ``r·V + v``, so ``seed`` is a one-element int64 device tensor and no
host synchronisation happens) and reads the row twice; otherwise torch ops with a ``torch.Generator`` seeded from
``seed`` (one host read). Both draw from the same distribution; the draws themselves differ between the paths.

Shape legend: S rows (slots), V vocabulary.
"""

from __future__ import annotations

import torch

from ._utils import FLOAT_DTYPES, HAS_TRITON, check_tensor, use_triton
from .reference import gumbel_sample_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK_V = 2048  # logits per inner step of the kernel


if HAS_TRITON:

    @triton.jit
    def _gumbel_sample_kernel(
        LOGITS, SEED, TOK, LOGP, V, stride_row, inv_temperature, BLOCK_V: tl.constexpr
    ):
        """Row r: x = logits / T; token = argmax_v (x_v + g_v) with g_v = −log(−log u_v), u_v = philox(seed,
        r·V + v) ~ U[0, 1); logp = x_token − logsumexp(x). Two reads of the row's V logits (max, then sum and
        argmax), two scalars written: no noise tensor, no softmax tensor."""
        r = tl.program_id(0).to(tl.int64)
        seed = tl.load(SEED)
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
            u = tl.rand(seed, (r * V + v).to(tl.int32))  # the philox offset wraps past 2³¹ entries (S·V)
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


def _check_inputs(logits, temperature, seed) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have unit stride on the vocabulary dim, got strides {logits.stride()}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    check_tensor("seed", seed, ndim=1, dtypes=(torch.int64,), device=logits.device)
    if seed.numel() != 1:
        raise ValueError(f"seed must hold one element, got shape {tuple(seed.shape)}")


def _gumbel_sample_triton(logits_SV, temperature: float, seed):
    S, V = logits_SV.shape
    tok_S = torch.empty(S, dtype=torch.long, device=logits_SV.device)
    logp_S = torch.empty(S, dtype=torch.float32, device=logits_SV.device)
    _gumbel_sample_kernel[(S,)](
        logits_SV, seed, tok_S, logp_S, V, logits_SV.stride(0), 1.0 / temperature,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=8,
    )  # fmt: skip
    return tok_S, logp_S


def _gumbel_sample_torch(logits_SV, temperature: float, seed):
    gen = torch.Generator(device=logits_SV.device).manual_seed(int(seed.item()))  # host read: the CPU path
    u_SV = torch.rand(logits_SV.shape, generator=gen, device=logits_SV.device)
    return gumbel_sample_ref(logits_SV, temperature, u_SV)


def gumbel_sample(logits, temperature: float, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``softmax(logits / temperature)``; returns ``(token [S] int64, logp [S] fp32)``.

    ``seed``: a one-element int64 tensor on the logits' device (drawn there from a ``torch.Generator``, so the
    CUDA path never synchronises with the host); equal seeds and logits give equal draws.
    """
    _check_inputs(logits, temperature, seed)
    if use_triton(logits):
        return _gumbel_sample_triton(logits, float(temperature), seed)
    return _gumbel_sample_torch(logits, float(temperature), seed)
