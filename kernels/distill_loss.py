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

import torch

from .distill_kernels import Divergence, backward_triton, forward_triton, log_betas
from .grpo_options import check_normaliser
from .linear_logprobs import as_2d_view, chunk_buffers, chunk_logits
from .names import REDUCTIONS
from .utils import (
    FLOAT_DTYPES,
    MASK_DTYPES,
    check_cu_seqlens,
    check_shape,
    check_tensor,
    seq_index,
    use_triton,
)

# Plain-torch path: token × vocabulary chunk (as linear_logprobs: a few reused [CHUNK_N, CHUNK_V] fp32 buffers).
TORCH_CHUNK_N = 2048
TORCH_CHUNK_V = 1024




# ----------------------------------------------------------------------------------------------------------------------
# Plain-torch path (CPU without the interpreter): chunked, same memory promise
# ----------------------------------------------------------------------------------------------------------------------
def _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs, stats_4n=None):
    """Both models' logits ``zs``, ``zt`` of vocabulary chunk ``[v0, v1)`` into ``bufs[0]``, ``bufs[1]``; with the
    statistics ``(ms, rs, mt, rt)`` given, their log-probs ``(z − m) − r`` (the max folded into the ``addmm``)."""
    n, v = hs_nH.shape[0], v1 - v0
    ms, rs, mt, rt = (None,) * 4 if stats_4n is None else stats_4n
    zs_nv = chunk_logits(hs_nH, ws, bs, v0, v1, inv_temp, as_2d_view(bufs[0], n, v), ms)
    zt_nv = chunk_logits(ht_nH, wt, bt, v0, v1, inv_temp, as_2d_view(bufs[1], n, v), mt)
    if stats_4n is None:
        return zs_nv, zt_nv
    return zs_nv.sub_(rs[:, None]), zt_nv.sub_(rt[:, None])


def _online_max_sum(z_nv, m_n, s_n, tmp_nv):
    """Merge a chunk into the running max ``m`` and ``s = Σ exp(z − m)`` (``m = −inf``, ``s = 0`` to start)."""
    m_new = torch.maximum(m_n, z_nv.amax(1))
    chunk_n = torch.sub(z_nv, m_new[:, None], out=tmp_nv).exp_().sum(1)
    return m_new, s_n * torch.exp(m_n - m_new) + chunk_n


def _forward_torch(hs, ws, bs, ht, wt, bt, V, inv_temp, div: Divergence):
    """Pass 1 per token chunk: each model's running max and ``Σ exp(z − max)`` over the vocabulary chunks. Pass 2:
    the per-token sums of the module docstring with the log-probs known (``Σ q (lt − ls)``, ``Σ p (ls − lt)``, or
    the JSD's ``Σ q (lt − log m)`` and ``Σ p (ls − log m)``). Chunk buffers, reused: ``zs`` / ``ls``, ``zt`` /
    ``lt`` and one temporary."""
    N = hs.shape[0]
    f32 = dict(dtype=torch.float32, device=hs.device)
    stats_4N, d_N = torch.empty(4, N, **f32), torch.empty(N, **f32)
    c_N = torch.empty(N, **f32) if (div.jsd or div.rev_w != 0.0) else None
    log_b, log_1mb = log_betas(div)
    bufs = chunk_buffers(3, N, hs.device)
    for n0 in range(0, N, TORCH_CHUNK_N):
        n1 = min(n0 + TORCH_CHUNK_N, N)
        n = n1 - n0
        hs_nH, ht_nH = hs[n0:n1].float(), ht[n0:n1].float()
        ms_n, mt_n = torch.full((n,), float("-inf"), **f32), torch.full((n,), float("-inf"), **f32)
        ss_n, st_n = torch.zeros(n, **f32), torch.zeros(n, **f32)
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            zs_nv, zt_nv = _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs)
            tmp_nv = as_2d_view(bufs[2], n, v1 - v0)
            ms_n, ss_n = _online_max_sum(zs_nv, ms_n, ss_n, tmp_nv)
            mt_n, st_n = _online_max_sum(zt_nv, mt_n, st_n, tmp_nv)
        stats_4n = stats_4N[:, n0:n1]
        torch.stack([ms_n, ss_n.log(), mt_n, st_n.log()], out=stats_4n)
        d_n, c_n = torch.zeros(n, **f32), torch.zeros(n, **f32)
        for v0 in range(0, V, TORCH_CHUNK_V):
            v1 = min(v0 + TORCH_CHUNK_V, V)
            ls_nv, lt_nv = _chunk_logprobs(hs_nH, ws, bs, ht_nH, wt, bt, v0, v1, inv_temp, bufs, stats_4n)
            tmp_nv = as_2d_view(bufs[2], n, v1 - v0)
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
    log_b, log_1mb = log_betas(div)
    bufs = chunk_buffers(3, N, hs.device)
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
            p_nv = torch.exp(ls_nv, out=as_2d_view(bufs[2], n, v1 - v0))
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
        fwd = forward_triton if kernel else _forward_torch
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
        bwd = backward_triton if ctx.kernel else _backward_torch
        grads = bwd(hs, ws, bs, ht, wt, bt, ctx.V, ctx.inv_temp, ctx.div, stats_4K, c_K,
                    g_K.float().contiguous(), needs)
        grads = [None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (hs, ws, bs))]
        return *grads, None, None, None, None, None, None


def _check_unit(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _validate(hs, ws, ht, wt, mask, bs, bt, beta, mixed_kl_weight, temperature, cu_seqlens, vocab_size, loss_type,
              max_completion_length, num_items_in_batch) -> tuple[Divergence, int]:
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
        div = Divergence(fwd_w=float(beta == 0), rev_w=float(beta == 1), jsd=0.0 < beta < 1.0, beta=float(beta))
    else:
        _check_unit("mixed_kl_weight", mixed_kl_weight)
        div = Divergence(fwd_w=float(mixed_kl_weight), rev_w=1.0 - float(mixed_kl_weight), jsd=False, beta=0.0)
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
    if loss_type not in REDUCTIONS:  # the GRPO loss's token aggregations, named as its loss_type
        raise ValueError(f"loss_type must be one of {REDUCTIONS}, got {loss_type!r}")
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
