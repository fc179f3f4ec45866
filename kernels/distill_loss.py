"""``fused_linear_distill_loss``: the exact full-vocabulary divergence between a student and a frozen teacher, from
their hidden states and LM heads, never materialising a ``[tokens, vocab]`` logits tensor.

Math, per token ``i`` (student hidden ``h_i`` ``[Hs]``, head ``Ws`` ``[Vs, Hs]``; teacher ``g_i`` ``[Ht]``, ``Wt``
``[Vt, Ht]``; only the first ``V = vocab_size`` rows of each head are real tokens and enter the softmaxes)::

    zs_v = (h_i · Ws_v + bs_v) / T,   zt_v = (g_i · Wt_v + bt_v) / T          (T = temperature, both models)
    ls = zs − logsumexp(zs),  lt = zt − logsumexp(zt),  p = exp(ls) (student),  q = exp(lt) (teacher)

    TRL's generalized JSD (``GKDTrainer.generalized_jsd_loss``, GKD, Agarwal et al. 2023), β ∈ [0, 1]:
      β = 0:      D = KL(q ‖ p) = Σ_v q (lt − ls)                                  (forward KL)
      β = 1:      D = KL(p ‖ q) = Σ_v p (ls − lt)                                  (reverse KL)
      otherwise:  D = β KL(q ‖ m) + (1 − β) KL(p ‖ m),  m = β q + (1 − β) p,
                  log m = logaddexp(lt + log β, ls + log(1 − β))
    NeMo-RL's ``kl_type: mixed`` (``mixed_kl_weight`` = w):  D = w KL(q ‖ p) + (1 − w) KL(p ‖ q)
    (not the JSD at β = 0.5: that one compares each side with the mixture m).

Loss over the mask ``m_t`` (bool, or float weights), the GRPO loss's aggregations (``kernels/grpo_loss.py``)::

    grpo  mean_b Σ_t m D / max(Σ_t m, 1)    bnpo  Σ m D / max(Σ m, 1)
    dr_grpo  Σ m D / (B · max_completion_length)    dapo  Σ m D / max(num_items_in_batch or Σ m, 1)

TRL's ``reduction="batchmean"`` with ``labels`` is ``bnpo`` (the sum over kept tokens / their count), its
``num_items_in_batch`` is ``dapo``'s; without labels TRL divides the sum by the batch size B instead.

Gradient (to the student only; the teacher is a constant), per token with upstream ``γ_i = ∂loss/∂D_i``::

    ∂D/∂zs_v = cf (p_v − q_v) + cr p_v (ls_v − X_v − c)
      forward KL: cf = 1, cr = 0;  reverse KL: cf = 0, cr = 1, X = lt, c = KL(p ‖ q);  mixed: cf = w, cr = 1 − w,
      X = lt, c = KL(p ‖ q);  JSD: cf = 0, cr = 1 − β, X = log m, c = KL(p ‖ m)
    dz = γ ∂D/∂zs / T,   grad_h = dz @ Ws,   grad_Ws = dzᵀ @ h,   grad_bs = Σ_i dz_i

Algorithm. The forward streams vocabulary tiles of both models at once, with an online log-sum-exp for each. For the
KL modes one pass suffices: with running maxima, ``Σ exp(zt − mt)(zt − zs)`` (and the student-weighted twin) are
rescaled like the sums, and ``KL(q ‖ p) = Σ q (zt − zs) + lse_s − lse_t``. The JSD's ``log m`` needs both final LSEs,
so it takes a second pass over the tiles. The forward keeps per token each model's max ``m`` and ``r = log Σ exp(z −
m)`` (the LSE is ``m + r``; log-probs are formed as ``(z − m) − r``) and ``c``; the backward recomputes each tile of
both models' logits from the hidden states (Cut Cross-Entropy, Wijmans et al. 2024).

Memory (nothing of size N×V, forward or backward): O(N) fp32 per-token state (``[S, N]`` partials of the vocabulary
splits); the backward's fp32 ``[N, Hs]`` and ``[Vs, Hs]`` gradient accumulators, as ``fused_linear_logprobs``. At the
real scale, 16K completion tokens × Hs = Ht = 1536 × V = 151,936 in bf16: the two logits tensors an eager
implementation holds are 16384 × 151936 × 2 B = 5.0 GB each in bf16 (10 GB each in fp32, with as many again for
their log-softmaxes and the backward's); here the extra memory is the 0.93 GB fp32 ``[V, H]`` accumulator (returned
as the weight's gradient in its dtype, 0.47 GB), 0.1 GB fp32 ``[N, H]`` and the kept rows of both hidden states
(50 MB each). FLOPs: ``2·N·V·(Hs + Ht)`` per pass over the tiles: one pass (KL modes) or two (JSD) forward; the backward
recomputes both tiles and adds the two student gradient products, ``2·N·V·(Hs + Ht) + 4·N·V·Hs``. A larger teacher (Ht =
3584 for 7B) makes its recompute the largest term.

Numerics: bf16 (or fp16) operands in the tile matmuls with fp32 accumulation, everything after in fp32 (logits, LSEs,
probabilities, divergences, ``dz`` before it is rounded to the operand dtype for the gradient products, fp32 atomics).
The divergence is a sum of V = 151,936 fp32 terms per token (relative rounding ~1e-6 over blocked sums). Log-probs as
``(z − m) − r`` keep the top tokens' ``log p`` (and so ``p − q``) exact to the rounding of ``log p`` itself; ``z − lse``
would lose ~1e-7·|z| (measured at logit std 30, JSD: gradient error 1.8e-6 with ``z − lse``, 6e-8 now, the fp32
reference's own 3e-8). The KL modes' one pass reads ``Σ q (zt − zs)`` against ``lse_s − lse_t``: when the logits are
large both terms are large and the divergence is their difference, so its absolute error is ~1e-7 of the logits'
magnitude (measured at logit std 30: 7e-6 on a divergence of 66 nats; the element-wise fp32 reference 2e-7).

Paths (``kernels/utils.use_triton``): Triton on CUDA and under ``TRITON_INTERPRET=1``; otherwise a plain-torch path
chunked over tokens and vocabulary (two passes forward in every mode) with the same memory promise.

Shape legend: N tokens (K kept ones), Hs / Ht hidden sizes, Vs / Vt head rows, V real vocabulary, S vocabulary
splits, B sequences, T padded length.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .grpo_loss import MASK_DTYPES
from .grpo_options import check_normaliser
from .linear_logprobs import _chunk_buffers, _chunk_logits, _input_precision, _view
from .utils import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_cu_seqlens,
    check_shape,
    check_tensor,
    dot_in_fp32,
    launch_first_fitting,
    num_sms,
    seq_index,
    use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .linear_logprobs import _tile_logits

# The GRPO loss's token aggregations (named as its loss_type; the clipped-objective variants have no meaning here).
AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")
# Plain-torch path: token × vocabulary chunk (as linear_logprobs: a few reused [CHUNK_N, CHUNK_V] fp32 buffers).
TORCH_CHUNK_N = 2048
TORCH_CHUNK_V = 1024


@dataclass(frozen=True)
class _Divergence:
    """Which divergence: ``fwd_w · KL(q ‖ p) + rev_w · KL(p ‖ q)``, or the JSD with ``beta`` when ``jsd``."""

    fwd_w: float
    rev_w: float
    jsd: bool
    beta: float

    @property
    def grad_coefs(self) -> tuple[float, float]:
        """``(cf, cr)`` of the module docstring's gradient."""
        return (0.0, 1.0 - self.beta) if self.jsd else (self.fwd_w, self.rev_w)


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _distill_fwd_kernel(
        hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr,  # [N, Hs], [Vs, Hs], [Vs], [N, Ht], [Vt, Ht], [Vt]
        ms_ptr, ss_ptr, mt_ptr, st_ptr, af_ptr, ar_ptr,  # partial states [S, N] fp32
        N, V, Hs, Ht, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv,
        stride_wtk, inv_temp, tiles_per_split,
        HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, FWD_KL: tl.constexpr, REV_KL: tl.constexpr,
        DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (token tile, vocabulary split): online LSE of both models over the split's vocabulary tiles.

        Per token row, over the split: reads its two hidden rows once per vocabulary tile (from L2) and
        ``V_split · (Hs + Ht) / BLOCK_N`` head elements amortised over the tile; writes 4 fp32 partials (maxima and
        ``Σ exp(z − m)`` of each model) and, for the KL modes, ``af = Σ exp(zt − mt)(zt − zs)`` (FWD_KL) and
        ``ar = Σ exp(zs − ms)(zs − zt)`` (REV_KL), rescaled with their model's running max.
        FLOPs: ``2·(Hs + Ht)`` per (token, vocabulary) pair.
        """
        pid_n = tl.program_id(0).to(tl.int64)
        pid_s = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        ms = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        mt = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        ss = tl.zeros((BLOCK_N,), dtype=tl.float32)
        st = tl.zeros((BLOCK_N,), dtype=tl.float32)
        af = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ar = tl.zeros((BLOCK_N,), dtype=tl.float32)
        v_start = pid_s * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
        for v0 in range(v_start, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            zt = _tile_logits(ht_ptr, wt_ptr, bt_ptr, offs_n, mask_n, offs_v, mask_v, Ht, stride_htn, stride_htk,
                              stride_wtv, stride_wtk, inv_temp, HAS_BT, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K)  # [BLOCK_N, BLOCK_V]
            zs = _tile_logits(hs_ptr, ws_ptr, bs_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn, stride_hsk,
                              stride_wsv, stride_wsk, inv_temp, HAS_BS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K)  # [BLOCK_N, BLOCK_V]
            diff = tl.where(mask_v[None, :], zt - zs, 0.0)  # zt − zs, 0 on masked columns
            zt = tl.where(mask_v[None, :], zt, float("-inf"))
            zs = tl.where(mask_v[None, :], zs, float("-inf"))
            mt_new = tl.maximum(mt, tl.max(zt, axis=1))  # finite: every tile holds a valid column
            ms_new = tl.maximum(ms, tl.max(zs, axis=1))
            at = tl.exp(mt - mt_new)
            a_s = tl.exp(ms - ms_new)
            et = tl.exp(zt - mt_new[:, None])  # [BLOCK_N, BLOCK_V], 0 on masked columns
            es = tl.exp(zs - ms_new[:, None])
            st = st * at + tl.sum(et, axis=1)
            ss = ss * a_s + tl.sum(es, axis=1)
            if FWD_KL:
                af = af * at + tl.sum(et * diff, axis=1)
            if REV_KL:
                ar = ar * a_s - tl.sum(es * diff, axis=1)
            mt = mt_new
            ms = ms_new
        out = pid_s * N + offs_n
        tl.store(ms_ptr + out, ms, mask=mask_n)
        tl.store(ss_ptr + out, ss, mask=mask_n)
        tl.store(mt_ptr + out, mt, mask=mask_n)
        tl.store(st_ptr + out, st, mask=mask_n)
        if FWD_KL:
            tl.store(af_ptr + out, af, mask=mask_n)
        if REV_KL:
            tl.store(ar_ptr + out, ar, mask=mask_n)

    @triton.jit
    def _distill_jsd_kernel(
        hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr,  # as _distill_fwd_kernel
        stats_ptr,  # [4, N] fp32: ms, rs, mt, rt (each model's max and log Σ exp(z − max))
        jt_ptr, k_ptr,  # partial sums [S, N] fp32
        N, V, Hs, Ht, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv,
        stride_wtk, inv_temp, log_beta, log_1m_beta, tiles_per_split,
        HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """JSD's second pass, program (token tile, vocabulary split), both LSEs known: partial sums
        ``jt = Σ q (lt − log m)`` and ``k = Σ p (ls − log m)`` (so ``D = β jt + (1 − β) k``, ``c = k``).

        Reads as ``_distill_fwd_kernel`` plus 4 fp32 per token; writes 2 fp32 partials per token and split.
        """
        pid_n = tl.program_id(0).to(tl.int64)
        pid_s = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        ms, rs, mt, rt = _load_stats(stats_ptr, offs_n, mask_n, N)
        jt = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k = tl.zeros((BLOCK_N,), dtype=tl.float32)
        v_start = pid_s * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
        for v0 in range(v_start, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            valid = mask_n[:, None] & mask_v[None, :]
            lt = _tile_logits(ht_ptr, wt_ptr, bt_ptr, offs_n, mask_n, offs_v, mask_v, Ht, stride_htn, stride_htk,
                              stride_wtv, stride_wtk, inv_temp, HAS_BT, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K) - mt[:, None] - rt[:, None]  # [BLOCK_N, BLOCK_V]
            ls = _tile_logits(hs_ptr, ws_ptr, bs_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn, stride_hsk,
                              stride_wsv, stride_wsk, inv_temp, HAS_BS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K) - ms[:, None] - rs[:, None]
            lm = _log_mixture(ls, lt, log_beta, log_1m_beta)
            jt += tl.sum(tl.where(valid, tl.exp(lt) * (lt - lm), 0.0), axis=1)
            k += tl.sum(tl.where(valid, tl.exp(ls) * (ls - lm), 0.0), axis=1)
        out = pid_s * N + offs_n
        tl.store(jt_ptr + out, jt, mask=mask_n)
        tl.store(k_ptr + out, k, mask=mask_n)

    @triton.jit
    def _load_stats(stats_ptr, offs_n, mask_n, N):
        """Each model's max and ``r = log Σ exp(z − max)`` (so ``log p = (z − max) − r``: no rounding of a large
        ``lse`` against ``z``, which would cost ~1e-7·|z| in the log-probs of the top tokens)."""
        ms = tl.load(stats_ptr + offs_n, mask=mask_n, other=0.0)
        rs = tl.load(stats_ptr + N + offs_n, mask=mask_n, other=0.0)
        mt = tl.load(stats_ptr + 2 * N + offs_n, mask=mask_n, other=0.0)
        rt = tl.load(stats_ptr + 3 * N + offs_n, mask=mask_n, other=0.0)
        return ms, rs, mt, rt

    @triton.jit
    def _log_mixture(ls, lt, log_beta, log_1m_beta):
        """``log m = log(β e^lt + (1 − β) e^ls)`` as a two-term log-sum-exp (no underflow of tiny p, q)."""
        a = lt + log_beta
        b = ls + log_1m_beta
        hi = tl.maximum(a, b)
        return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))

    @triton.jit
    def _distill_bwd_kernel(
        hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr,  # as _distill_fwd_kernel
        stats_ptr, c_ptr, g_ptr,  # [4, N] as _distill_jsd_kernel; [N] fp32: the constant c, the upstream grad of D
        gh_ptr, gw_ptr, gb_ptr,  # fp32 accumulators [N, Hs], [Vs, Hs], [Vs] (contiguous, zero-initialised)
        N, V, Hs, Ht, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv,
        stride_wtk, inv_temp, cf, cr, log_beta, log_1m_beta,
        HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, JSD: tl.constexpr, REV: tl.constexpr,
        GRAD_H: tl.constexpr, GRAD_W: tl.constexpr, GRAD_B: tl.constexpr,
        DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, GROUP_N: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (token tile, vocabulary tile): recompute both tiles' logits, form ``dz``, accumulate the grads.

        As ``_linear_logprobs_bwd_kernel`` (one 2-D grid, fp32 atomics into ``grad_h`` and ``grad_W``, programs
        grouped by ``GROUP_N`` token tiles), with the teacher's tile recomputed too. FLOPs per tile:
        ``2·BN·BV·(Hs + Ht)`` recompute + ``4·BN·BV·Hs`` gradient products; atomically added bytes
        ``4·(BN + BV)·Hs``. ``REV``: the ``cr`` term is on (``cr ≠ 0``); ``JSD``: its ``X`` is ``log m``.
        """
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_v = tl.cdiv(V, BLOCK_V)
        group_size = GROUP_N * num_pid_v
        first_n = (pid // group_size) * GROUP_N
        rows = tl.minimum(num_pid_n - first_n, GROUP_N)
        pid_n = (first_n + (pid % group_size) % rows).to(tl.int64)
        pid_v = ((pid % group_size) // rows).to(tl.int64)

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < N
        mask_v = offs_v < V
        valid = mask_n[:, None] & mask_v[None, :]
        ms, rs, mt, rt = _load_stats(stats_ptr, offs_n, mask_n, N)
        g = tl.load(g_ptr + offs_n, mask=mask_n, other=0.0)
        lt = _tile_logits(ht_ptr, wt_ptr, bt_ptr, offs_n, mask_n, offs_v, mask_v, Ht, stride_htn, stride_htk,
                          stride_wtv, stride_wtk, inv_temp, HAS_BT, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                          BLOCK_K) - mt[:, None] - rt[:, None]  # [BLOCK_N, BLOCK_V]
        ls = _tile_logits(hs_ptr, ws_ptr, bs_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn, stride_hsk,
                          stride_wsv, stride_wsk, inv_temp, HAS_BS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                          BLOCK_K) - ms[:, None] - rs[:, None]
        p = tl.exp(ls)
        dd = cf * (p - tl.exp(lt))  # ∂D/∂zs
        if REV:
            c = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0)
            if JSD:
                x = _log_mixture(ls, lt, log_beta, log_1m_beta)
            else:
                x = lt
            dd += cr * p * (ls - x - c[:, None])
        dz = tl.where(valid, dd * (g * inv_temp)[:, None], 0.0)

        if GRAD_B:
            tl.atomic_add(gb_ptr + offs_v, tl.sum(dz, axis=0), mask=mask_v, sem="relaxed")
        if DOT_FP32:
            dz_op = dz
        else:
            dz_op = dz.to(ws_ptr.dtype.element_ty)  # bf16/fp16 operands for the tensor cores
        for k0 in range(0, Hs, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < Hs
            if GRAD_H:
                w = tl.load(ws_ptr + offs_v[:, None] * stride_wsv + offs_k[None, :] * stride_wsk,
                            mask=mask_v[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_V, BLOCK_K]
                if DOT_FP32:
                    w = w.to(tl.float32)
                gh = tl.dot(dz_op, w, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_K]
                tl.atomic_add(gh_ptr + offs_n[:, None] * Hs + offs_k[None, :], gh,
                              mask=mask_n[:, None] & mask_k[None, :], sem="relaxed")
            if GRAD_W:
                h = tl.load(hs_ptr + offs_n[:, None] * stride_hsn + offs_k[None, :] * stride_hsk,
                            mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
                if DOT_FP32:
                    h = h.to(tl.float32)
                gw = tl.dot(tl.trans(dz_op), h, input_precision=INPUT_PRECISION)  # [BLOCK_V, BLOCK_K]
                tl.atomic_add(gw_ptr + offs_v[:, None] * Hs + offs_k[None, :], gw,
                              mask=mask_v[:, None] & mask_k[None, :], sem="relaxed")


# Launch configurations (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages) on a GPU, largest tiles first, tried in
# order until one fits (``_utils.launch_first_fitting``), keyed by the element size. Two logits tiles are live at
# once (both models'), so the tiles are half linear_logprobs' in the token dimension; `pytest -m gpu_compile`
# compiles every entry for sm_80 and sm_90 and checks shared memory and spills.
_FWD_CONFIGS = {
    2: [(64, 128, 64, 8, 3), (64, 64, 64, 4, 2), (32, 64, 32, 4, 1)],
    4: [(64, 64, 32, 8, 3), (32, 64, 32, 4, 2), (32, 64, 32, 4, 1)],
}
_BWD_CONFIGS = {
    2: [(64, 128, 64, 8, 2), (64, 64, 64, 4, 2), (32, 64, 32, 4, 1)],
    4: [(64, 64, 32, 8, 2), (32, 64, 32, 4, 2), (32, 64, 32, 4, 1)],
}
_INTERPRET_CONFIG = (16, 128, 64, 4, 1)  # under the interpreter: few, large tiles (it runs per operation)
_GROUP_N = 16  # backward: token tiles per program group (they share W and h tiles in L2)


def _configs(t: torch.Tensor, table: dict) -> list[tuple[int, int, int, int, int]]:
    return [_INTERPRET_CONFIG] if dot_in_fp32(t) else table[t.element_size()]


def _launch_key(name: str, t: torch.Tensor) -> tuple:
    return ("distill_loss", name, t.dtype, t.device.index)


def _model_args(hs, ws, bs, ht, wt, bt):
    """Pointer and stride arguments shared by the three kernels (a missing bias passes a dummy pointer)."""
    return ((hs, ws, bs if bs is not None else hs, ht, wt, bt if bt is not None else ht),
            (hs.stride(0), hs.stride(1), ws.stride(0), ws.stride(1), ht.stride(0), ht.stride(1), wt.stride(0),
             wt.stride(1)))


def _split_grid(N, V, block_n, block_v, t):
    """(token tiles, splits, tiles per split): enough programs to fill the GPU, each split at least one tile."""
    target_programs = 8 if dot_in_fp32(t) else 2 * num_sms(t)
    n_tiles, v_tiles = triton.cdiv(N, block_n), triton.cdiv(V, block_v)
    splits = min(v_tiles, max(1, triton.cdiv(target_programs, n_tiles)))
    tiles_per_split = triton.cdiv(v_tiles, splits)
    return n_tiles, triton.cdiv(v_tiles, tiles_per_split), tiles_per_split


def _log_betas(div: _Divergence) -> tuple[float, float]:
    return (math.log(div.beta), math.log1p(-div.beta)) if div.jsd else (0.0, 0.0)


def _forward_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div: _Divergence):
    N, Hs = hs.shape
    Ht = ht.shape[1]
    ptrs, strides = _model_args(hs, ws, bs, ht, wt, bt)
    flags = dict(HAS_BS=bs is not None, HAS_BT=bt is not None, DOT_FP32=dot_in_fp32(hs),
                 INPUT_PRECISION=_input_precision(hs))
    fwd_kl, rev_kl = not div.jsd and div.fwd_w != 0.0, not div.jsd and div.rev_w != 0.0
    parts = []

    def launch(config):
        block_n, block_v, block_k, warps, stages = config
        n_tiles, splits, tiles_per_split = _split_grid(N, V, block_n, block_v, hs)
        part_SN = [torch.empty(splits, N, device=hs.device, dtype=torch.float32) for _ in range(6)]
        _distill_fwd_kernel[(n_tiles, splits)](
            *ptrs, *part_SN, N, V, Hs, Ht, *strides, inv_temp, tiles_per_split, **flags, FWD_KL=fwd_kl, REV_KL=rev_kl,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
        parts[:] = part_SN

    launch_first_fitting(_launch_key("fwd", hs), _configs(hs, _FWD_CONFIGS), launch)
    ms_SN, ss_SN, mt_SN, st_SN, af_SN, ar_SN = parts
    # Combine the splits' partials, O(S·N): sums and the KL accumulators rescale by exp(m_s − m).
    ms_N, mt_N = ms_SN.max(0).values, mt_SN.max(0).values
    scale_s_SN, scale_t_SN = torch.exp(ms_SN - ms_N), torch.exp(mt_SN - mt_N)
    sum_s_N, sum_t_N = (ss_SN * scale_s_SN).sum(0), (st_SN * scale_t_SN).sum(0)
    stats_4N = torch.stack([ms_N, torch.log(sum_s_N), mt_N, torch.log(sum_t_N)])  # lse = m + r, kept apart
    if div.jsd:
        jt_N, k_N = _jsd_pass_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N)
        return div.beta * jt_N + (1.0 - div.beta) * k_N, stats_4N, k_N
    d_N = torch.zeros(N, device=hs.device, dtype=torch.float32)
    rkl_N = None
    lse_gap_N = (stats_4N[0] - stats_4N[2]) + (stats_4N[1] - stats_4N[3])  # lse_s − lse_t
    if fwd_kl:  # KL(q ‖ p) = Σ q (zt − zs) + lse_s − lse_t
        d_N += div.fwd_w * ((af_SN * scale_t_SN).sum(0) / sum_t_N + lse_gap_N)
    if rev_kl:  # KL(p ‖ q) = Σ p (zs − zt) + lse_t − lse_s
        rkl_N = (ar_SN * scale_s_SN).sum(0) / sum_s_N - lse_gap_N
        d_N += div.rev_w * rkl_N
    return d_N, stats_4N, rkl_N


def _jsd_pass_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N):
    N, Hs = hs.shape
    ptrs, strides = _model_args(hs, ws, bs, ht, wt, bt)
    parts = []

    def launch(config):
        block_n, block_v, block_k, warps, stages = config
        n_tiles, splits, tiles_per_split = _split_grid(N, V, block_n, block_v, hs)
        part_SN = [torch.empty(splits, N, device=hs.device, dtype=torch.float32) for _ in range(2)]
        _distill_jsd_kernel[(n_tiles, splits)](
            *ptrs, stats_4N, *part_SN, N, V, Hs, ht.shape[1], *strides, inv_temp, *_log_betas(div),
            tiles_per_split, HAS_BS=bs is not None, HAS_BT=bt is not None, DOT_FP32=dot_in_fp32(hs),
            INPUT_PRECISION=_input_precision(hs), BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages,
        )
        parts[:] = part_SN

    launch_first_fitting(_launch_key("jsd", hs), _configs(hs, _FWD_CONFIGS), launch)
    return parts[0].sum(0), parts[1].sum(0)


def _backward_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N, c_N, g_N, needs):
    N, Hs = hs.shape
    f32 = dict(dtype=torch.float32, device=hs.device)
    gh_NH = torch.zeros(N, Hs, **f32) if needs[0] else None
    gw_VH = torch.zeros(ws.shape[0], Hs, **f32) if needs[1] else None  # the one fp32 [Vs, Hs] accumulator
    gb_V = torch.zeros(ws.shape[0], **f32) if needs[2] else None
    ptrs, strides = _model_args(hs, ws, bs, ht, wt, bt)
    cf, cr = div.grad_coefs

    def launch(config):  # a config that does not fit fails at launch, before any atomic add
        block_n, block_v, block_k, warps, stages = config
        grid = (triton.cdiv(N, block_n) * triton.cdiv(V, block_v),)
        _distill_bwd_kernel[grid](
            *ptrs, stats_4N, c_N if c_N is not None else g_N, g_N,
            *(x if x is not None else g_N for x in (gh_NH, gw_VH, gb_V)),
            N, V, Hs, ht.shape[1], *strides, inv_temp, cf, cr, *_log_betas(div),
            HAS_BS=bs is not None, HAS_BT=bt is not None, JSD=div.jsd, REV=cr != 0.0,
            GRAD_H=needs[0], GRAD_W=needs[1], GRAD_B=needs[2], DOT_FP32=dot_in_fp32(hs),
            INPUT_PRECISION=_input_precision(hs), GROUP_N=_GROUP_N, BLOCK_N=block_n, BLOCK_V=block_v,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )

    launch_first_fitting(_launch_key("bwd", hs), _configs(hs, _BWD_CONFIGS), launch)
    return gh_NH, gw_VH, gb_V


# ----------------------------------------------------------------------------------------------------------------------
# Plain-torch path (CPU without the interpreter): chunked, same memory promise
# ----------------------------------------------------------------------------------------------------------------------
def _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs, stats_4n=None):
    """Both models' logits ``zs``, ``zt`` of vocabulary chunk ``[v0, v1)`` into ``bufs[0]``, ``bufs[1]``; with the
    statistics ``(ms, rs, mt, rt)`` given, their log-probs ``(z − m) − r`` (the max folded into the ``addmm``)."""
    n, v = hs_nH.shape[0], v1 - v0
    ms, rs, mt, rt = (None,) * 4 if stats_4n is None else stats_4n
    zs_nv = _chunk_logits(hs_nH, ws, bs, v0, v1, inv_temp, _view(bufs[0], n, v), ms)
    zt_nv = _chunk_logits(ht_nH, wt, bt, v0, v1, inv_temp, _view(bufs[1], n, v), mt)
    if stats_4n is None:
        return zs_nv, zt_nv
    return zs_nv.sub_(rs[:, None]), zt_nv.sub_(rt[:, None])


def _online_max_sum(z_nv, m_n, s_n, tmp_nv):
    """Merge a chunk into the running max ``m`` and ``s = Σ exp(z − m)`` (``m = −inf``, ``s = 0`` to start)."""
    m_new = torch.maximum(m_n, z_nv.amax(1))
    chunk_n = torch.sub(z_nv, m_new[:, None], out=tmp_nv).exp_().sum(1)
    return m_new, s_n * torch.exp(m_n - m_new) + chunk_n


def _forward_torch(hs, ws, bs, ht, wt, bt, V, inv_temp, div: _Divergence):
    """Pass 1 per token chunk: each model's running max and ``Σ exp(z − max)`` over the vocabulary chunks. Pass 2:
    the per-token sums of the module docstring with the log-probs known (``Σ q (lt − ls)``, ``Σ p (ls − lt)``, or
    the JSD's ``Σ q (lt − log m)`` and ``Σ p (ls − log m)``). Chunk buffers, reused: ``zs`` / ``ls``, ``zt`` /
    ``lt`` and one temporary."""
    N = hs.shape[0]
    f32 = dict(dtype=torch.float32, device=hs.device)
    stats_4N, d_N = torch.empty(4, N, **f32), torch.empty(N, **f32)
    c_N = torch.empty(N, **f32) if (div.jsd or div.rev_w != 0.0) else None
    log_b, log_1mb = _log_betas(div)
    bufs = _chunk_buffers(3, N, hs.device)
    for n0 in range(0, N, TORCH_CHUNK_N):
        n1 = min(n0 + TORCH_CHUNK_N, N)
        n = n1 - n0
        hs_nH, ht_nH = hs[n0:n1].float(), ht[n0:n1].float()
        ms_n, mt_n = torch.full((n,), float("-inf"), **f32), torch.full((n,), float("-inf"), **f32)
        ss_n, st_n = torch.zeros(n, **f32), torch.zeros(n, **f32)
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            zs_nv, zt_nv = _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs)
            tmp_nv = _view(bufs[2], n, v1 - v0)
            ms_n, ss_n = _online_max_sum(zs_nv, ms_n, ss_n, tmp_nv)
            mt_n, st_n = _online_max_sum(zt_nv, mt_n, st_n, tmp_nv)
        stats_4n = stats_4N[:, n0:n1]
        torch.stack([ms_n, ss_n.log(), mt_n, st_n.log()], out=stats_4n)
        d_n, c_n = torch.zeros(n, **f32), torch.zeros(n, **f32)
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            ls_nv, lt_nv = _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs, stats_4n)
            tmp_nv = _view(bufs[2], n, v1 - v0)
            if div.jsd:
                lm_nv = torch.logaddexp(lt_nv + log_b, ls_nv + log_1mb, out=tmp_nv)
                d_n += div.beta * torch.linalg.vecdot(lt_nv.exp(), lt_nv - lm_nv)
                c_n += torch.linalg.vecdot(ls_nv.exp(), ls_nv - lm_nv)
                continue
            diff_nv = torch.sub(lt_nv, ls_nv, out=tmp_nv)  # lt − ls
            if div.fwd_w != 0.0:
                d_n += div.fwd_w * torch.linalg.vecdot(lt_nv.exp_(), diff_nv)
            if div.rev_w != 0.0:
                c_n -= torch.linalg.vecdot(ls_nv.exp_(), diff_nv)
        if div.jsd or div.rev_w != 0.0:
            d_n += (1.0 - div.beta if div.jsd else div.rev_w) * c_n
            c_N[n0:n1] = c_n
        d_N[n0:n1] = d_n
    return d_N, stats_4N, c_N


def _backward_torch(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N, c_N, g_N, needs):
    """Per (token chunk, vocabulary chunk): both log-probs from one ``addmm`` each into reused buffers, then
    ``dz = (γ/T) [cf (p − q) + cr p (ls − X − c)]`` in place, and the three gradient products."""
    N, Hs = hs.shape
    f32 = dict(dtype=torch.float32, device=hs.device)
    gh_NH = torch.zeros(N, Hs, **f32) if needs[0] else None
    gw_VH = torch.zeros(ws.shape[0], Hs, **f32) if needs[1] else None  # the one fp32 [Vs, Hs] accumulator
    gb_V = torch.zeros(ws.shape[0], **f32) if needs[2] else None
    cf, cr = div.grad_coefs
    log_b, log_1mb = _log_betas(div)
    bufs = _chunk_buffers(3, N, hs.device)
    for n0 in range(0, N, TORCH_CHUNK_N):
        n1 = min(n0 + TORCH_CHUNK_N, N)
        n = n1 - n0
        hs_nH, ht_nH = hs[n0:n1].float(), ht[n0:n1].float()
        scale_n1 = g_N[n0:n1, None] * inv_temp  # [n, 1] γ/T
        c_n1 = c_N[n0:n1, None] if c_N is not None else None
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            ls_nv, lt_nv = _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs,
                                           stats_4N[:, n0:n1])
            p_nv = torch.exp(ls_nv, out=_view(bufs[2], n, v1 - v0))
            dz_nv = ls_nv
            if cr != 0.0:  # cr p (ls − X − c), X = log m (JSD) or lt, built in ls's buffer
                x_nv = torch.logaddexp(lt_nv + log_b, ls_nv + log_1mb) if div.jsd else lt_nv
                dz_nv.sub_(x_nv).sub_(c_n1).mul_(p_nv).mul_(cr)
            else:
                dz_nv.zero_()
            if cf != 0.0:  # + cf (p − q)
                dz_nv.add_(p_nv, alpha=cf).sub_(lt_nv.exp_(), alpha=cf)
            dz_nv.mul_(scale_n1)
            if gh_NH is not None:
                gh_NH[n0:n1].addmm_(dz_nv, ws[v0:v1].float())
            if gw_VH is not None:
                gw_VH[v0:v1].addmm_(dz_nv.t(), hs_nH)
            if gb_V is not None:
                gb_V[v0:v1] += dz_nv.sum(0)
    return gh_NH, gw_VH, gb_V


# ----------------------------------------------------------------------------------------------------------------------
# autograd and the functional API
# ----------------------------------------------------------------------------------------------------------------------
class _DistillDivergence(torch.autograd.Function):
    """Per-token divergence ``D [K]`` (fp32) of the kept rows; gradients to the student's hidden, weight, bias."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, V, inv_temp, div):
        kernel = use_triton(hs)
        fwd = _forward_triton if kernel else _forward_torch
        d_K, stats_4K, c_K = fwd(hs, ws, bs, ht, wt, bt, V, inv_temp, div)
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, stats_4K, c_K)
        ctx.kernel, ctx.V, ctx.inv_temp, ctx.div = kernel, V, inv_temp, div
        return d_K

    @staticmethod
    def backward(ctx, g_K):
        hs, ws, bs, ht, wt, bt, stats_4K, c_K = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]  # a frozen head skips its [V, H] accumulator and a third of the work
        if not any(needs):
            return (None,) * 9
        bwd = _backward_triton if ctx.kernel else _backward_torch
        grads = bwd(hs, ws, bs, ht, wt, bt, ctx.V, ctx.inv_temp, ctx.div, stats_4K, c_K,
                    g_K.float().contiguous(), needs)
        grads = [None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (hs, ws, bs))]
        return *grads, None, None, None, None, None, None


def _check_unit(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _validate(hs, ws, ht, wt, mask, bs, bt, beta, mixed_kl_weight, temperature, cu_seqlens, vocab_size, loss_type,
              max_completion_length, num_items_in_batch) -> tuple[_Divergence, int]:
    check_tensor("student_hidden", hs, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    dev, dtype = hs.device, hs.dtype
    packed = cu_seqlens is not None
    if packed != (hs.dim() == 2):
        raise ValueError(f"student_hidden must be [N, H] with cu_seqlens (packed) or [B, T, H] without (padded), "
                         f"got shape {tuple(hs.shape)} and cu_seqlens={'given' if packed else None}")
    check_tensor("student_weight", ws, ndim=2, dtypes=(dtype,), device=dev)
    check_tensor("teacher_hidden", ht, ndim=hs.dim(), dtypes=(dtype,), device=dev)
    check_tensor("teacher_weight", wt, ndim=2, dtypes=(dtype,), device=dev)
    check_shape("teacher_hidden", ht, (*hs.shape[:-1], ht.shape[-1]), "student_hidden's leading dims")
    for name, w, h in (("student_weight", ws, hs), ("teacher_weight", wt, ht)):
        if w.shape[1] != h.shape[-1]:
            hidden = name.replace("weight", "hidden")
            raise ValueError(f"{name} has shape {tuple(w.shape)}: its dim 1 must equal {hidden}'s last dim "
                             f"{h.shape[-1]}")
    for name, b, w in (("student_bias", bs, ws), ("teacher_bias", bt, wt)):
        if b is not None:
            check_tensor(name, b, ndim=1, dtypes=(dtype,), device=dev)
            check_shape(name, b, (w.shape[0],), f"{name.replace('bias', 'weight')}'s vocabulary dim")
    check_tensor("mask", mask, dtypes=MASK_DTYPES, device=dev)
    check_shape("mask", mask, tuple(hs.shape[:-1]), "student_hidden's leading dims")
    if packed:
        check_tensor("cu_seqlens", cu_seqlens, device=dev)
        check_cu_seqlens(cu_seqlens, hs.shape[0])
    if (beta is None) == (mixed_kl_weight is None):
        raise ValueError("give exactly one of beta (TRL's generalized JSD) and mixed_kl_weight (NeMo-RL's mixed KL), "
                         f"got beta={beta!r}, mixed_kl_weight={mixed_kl_weight!r}")
    if beta is not None:
        _check_unit("beta", beta)
        div = _Divergence(fwd_w=float(beta == 0), rev_w=float(beta == 1), jsd=0.0 < beta < 1.0, beta=float(beta))
    else:
        _check_unit("mixed_kl_weight", mixed_kl_weight)
        div = _Divergence(fwd_w=float(mixed_kl_weight), rev_w=1.0 - float(mixed_kl_weight), jsd=False, beta=0.0)
    if isinstance(temperature, bool) or not (isinstance(temperature, numbers.Real) and math.isfinite(temperature)
                                             and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    rows = min(ws.shape[0], wt.shape[0])
    if vocab_size is None:
        if ws.shape[0] != wt.shape[0]:
            raise ValueError(f"student_weight has {ws.shape[0]} rows and teacher_weight {wt.shape[0]}: pass "
                             f"vocab_size (the tokenizer's real vocabulary, at most {rows}) to leave padded rows out")
        vocab_size = rows
    elif isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or not 1 <= vocab_size <= rows:
        raise ValueError(f"vocab_size must be an int in [1, {rows}] (the heads' rows), got {vocab_size!r}")
    if loss_type not in AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {AGGREGATIONS}, got {loss_type!r}")
    check_normaliser(loss_type, max_completion_length, num_items_in_batch, packed)
    return div, int(vocab_size)


def fused_linear_distill_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float | None = None,
    mixed_kl_weight: float | None = None,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    vocab_size: int | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation loss of the student towards the teacher over the full vocabulary; the math is in the module
    docstring. Nothing of size N×V is allocated, forward or backward.

    Args:
        student_hidden: padded ``[B, T, Hs]`` or packed ``[N, Hs]`` (with ``cu_seqlens``) fp32/bf16/fp16, the
            student's last hidden state (any strides).
        student_weight: ``[Vs, Hs]`` the student's LM head, same dtype (tied embeddings need nothing special).
        teacher_hidden: ``[B, T, Ht]`` / ``[N, Ht]``, the teacher's last hidden state on the same tokens, same dtype.
        teacher_weight: ``[Vt, Ht]`` the teacher's LM head. The teacher is a constant: no gradient reaches it.
        mask: ``[B, T]`` / ``[N]``, bool, integer or float (float values weigh tokens); rows with ``mask == 0``
            cost no vocabulary work (they are gathered out first; their count is read back to the host once).
        beta: TRL's generalized JSD coefficient in [0, 1] (0: KL(teacher ‖ student), 1: KL(student ‖ teacher)).
        mixed_kl_weight: instead of ``beta``, NeMo-RL's ``kl_type: mixed`` with this weight on the forward KL.
        temperature: ``T > 0`` divides both models' logits (TRL's convention; no ``T²`` factor).
        student_bias, teacher_bias: optional ``[Vs]`` / ``[Vt]``.
        cu_seqlens: ``[B + 1]`` int32 sequence offsets of packed input.
        vocab_size: the real vocabulary: only head rows ``[0, vocab_size)`` enter the softmaxes (Qwen2.5-7B pads
            its head to 152,064 rows, the 1.5B to 151,936, with one tokenizer of 151,665 tokens). Default: all rows,
            which requires ``Vs == Vt``. Gradient rows of the student's head beyond it are zero.
        loss_type, max_completion_length, num_items_in_batch: the aggregation over tokens, as :func:`grpo_loss`'s
            (module docstring).

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-d fp32 tensor; ``metrics["divergence"]`` the mask-weighted token mean of
        ``D`` (detached), whatever ``loss_type`` is.
    """
    div, V = _validate(student_hidden, student_weight, teacher_hidden, teacher_weight, mask, student_bias,
                       teacher_bias, beta, mixed_kl_weight, temperature, cu_seqlens, vocab_size, loss_type,
                       max_completion_length, num_items_in_batch)
    hs_NH = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht_NH = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    wt = teacher_weight.detach()
    bs = None if student_bias is None else student_bias.contiguous()  # the kernels read biases with unit stride
    bt = None if teacher_bias is None else teacher_bias.detach().contiguous()
    m_N = mask.reshape(-1).float()
    kept = (m_N != 0).nonzero().squeeze(1)  # [K], host sync: K sets the shape of the work
    # a zero that still reaches the student's parameters, so backward runs when no token is kept
    d_N = hs_NH[:1, :1].float().sum() * 0.0 + student_weight[:1, :1].float().sum() * 0.0
    if bs is not None:
        d_N = d_N + bs[:1].float().sum() * 0.0
    d_N = d_N + torch.zeros_like(m_N)  # [N]
    if kept.numel():
        d_K = _DistillDivergence.apply(hs_NH.index_select(0, kept), student_weight, bs, ht_NH.index_select(0, kept),
                                       wt, bt, V, 1.0 / float(temperature), div)
        d_N = d_N.index_put((kept,), d_K)
    if cu_seqlens is not None:
        n_seqs, T = cu_seqlens.numel() - 1, None
        sid_N = seq_index(cu_seqlens, m_N.numel())
    else:
        n_seqs, T = mask.shape
        sid_N = torch.arange(n_seqs, device=m_N.device).repeat_interleave(T)
    md_N = m_N * d_N
    total, count = md_N.sum(), m_N.sum()
    if loss_type == "grpo":
        per_seq_B = torch.zeros(n_seqs, device=m_N.device).index_add(0, sid_N, md_N)
        count_B = torch.zeros(n_seqs, device=m_N.device).index_add(0, sid_N, m_N)
        loss = (per_seq_B / count_B.clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = total / count.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = total / (n_seqs * (max_completion_length or T))
    else:  # dapo
        denom = count if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=m_N.device)
        loss = total / denom.float().clamp(min=1.0)
    return loss, {"divergence": (total / count.clamp(min=1.0)).detach()}
