"""DPO-family losses on sequence log-probs, and the fused version that starts from the last hidden state.

Math (``kernels/reference.py::dpo_loss_ref`` is the spec), per pair ``i`` of a chosen and a rejected completion::

    c_i, r_i = π_c − ref_c, π_r − ref_r                      (π: policy sequence log-prob, ref: reference's)
    h_i      = c_i − r_i
    sigmoid  −(1 − ls)·log σ(β h) − ls·log σ(−β h)          (ls = label_smoothing)
    ipo      (c/n_c − r/n_r − 1/(2β))²                      (n: completion tokens, ≥ 1; h when not given)
    hinge    relu(1 − β h)
    loss     = mean_i

Metrics (detached fp32 0-d tensors): ``rewards/chosen = mean β c``, ``rewards/rejected = mean β r``,
``rewards/accuracies`` (share of pairs whose chosen reward beats the rejected one), ``rewards/margins`` (mean
difference).

Against TRL 1.16's ``DPOTrainer`` (``_compute_loss``): with the default ``label_smoothing = 0`` every type gives
TRL's numbers. ``ipo`` divides each sequence's log-ratio by its number of completion tokens before the square, as
TRL does (``chosen_lengths`` / ``rejected_lengths``; :func:`fused_linear_dpo_loss` counts them from its mask);
without lengths it squares the summed log-ratios (the IPO paper's Eq. 17 on sequence log-probs). ``label_smoothing
> 0`` on ``sigmoid`` is conservative DPO (cDPO, labels flipped with probability ``ls``), which TRL 1.16 no longer
applies to ``sigmoid`` (it keeps the smoothing for its ``robust``, ``exo_pair`` and ``aot`` types): a deliberate
extension, not TRL's number.

Plain torch on purpose: ``dpo_loss`` is a handful of elementwise ops on ``[B]`` values; one kernel launch would cost
more than the arithmetic, and autograd's few tiny kernels are not worth fusing. The expensive part of DPO is the
sequence log-probs, which :func:`fused_linear_dpo_loss` takes from ``fused_linear_logprobs`` (no logits in memory).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .linear_logprobs import masked_linear_logprobs
from .names import DPO_LOSS_TYPES
from .utils import FLOAT_DTYPES, MASK_DTYPES, check_cu_seqlens, check_shape, check_tensor, seq_index


def _check_options(beta, loss_type, label_smoothing) -> None:
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real)
            or not 0.0 <= label_smoothing <= 0.5):
        raise ValueError(f"label_smoothing must be a number in [0, 0.5], got {label_smoothing!r}")


def _check_lengths(chosen_lengths, rejected_lengths, like: torch.Tensor) -> None:
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("chosen_lengths and rejected_lengths must be given together (or neither)")
    for name, t in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(torch.int32, torch.int64, *FLOAT_DTYPES), device=like.device)
            check_shape(name, t, tuple(like.shape), f"policy_chosen_logps {tuple(like.shape)}")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss (module docstring) on ``[B]`` sequence log-probs; returns ``(loss, metrics)``, loss 0-d fp32.

    Computed in fp32 whatever the inputs' dtype. Gradients reach the two policy inputs; the reference log-probs
    are constants (detached), as in TRL. ``chosen_lengths`` / ``rejected_lengths`` (``[B]``, both or neither):
    completion token counts, used by ``ipo`` only (clamped to ≥ 1, as in TRL).
    """
    names = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
    tensors = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    check_tensor(names[0], tensors[0], ndim=1, dtypes=FLOAT_DTYPES)
    for name, t in zip(names[1:], tensors[1:]):
        check_tensor(name, t, ndim=1, dtypes=FLOAT_DTYPES, device=tensors[0].device)
        check_shape(name, t, tuple(tensors[0].shape), f"{names[0]} {tuple(tensors[0].shape)}")
    _check_options(beta, loss_type, label_smoothing)
    _check_lengths(chosen_lengths, rejected_lengths, tensors[0])
    pc, pr = policy_chosen_logps.float(), policy_rejected_logps.float()  # [B]
    rc, rr = ref_chosen_logps.detach().float(), ref_rejected_logps.detach().float()  # [B]
    h = (pc - pr) - (rc - rr)  # [B]
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if chosen_lengths is not None:  # TRL: per-token average log-ratios
            h = (pc - rc) / chosen_lengths.float().clamp(min=1.0) - (pr - rr) / rejected_lengths.float().clamp(min=1.0)
        losses = (h - 1 / (2 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1 - beta * h)
    with torch.no_grad():
        chosen = beta * (pc - rc)  # [B]
        rejected = beta * (pr - rr)  # [B]
        metrics = {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).float().mean(),
            "rewards/margins": (chosen - rejected).mean(),
        }
    return losses.mean(), metrics


def fused_linear_dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    average_logprobs: bool = False,
    sft_weight: float = 0.0,
    return_logps: bool = False,
):
    """:func:`dpo_loss` on sequence log-probs computed from the last hidden state without logits.

    The batch holds 2B sequences, the B chosen ones first, then the B rejected ones in the same pair order (TRL's
    layout): padded ``hidden [2B, T, H]``, ``targets``/``mask`` ``[2B, T]``; or packed ``hidden [N, H]``,
    ``targets``/``mask`` ``[N]`` with ``cu_seqlens [2B + 1]``. The sequence log-prob is the masked sum
    ``Σ_t m_t logp_t`` with ``logp = log_softmax((hidden @ weightᵀ + bias) / temperature)[targets]``, computed
    on the unmasked rows only (``linear_logprobs.masked_linear_logprobs``: prompt rows cost nothing, their targets are
    not read, ``-100`` is fine there; one host read of the kept-row count).
    ``ref_chosen_logps`` / ``ref_rejected_logps``: ``[B]`` constants. A sequence's completion length (``ipo``) is
    its number of nonzero mask entries. Metrics: those of :func:`dpo_loss` plus
    ``logps/chosen`` / ``logps/rejected`` (means of the policy's sequence log-probs, as TRL logs them).
    Gradients reach ``hidden``, ``weight`` and ``bias``.

    ``average_logprobs`` (NeMo-RL's ``preference_average_log_probs``): the sequence log-probs of the policy *and*
    of the reference (whose ``ref_*_logps`` are always given as masked sums) are divided by the sequence's
    completion length ``n`` (≥ 1) before the loss; ``ipo`` then uses them as they are (already per token).
    ``sft_weight`` ``w``: adds ``w · mean_i(−π_c,i)``, the chosen responses' negative log-likelihood on the same
    scale (summed, or averaged with ``average_logprobs``; NeMo-RL's ``sft_loss_weight`` with its default
    ``sft_average_log_probs = preference_average_log_probs``). TRL's ``"sft"`` loss term instead averages over all
    chosen tokens of the batch; the two agree when the chosen responses have equal lengths and
    ``average_logprobs`` is on. Metric ``nll_loss`` when ``w > 0``; ``loss`` is then the sum of both terms.
    ``return_logps``: also return the detached ``[2B]`` fp32 summed sequence log-probs of the policy (chosen
    first), on which a reference for later steps can be computed or metrics kept:
    ``(loss, metrics, seq_logps)``.
    """
    if isinstance(sft_weight, bool) or not isinstance(sft_weight, numbers.Real) or not (
            math.isfinite(sft_weight) and sft_weight >= 0):
        raise ValueError(f"sft_weight must be a finite number >= 0, got {sft_weight!r}")
    packed = cu_seqlens is not None
    check_tensor("hidden", hidden, ndim=2 if packed else 3, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES, device=hidden.device)
    check_shape("mask", mask, tuple(hidden.shape[:-1]), "hidden's leading dims")
    check_tensor("targets", targets, device=hidden.device)
    check_shape("targets", targets, tuple(hidden.shape[:-1]), "hidden's leading dims")
    if packed:
        check_tensor("cu_seqlens", cu_seqlens, device=hidden.device)
        check_cu_seqlens(cu_seqlens, hidden.shape[0])
    n_seqs = cu_seqlens.numel() - 1 if packed else hidden.shape[0]
    if n_seqs % 2:
        raise ValueError(f"hidden must hold an even number of sequences (chosen then rejected), got {n_seqs}")
    for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        check_tensor(name, t, ndim=1, dtypes=FLOAT_DTYPES, device=hidden.device)
        check_shape(name, t, (n_seqs // 2,), f"{n_seqs} sequences = {n_seqs // 2} pairs")
    _check_options(beta, loss_type, label_smoothing)
    keep = mask != 0
    logp = masked_linear_logprobs(hidden, weight, targets, keep, bias=bias, temperature=temperature)  # [2B, T] / [N]
    weighted = torch.where(keep, logp * mask.float(), 0.0)
    if packed:
        seq_N = seq_index(cu_seqlens, hidden.shape[0])  # [N]
        zeros = torch.zeros(n_seqs, device=hidden.device, dtype=torch.float32)
        seq_logps = zeros.index_add(0, seq_N, weighted)  # [2B]
        seq_lengths = zeros.index_add(0, seq_N, keep.float())  # [2B]
    else:
        seq_logps = weighted.sum(-1)  # [2B]
        seq_lengths = keep.sum(-1)  # [2B]
    chosen, rejected = seq_logps.chunk(2)  # [B], [B]
    chosen_lengths, rejected_lengths = seq_lengths.chunk(2)  # [B], [B]
    ref_c, ref_r = ref_chosen_logps, ref_rejected_logps
    if average_logprobs:
        n_c, n_r = chosen_lengths.float().clamp(min=1.0), rejected_lengths.float().clamp(min=1.0)  # [B], [B]
        chosen, rejected, ref_c, ref_r = chosen / n_c, rejected / n_r, ref_c.float() / n_c, ref_r.float() / n_r
        chosen_lengths = rejected_lengths = None  # ipo: the log-ratios are per token already
    loss, metrics = dpo_loss(chosen, rejected, ref_c, ref_r, beta=beta, loss_type=loss_type,
                             label_smoothing=label_smoothing, chosen_lengths=chosen_lengths,
                             rejected_lengths=rejected_lengths)
    if sft_weight > 0:
        nll = -chosen.mean()
        loss = loss + sft_weight * nll
        metrics["nll_loss"] = nll.detach()
    metrics["logps/chosen"] = chosen.detach().mean()
    metrics["logps/rejected"] = rejected.detach().mean()
    if return_logps:
        return loss, metrics, seq_logps.detach()
    return loss, metrics
