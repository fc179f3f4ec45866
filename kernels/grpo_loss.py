"""GRPO-family policy loss (grpo, bnpo, dr_grpo, dapo, luspo, sapo, cispo, cispo_clamp; GSPO's sequence level) with the
KL options of TRL and NeMo-RL, in one Triton pass each way.

Files: this one (the math, the autograd function, the API); ``grpo_options.py`` (:class:`GRPOLossOptions`, the
input checks); ``grpo_kernels.py`` (the Triton kernels and launchers); ``grpo_torch.py`` (the plain-torch path);
``rollout_is.py`` (rollout IS weights); ``names.py`` (the option values' names).
``kernels/reference.py::grpo_loss_ref`` (TRL 1.16 ``GRPOTrainer._compute_loss``) and ``clipped_pg_loss_nemo_ref``
(NeMo-RL ``ClippedPGLossFn``) are the specs.

Math. Mask ``m``, advantage ``A``, importance ratio ``r = exp(logp − old)`` per token (``importance_sampling_level=
"token"``) or ``r_b = exp(Σ_t m (logp − old) / max(Σ_t m, 1))`` per sequence (``"sequence"``, GSPO); ``sg`` stops
the gradient. The policy term ``ℓ`` per token, by ``loss_type``::

    grpo / bnpo / dr_grpo / dapo / luspo (clipped, TRL):
        r1 = min(r, δ) (delta given)    r2 = clamp(r, 1 − ε_low, 1 + ε_high)
        ℓ  = −min(r1·A, r2·A);  ℓ = min(ℓ, −c·A) where A < 0   (dual_clip_c = c, NeMo-RL / veRL)
    cispo (TRL):          ℓ = −sg(min(r, ε_high)) · A · logp    (ε_high an absolute cap; TRL recommends 5.0)
    cispo_clamp (NeMo-RL use_cispo): ℓ = −sg(clamp(r, 1 − ε_low, 1 + ε_high)) · A · logp
    sapo (TRL):           ℓ = −(4/τ) · σ(τ (r − 1)) · A,  τ = sapo_temperature_pos if A > 0 else _neg

then ``ℓ = ω·ℓ`` with the rollout IS weight ω (a constant, ``rollout_is.py``; rollout_is ≠ none; times TRL's off-policy
sequence mask when ``off_policy_mask_threshold`` is given), and with β ≠ 0
``ℓ += β·kl``, the KL term (NeMo-RL's ``calculate_kl``; TRL's is the special case k3, no clamps)::

    x  = ref − logp, clamped to ±kl_input_clamp when given (NeMo-RL: 20)
    k  = −x (k1) | x²/2 (k2) | eˣ − 1 − x (k3)
    W  = 1 (kl_weight "none": TRL use_bias_correction_kl=False)
       | r, the policy ratio above, token or sequence (kl_weight "ratio", the default: TRL 1.16's default
         use_bias_correction_kl=True, ``per_token_kl * coef_1``)
       | exp(logp − sg(logp)) (kl_weight "score": NeMo-RL's default, value 1)
       | exp(logp − sampling_logprobs) (kl_weight "sampling_ratio": NeMo-RL use_on_policy_kl_approximation)
    kl = clamp(W · k, ±kl_output_clamp) when given (NeMo-RL: 10)

Gradient of the KL term per token (``x`` inside the input clamp and ``|W·k|`` inside the output clamp; 0 where a
clamp fires, NeMo-RL detaching the weight there as it does at 7ea279a)::

    ∂kl/∂logp = (∂W/∂logp)·k − W·k'(x),   k'(x) = −1 | x | eˣ − 1
    none:  −k'(x)   (k3: 1 − e^(ref − logp), the derivative of plain k3)
    score: k − k'(x) (k3: logp − ref, the score-function gradient of KL(π‖π_ref) for samples from π)
    ratio: r·(k − k'(x)) at the token level (on-policy r = 1: score's); at the sequence level ``−r_b·k'(x)`` on the
           token plus ``r_b·k`` through ``log r_b``, spread over the sequence like the policy term's

Reductions (sapo reduces as grpo, cispo and cispo_clamp as dapo, as in TRL)::

    grpo    mean_b Σ_t m ℓ / max(Σ_t m, 1)      bnpo  Σ m ℓ / max(Σ m, 1)
    dr_grpo Σ m ℓ / (B · max_completion_length)  dapo  Σ m ℓ / max(num_items_in_batch or Σ m, 1)
    luspo   Σ m ℓ / B

so the loss is ``Σ_{b,t} w_b m_t ℓ_t`` with one weight ``w_b`` per sequence, and its gradient w.r.t. ``logp`` is
elementwise once ``w_b`` is known (at the sequence level, plus a per-sequence sum ``S_b = Σ_t m ∂ℓ_t/∂log r_b``
spread back over the tokens with weight ``m_t / max(Σ_t m, 1)``). Gradients of ``min`` and ``clamp`` follow torch's
autograd exactly: a tie in ``min`` sends half the gradient to each side, ``clamp`` passes it on its closed range.

Memory: per token only the inputs (fp32 log-probs, 4 bytes each of logp, old, ref, sampler, + the fp32 IS weight);
backward saves them and three ``[B]`` fp32 vectors, never a per-token temporary of autograd. At the DeepScaleR scale
(64 sequences of ≤ 24K tokens per optimizer step, micro-batches of 32K tokens) that is ≤ 640 KB per micro-batch.

Departures: where ``mask == 0`` the log-ratio and ``ref − logp`` are taken as 0 before ``exp``, so garbage (±inf) in
padding cannot turn into NaN through ``0 · inf``; on finite inputs the numbers are the same. NeMo-RL's
``nan_to_num`` of its weights is not applied (a NaN log-prob is a bug to surface, not to zero).
"""

from __future__ import annotations

import torch

from .grpo_kernels import triton_backward, triton_forward
from .grpo_options import POLICY_METRICS, GRPOLossOptions, LossCall, resolve_options, validate
from .grpo_torch import torch_backward, torch_forward
from .rollout_is import needs_sequences, off_policy_mask, rollout_is_weights
from .utils import seq_index, use_triton

__all__ = ["grpo_loss"]


class _GRPOLossFunction(torch.autograd.Function):
    """``seq`` is ``cu_seqlens`` on the Triton path, the packed tokens' sequence ids on the torch path (None when
    padded); ``isw`` the rollout IS weights (None: off); ``samp`` the sampler's log-probs (only for the KL weight
    ``sampling_ratio``). Both paths save only the inputs and three ``[B]`` vectors for backward."""

    @staticmethod
    def forward(ctx, logp, old, ref, samp, adv, mask, isw, seq, c: LossCall, triton_path: bool):
        fwd = triton_forward if triton_path else torch_forward
        loss, metrics, wseq, gseq, rseq = fwd(logp, old, ref, samp, adv, mask, isw, seq, c)
        ctx.save_for_backward(logp, old, ref, samp, adv, mask, isw, seq, wseq, gseq, rseq)
        ctx.call, ctx.triton_path = c, triton_path
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        logp, old, ref, samp, adv, mask, isw, seq, wseq, gseq, rseq = ctx.saved_tensors
        grad = grad_loss.to(torch.float32).contiguous()
        bwd = triton_backward if ctx.triton_path else torch_backward
        dlogp = bwd(grad, logp, old, ref, samp, adv, mask, isw, seq, wseq, gseq, rseq, ctx.call)
        return dlogp, None, None, None, None, None, None, None, None, None


def _metric_names(o: GRPOLossOptions) -> dict[str, int]:
    """The returned metrics and their rows of the kernels' metrics vector (kl, low, high, region)."""
    names = {"kl": 0} if o.beta != 0.0 else {}
    if o.policy == "cispo":
        names["cispo_clip_ratio"] = 2  # its (high) flag
    else:
        names.update((name, i + 1) for i, name in enumerate(POLICY_METRICS[o.policy]))
    return names


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-family loss and TRL's metrics; the math is in the module docstring.

    Inputs: padded ``logprobs``/``old_logprobs``/``ref_logprobs``/``mask`` ``[B, T]``, or packed ``[N]`` with
    ``cu_seqlens`` ``[B + 1]`` int32 (same results). ``mask`` is bool, integer or float (float values weigh
    tokens, as TRL's multiply does). ``advantages``: ``[B]`` (or ``[B, 1]``) per sequence, ``[B, T]`` / ``[N]``
    per token. Packed 1-D advantages of length N are per token unless N == B; then they are per sequence (the
    reference's rule) unless ``per_token_advantages=True`` says otherwise. Only ``logprobs`` receives a gradient:
    ``old_logprobs``, ``ref_logprobs``, ``sampling_logprobs`` and ``advantages`` are constants.

    With the defaults (``kl_estimator="k3"``, ``kl_weight="ratio"``, no KL clamps) the numbers are TRL 1.16's with its
    defaults (``use_bias_correction_kl=True``); ``kl_weight="none"`` gives TRL's ``use_bias_correction_kl=False``.
    NeMo-RL's ``ClippedPGLossFn`` is ``loss_type="dapo"`` (``token_level_loss``) or ``"grpo"`` (sequence level),
    ``kl_weight="score"`` (or ``"sampling_ratio"`` for ``use_on_policy_kl_approximation``), ``kl_input_clamp=20``,
    ``kl_output_clamp=10``; ``cispo_clamp`` is its ``use_cispo``. CISPO needs the token level (NeMo-RL asserts it);
    ``delta`` and ``dual_clip_c`` apply to the clipped loss types only.

    Rollout importance sampling (``kernels/rollout_is.py``; TRL's ``vllm_importance_sampling_*``, NeMo-RL's
    ``truncated_importance_sampling_type``): ``sampling_logprobs`` are the sampler's log-probs of the same tokens;
    ``rollout_is`` one of none, token_truncate (= tis), token_mask (= icepop), sequence_truncate, sequence_mask,
    seq-mask-tis re-weights each token's policy term (not the KL term) by ``π_old / π_sampler`` bounded by
    ``[rollout_is_min, rollout_is_cap]``. With ``sampling_logprobs`` and ``rollout_is="none"`` the loss is unchanged
    and only the ``sampling/sampling_logp_difference`` metrics are added. ``off_policy_mask_threshold`` δ (TRL's,
    DeepSeek-V3.2's off-policy sequence mask) drops the policy term of a sequence with A < 0 whose mean
    ``sampling_logprobs − logp`` (``old_logprobs − logp`` without them) exceeds δ; ``loss_type="luspo"`` is TRL's
    (the clipped term, ``Σ m ℓ / B``).

    ``options``: a :class:`GRPOLossOptions` instead of the option keywords (its fields: every keyword from ``beta``
    on but ``num_items_in_batch``, ``cu_seqlens``, ``per_token_advantages`` and the tensors); an option keyword
    away from its default given with it is a ``ValueError`` that names the keyword.

    Returns ``(loss, metrics)``: loss a 0-d fp32 tensor; metrics detached 0-d fp32 tensors ``kl`` (β ≠ 0: the token
    mean of the weighted, clamped per-token KL, as TRL and NeMo-RL log it), ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (clipped loss types and cispo_clamp; token means over the
    mask; at the sequence level with per-sequence advantages, means over sequences, as TRL), ``cispo_clip_ratio``
    (cispo, TRL's), none for sapo (as TRL), and with ``sampling_logprobs`` the ``sampling/...`` metrics of
    ``rollout_is.py``. No host synchronisation beyond input validation (packed input reads the B + 1 offsets once).
    Non-contiguous inputs are copied.
    """
    o = resolve_options(options, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                        dual_clip_c=dual_clip_c, loss_type=loss_type,
                        importance_sampling_level=importance_sampling_level,
                        max_completion_length=max_completion_length, rollout_is=rollout_is,
                        rollout_is_cap=rollout_is_cap, rollout_is_min=rollout_is_min, kl_estimator=kl_estimator,
                        kl_weight=kl_weight, kl_input_clamp=kl_input_clamp, kl_output_clamp=kl_output_clamp,
                        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                        off_policy_mask_threshold=off_policy_mask_threshold)
    c = validate(logprobs, old_logprobs, advantages, mask, o, ref_logprobs=ref_logprobs,
                 num_items_in_batch=num_items_in_batch, cu_seqlens=cu_seqlens,
                 per_token_advantages=per_token_advantages, sampling_logprobs=sampling_logprobs)
    ref = ref_logprobs.detach().contiguous() if o.beta != 0.0 else None
    samp = sampling_logprobs.detach().contiguous() if o.beta != 0.0 and o.kl_weight == "sampling_ratio" else None
    old = old_logprobs.detach().contiguous()
    adv = advantages.detach().reshape(-1) if not c.adv_per_token else advantages.detach()
    adv = adv.contiguous()
    mask = mask.contiguous()
    logprobs = logprobs.contiguous()
    triton_path = use_triton(logprobs)
    opsm = o.off_policy_mask_threshold is not None
    need_sid = c.packed and (not triton_path or needs_sequences(o.rollout_is) or opsm)
    sid_N = seq_index(cu_seqlens, logprobs.shape[0]) if need_sid else None  # [N], no host sync
    isw, is_metrics = None, {}
    if sampling_logprobs is not None:
        isw, is_metrics = rollout_is_weights(old, sampling_logprobs, mask, mode=o.rollout_is, cap=o.rollout_is_cap,
                                             low=o.rollout_is_min, sid_N=sid_N, n_seqs=c.n_seqs)
    if opsm:  # a constant per-token weight on the policy term, like the IS weight: folded into it
        keep = off_policy_mask(logprobs.detach(), old if sampling_logprobs is None else sampling_logprobs, adv, mask,
                               threshold=o.off_policy_mask_threshold, adv_per_token=c.adv_per_token, sid_N=sid_N,
                               n_seqs=c.n_seqs)
        isw = keep if isw is None else isw * keep
    seq = cu_seqlens.contiguous() if triton_path and c.packed else sid_N
    loss, metrics = _GRPOLossFunction.apply(logprobs, old, ref, samp, adv, mask, isw, seq, c, triton_path)
    return loss, {**{name: metrics[i].detach() for name, i in _metric_names(o).items()}, **is_metrics}
