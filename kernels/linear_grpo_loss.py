"""``fused_linear_grpo_loss``: the GRPO-family loss (:mod:`grpo_loss`) straight from hidden states and the LM head.

``logp = log_softmax((hidden @ weightᵀ + bias) / temperature)[targets]`` comes from ``fused_linear_logprobs`` on the
masked-in rows only (nothing of size N×V in memory, forward or backward); ``grpo_loss`` turns it into the loss, and
its ``dlogp`` feeds the one backward pass over the vocabulary.

Shape legend: B sequences, T padded length, N packed tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch

from .grpo_loss import grpo_loss
from .grpo_options import GRPOLossOptions, resolve_options
from .linear_logprobs import masked_linear_logprobs
from .utils import FLOAT_DTYPES, MASK_DTYPES, check_shape, check_tensor


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_logprobs: bool = False,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    dual_clip_c: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    per_token_advantages: bool | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    rollout_is: str = "none",
    rollout_is_cap: float = 3.0,
    rollout_is_min: float = 0.0,
    kl_estimator: str = "k3",
    kl_weight: str = "ratio",
    kl_input_clamp: float | None = None,
    kl_output_clamp: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    off_policy_mask_threshold: float | None = None,
    options: GRPOLossOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """:func:`grpo_loss` on ``logp = log_softmax((hidden @ weightᵀ + bias) / temperature)[targets]``, no logits.

    ``hidden`` is padded ``[B, T, H]`` (per-token inputs ``[B, T]``) or packed ``[N, H]`` (``[N]`` with
    ``cu_seqlens``); ``weight [V, H]``. The log-probs come from ``fused_linear_logprobs`` (nothing of size N×V in
    memory, forward or backward); the loss's backward hands ``dlogp`` to its one backward pass over the vocabulary.
    Targets at masked-out positions are not read (``-100`` is fine there). With ``return_entropy`` the metrics also
    hold ``entropy``: the masked token mean ``Σ m H / max(Σ m, 1)`` of the same distribution (as TRL logs it;
    detached, no gradient). Other keywords (``options`` too) as :func:`grpo_loss`; gradients reach ``hidden``,
    ``weight``, ``bias``.

    ``old_logprobs=None`` is the on-policy case (one optimizer step per rollout, as TRL's default): the old
    log-probs are the detached ``logp`` themselves (ratio 1; the gradient is that of the clipped surrogate at 1).
    They are then also ``π_old`` of the rollout importance-sampling weight ``exp(logp − sampling_logprobs)``
    (``rollout_is``; TRL computes the same old log-probs with a separate no-grad forward before the update). The KL
    weight ``kl_weight="ratio"`` is then 1 with the gradient of ``"score"`` (TRL's and NeMo-RL's defaults agree
    on-policy).
    ``return_logprobs=True`` returns ``(loss, metrics, logp)`` instead of ``(loss, metrics)``: ``logp`` the detached
    fp32 log-probs (``mask``'s shape, 0 where the mask is 0), e.g. to keep as the old log-probs of later optimizer
    steps or to compare with the sampler's — at no extra cost, from the same single pass over the vocabulary.
    """
    check_tensor("hidden", hidden, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES, device=hidden.device)
    check_shape("mask", mask, tuple(hidden.shape[:-1]), "hidden's leading dims")
    check_tensor("targets", targets, device=hidden.device)
    check_shape("targets", targets, tuple(hidden.shape[:-1]), "hidden's leading dims")
    o = resolve_options(options, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                        dual_clip_c=dual_clip_c, loss_type=loss_type,
                        importance_sampling_level=importance_sampling_level,
                        max_completion_length=max_completion_length, rollout_is=rollout_is,
                        rollout_is_cap=rollout_is_cap, rollout_is_min=rollout_is_min, kl_estimator=kl_estimator,
                        kl_weight=kl_weight, kl_input_clamp=kl_input_clamp, kl_output_clamp=kl_output_clamp,
                        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                        off_policy_mask_threshold=off_policy_mask_threshold)
    keep = mask != 0
    out = masked_linear_logprobs(hidden, weight, targets, keep, bias=bias, temperature=temperature,
                                 return_entropy=return_entropy)
    logp = out[0] if return_entropy else out  # [B, T] or [N] fp32, 0 where masked
    old = logp.detach() if old_logprobs is None else old_logprobs  # None: on-policy, ratio 1
    loss, metrics = grpo_loss(logp, old, advantages, mask, ref_logprobs=ref_logprobs,
                              num_items_in_batch=num_items_in_batch, cu_seqlens=cu_seqlens,
                              per_token_advantages=per_token_advantages, sampling_logprobs=sampling_logprobs, options=o)
    if return_entropy:
        with torch.no_grad():
            m = mask.float()
            metrics["entropy"] = (torch.where(keep, out[1] * m, 0.0)).sum() / m.sum().clamp(min=1.0)
    return (loss, metrics, logp.detach()) if return_logprobs else (loss, metrics)
