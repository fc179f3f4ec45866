"""Plain-torch references for every kernel, optionally upcast to fp32.

These are the specification: tests compare the kernels against them (kernel in low precision,
reference in the same precision, reference in fp32), benchmarks use them as the eager baseline. They favour
clarity over memory: ``logprobs_ref`` and ``linear_logprobs_ref`` materialise the full logits.

Shape legend: N packed tokens, B sequences, T padded length, V vocabulary, H hidden size, Hq/Hkv heads, D head dim,
S decode slots, G query heads per kv head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .names import DPO_LOSS_TYPES, KL_ESTIMATORS, LOSS_TYPES
from .utils import pad_packed

# The sources the GRPO references are written from (read, not copied; line numbers at these versions):
TRL = "trl 1.16.0 (PyPI wheel) trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss"
NEMO_RL = "NVIDIA-NeMo/RL@7ea279a nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn"
NEMO_RL_KL = "NVIDIA-NeMo/RL@7ea279a nemo_rl/algorithms/utils.py calculate_kl"


def _maybe_upcast(t: torch.Tensor | None, upcast: bool) -> torch.Tensor | None:
    return t.float() if (upcast and t is not None and t.is_floating_point()) else t


def logprobs_ref(logits, targets, *, temperature=1.0, return_entropy=False, upcast=True):
    """``logp[i] = z[i, y_i] − logsumexp_v z[i, v]`` with ``z = logits / temperature``.

    Entropy ``H[i] = −Σ_v p[i, v] log p[i, v]`` with ``p = softmax(z)``. Inputs ``[..., V]`` and ``[...]``;
    returns fp32 when ``upcast`` (else the logits' dtype) of shape ``[...]``.
    """
    z = _maybe_upcast(logits, upcast) / temperature  # [..., V]
    logp_all = torch.log_softmax(z, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [...]
    return logp, entropy


def linear_logprobs_ref(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False, upcast=True):
    """``logits = hidden @ weightᵀ (+ bias)``, then :func:`logprobs_ref`. hidden ``[..., H]``, weight ``[V, H]``."""
    h, w, b = (_maybe_upcast(x, upcast) for x in (hidden, weight, bias))
    logits = h @ w.t()  # [..., V]
    if b is not None:
        logits = logits + b
    return logprobs_ref(logits, targets, temperature=temperature, return_entropy=return_entropy, upcast=upcast)


def cross_entropy_ref(hidden, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", upcast=True):
    """SFT loss: ``−logp`` of the targets, averaged over tokens whose target is not ``ignore_index``."""
    keep = targets != ignore_index
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    nll = -linear_logprobs_ref(hidden, weight, safe, bias=bias, upcast=upcast) * keep  # [...]
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / keep.sum().clamp(min=1)


def grpo_loss_ref(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    ref_logprobs=None,
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=None,
    delta=None,
    dual_clip_c=None,
    loss_type="dapo",
    importance_sampling_level="token",
    max_completion_length=None,
    num_items_in_batch=None,
    cu_seqlens=None,
    sampling_logprobs=None,
    rollout_is="none",
    rollout_is_cap=3.0,
    rollout_is_min=0.0,
    kl_estimator="k3",
    kl_weight="ratio",
    kl_input_clamp=None,
    kl_output_clamp=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    off_policy_mask_threshold=None,
    upcast=True,
):
    """GRPO-family loss, written the way TRL 1.16's ``GRPOTrainer._compute_loss`` computes it (``TRL`` above).

    "Equal to TRL" assumes TRL's ``use_bias_correction_kl=True`` (its default) for ``kl_weight="ratio"`` (the default
    here) and ``use_bias_correction_kl=False`` for ``kl_weight="none"``; ``kl_estimator="k3"`` and no KL clamps (TRL
    has neither option); ``vllm_importance_sampling_correction`` on for ``rollout_is`` ≠ none and off for none;
    ``top_entropy_quantile=1``, no entropy bonus; one process and no gradient
    accumulation (TRL's dapo / cispo normaliser is then ``num_items_in_batch``). The other KL options follow NeMo-RL's
    ``calculate_kl`` (``NEMO_RL_KL``), ``cispo_clamp`` NeMo-RL's ``use_cispo``.

    Padded inputs are ``[B, T]`` with ``mask`` ``[B, T]``; packed inputs are ``[N]`` with ``cu_seqlens``
    ``[B + 1]`` and are padded here first. ``advantages`` is ``[B]`` (one per sequence) or per token.

    With ``r = exp(logp − old)`` per token (``importance_sampling_level="token"``) or
    ``r_b = exp(Σ_t m (logp − old) / max(Σ_t m, 1))`` per sequence (``"sequence"``, GSPO)::

        r1   = min(r, delta)                    if delta is given (TRL's two-sided clipping)
        r2   = clamp(r, 1 − ε_low, 1 + ε_high)  (ε_high defaults to ε_low)
        ℓ    = −min(r1 · A, r2 · A)
        ℓ    = min(ℓ, −c · A) where A < 0       if dual_clip_c = c is given (NeMo-RL / veRL dual clip)
        ℓ    = −sg(min(r, ε_high)) · A · logp     cispo (TRL: ε_high an absolute cap, 5.0 recommended)
        ℓ    = −sg(clamp(r, 1 − ε_low, 1 + ε_high)) · A · logp   cispo_clamp (NeMo-RL use_cispo)
        ℓ    = −(4 / τ) · σ(τ (r − 1)) · A, τ = τ_pos if A > 0 else τ_neg   sapo
        ℓ   += β · kl if β ≠ 0, with kl = W · (exp(ref − logp) − (ref − logp) − 1) (k3) and W = r (kl_weight
               "ratio", TRL's use_bias_correction_kl) or 1 ("none"); other estimators, weights and the clamps as
               NeMo-RL's calculate_kl (``_calculate_kl_ref``)

    Reductions over the mask ``m`` (sapo reduces as grpo; cispo and cispo_clamp as dapo):
        grpo     mean_b [ Σ_t m ℓ / max(Σ_t m, 1) ]
        bnpo     Σ m ℓ / max(Σ m, 1)
        dr_grpo  Σ m ℓ / (B · max_completion_length)      (max_completion_length defaults to T)
        dapo     Σ m ℓ / max(num_items_in_batch, 1)        (num_items_in_batch defaults to Σ m)
        luspo    Σ m ℓ / B

    ``off_policy_mask_threshold`` δ (TRL's, DeepSeek-V3.2's off-policy sequence mask): the policy term of sequence
    b is dropped when A < 0 and ``Σ_t m (samp − sg(logp)) / max(Σ_t m, 1) > δ`` (samp: ``sampling_logprobs``, or
    ``old`` without them).

    Rollout importance sampling, as TRL's ``vllm_importance_sampling_*`` (the ratio is computed in
    ``GRPOTrainer._generate_and_score_completions``; ``_compute_loss`` multiplies ``per_token_loss`` by it before
    adding the KL term)::

        d = (old − sampling) · m;  ρ = exp(d) per token (token_*), exp(Σ_t d) per sequence (sequence_*)
        ρ ← clamp(ρ, min, cap) (*_truncate), or ρ ← 0 where ρ < min or ρ > cap (*_mask);  ℓ_pg ← ρ · ℓ_pg

    with metrics ``sampling/sampling_logp_difference/{mean,max}`` of ``|old − sampling|`` over the tokens with
    ``m ≠ 0`` (whenever ``sampling_logprobs`` is given), ``sampling/importance_sampling_ratio/{min,mean,max}`` of
    the bounded ρ over those tokens (token_*) or over all sequences (sequence_*), and ``sampling/is_clipped_fraction``
    (the share of those tokens whose ρ was outside [min, cap]; fastgrpo's, not TRL's).

    Metrics (detached, fp32 scalars): ``kl`` (when β ≠ 0), ``clip_ratio/low_mean`` (r < 1 − ε_low and A < 0),
    ``clip_ratio/high_mean`` (r > 1 + ε_high and A > 0), ``clip_ratio/region_mean`` (either); token means over
    the mask, or means over sequences at the sequence level. As in TRL, ``r`` in the metrics is after the
    ``delta`` clamp, ``kl`` is the mean of the weighted (and clamped) per-token KL, cispo logs ``cispo_clip_ratio``
    (r > ε_high and A > 0) instead of the clip ratios and sapo none of them. cispo_clamp logs the clip ratios of
    its clamp whatever the advantage's sign (``low``: r < 1 − ε_low, ``high``: r > 1 + ε_high).
    """
    if epsilon_high is None:
        epsilon_high = epsilon_low
    if cu_seqlens is not None:
        per_token_adv = advantages.dim() == 1 and advantages.numel() == logprobs.numel() != cu_seqlens.numel() - 1
        logprobs, old_logprobs, mask = (pad_packed(x, cu_seqlens) for x in (logprobs, old_logprobs, mask))
        ref_logprobs = None if ref_logprobs is None else pad_packed(ref_logprobs, cu_seqlens)
        sampling_logprobs = None if sampling_logprobs is None else pad_packed(sampling_logprobs, cu_seqlens)
        if per_token_adv:
            advantages = pad_packed(advantages, cu_seqlens)
    logp, old, ref, adv = (_maybe_upcast(x, upcast) for x in (logprobs, old_logprobs, ref_logprobs, advantages))
    m = mask.to(logp.dtype)  # [B, T]
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)  # [B, 1]

    log_ratio = logp - old  # [B, T]
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    coef_1 = torch.exp(log_w)  # TRL _compute_loss line 3095
    if beta != 0.0:
        if kl_estimator == "k3" and kl_input_clamp is None and kl_output_clamp is None and kl_weight in ("none",
                                                                                                        "ratio"):
            per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1  # TRL lines 3100-3102
            if kl_weight == "ratio":  # use_bias_correction_kl (TRL lines 3104-3105)
                per_token_kl = per_token_kl * coef_1
        else:
            weights = {"none": None, "ratio": coef_1, "score": torch.exp(logp - logp.detach()),
                       "sampling_ratio": None if sampling_logprobs is None else torch.exp(
                           logp - _maybe_upcast(sampling_logprobs, upcast))}[kl_weight]
            per_token_kl = _calculate_kl_ref(logp, ref, kl_estimator, kl_input_clamp, kl_output_clamp, weights)
    if off_policy_mask_threshold is not None:  # TRL get_off_policy_mask, lines 2945-2970 (used at 3068-3081)
        samp_lp = old if sampling_logprobs is None else _maybe_upcast(sampling_logprobs, upcast)
        kl_div = torch.nan_to_num(samp_lp - logp.detach(), nan=0.0)
        avg_seq_kl = (kl_div * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((adv >= 0) | (avg_seq_kl <= off_policy_mask_threshold)).to(dtype=m.dtype)
    if loss_type == "cispo":  # TRL lines 3109-3111
        per_token_loss = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * logp
    elif loss_type == "cispo_clamp":  # NeMo-RL loss_functions.py lines 536-546
        per_token_loss = -adv * coef_1.clamp(1.0 - epsilon_low, 1.0 + epsilon_high).detach() * logp
    elif loss_type == "sapo":  # TRL lines 3121-3124
        temperatures = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * adv
    else:  # TRL lines 3112-3120
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        if dual_clip_c is not None:
            per_token_loss = torch.where(adv < 0, torch.min(per_token_loss, -dual_clip_c * adv), per_token_loss)
    if off_policy_mask_threshold is not None:  # TRL lines 3140-3141
        per_token_loss = per_token_loss * off_policy_mask
    if rollout_is != "none":
        is_ratio, is_outside = _rollout_is_ratio_ref(old.detach().float(), sampling_logprobs.float(), m.float(),
                                                     rollout_is, rollout_is_cap, rollout_is_min)
        per_token_loss = per_token_loss * is_ratio.to(per_token_loss.dtype)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    B, T = logp.shape
    if loss_type in ("grpo", "sapo"):  # TRL lines 3153-3157
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * m).sum() / (B * (max_completion_length or T))
    elif loss_type == "luspo":  # TRL lines 3175-3182
        loss = (per_token_loss * m).sum(-1).mean()
    elif loss_type in ("dapo", "cispo", "cispo_clamp"):
        normalizer = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype)
        loss = (per_token_loss * m).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")

    def masked_mean(x):
        if x.shape[1] == 1:  # sequence level: one value per sequence
            return x.mean()
        return (x * m).sum() / m.sum().clamp(min=1.0)

    with torch.no_grad():
        metrics = {}
        if loss_type == "cispo":  # TRL lines 3284-3286
            metrics["cispo_clip_ratio"] = masked_mean(((coef_1 > epsilon_high) & (adv > 0)).float())
        elif loss_type != "sapo":  # TRL lines 3272-3279; cispo_clamp: its clamp on either side, any sign of A
            any_sign = loss_type == "cispo_clamp"
            is_low = ((coef_1 < 1 - epsilon_low) & ((adv < 0) | any_sign)).float()
            is_high = ((coef_1 > 1 + epsilon_high) & ((adv > 0) | any_sign)).float()
            metrics["clip_ratio/low_mean"] = masked_mean(is_low)
            metrics["clip_ratio/high_mean"] = masked_mean(is_high)
            metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(is_low, is_high))
        if beta != 0.0:
            metrics["kl"] = masked_mean(per_token_kl)
        if sampling_logprobs is not None:
            sel = m != 0
            delta_t = (old.float() - sampling_logprobs.float()).abs()[sel]
            metrics["sampling/sampling_logp_difference/mean"] = delta_t.mean() if delta_t.numel() else m.new_zeros(())
            metrics["sampling/sampling_logp_difference/max"] = delta_t.max() if delta_t.numel() else m.new_zeros(())
        if rollout_is != "none":
            flat = is_ratio.flatten() if rollout_is.startswith("sequence") else is_ratio[sel]
            for stat in ("min", "mean", "max"):
                value = getattr(flat, stat)() if flat.numel() else m.new_zeros(())
                metrics[f"sampling/importance_sampling_ratio/{stat}"] = value
            clipped = is_outside.expand_as(m)[sel].float()
            metrics["sampling/is_clipped_fraction"] = clipped.mean() if clipped.numel() else m.new_zeros(())
    return loss, metrics


def _calculate_kl_ref(logp, ref, kl_type, input_clamp, output_clamp, weights):
    """Per-token KL estimate as NeMo-RL's ``calculate_kl`` (``NEMO_RL_KL``, lines 42-100): ``x = ref − logp``,
    clamped to ±input_clamp (where it is clamped the weight is detached: no gradient at all there); k1 = −x,
    k2 = x²/2, k3 = eˣ − 1 − x; times ``weights`` (None: 1); then clamped to ±output_clamp."""
    logr = ref - logp
    if input_clamp is not None:
        clamped = logr.clamp(min=-input_clamp, max=input_clamp)
        if weights is not None:
            weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = torch.square(logr) / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_type!r}")
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl


def _rollout_is_ratio_ref(old, sampling, m, mode, cap, low):
    """TRL's bounded importance ratio ``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes), and where the raw
    ratio lay outside ``[low, cap]``."""
    mode = {"tis": "token_truncate", "icepop": "token_mask"}.get(mode, mode)  # NeMo-RL's names for TRL's modes
    d = (old - sampling) * m  # [B, T]
    if mode == "seq-mask-tis":  # NeMo-RL loss_functions.py lines 637-664: geometric-mean sequence ratio decides
        geo = torch.exp(d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))  # [B, 1]
        outside = (geo < low) | (geo > cap)
        return torch.exp(d).masked_fill(outside, 0.0), outside
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)  # [B, 1]
    ratio = torch.exp(d)
    outside = (ratio < low) | (ratio > cap)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=cap), outside
    if mode.endswith("mask"):
        return ratio.masked_fill(outside, 0.0), outside
    raise ValueError(f"rollout_is must be token_/sequence_ truncate or mask, got {mode!r}")


def clipped_pg_loss_nemo_ref(
    logprobs,
    prev_logprobs,
    advantages,
    mask,
    *,
    generation_logprobs,
    reference_policy_logprobs=None,
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    kl_input_clamp_value=20.0,
    kl_output_clamp_value=10.0,
    use_on_policy_kl_approximation=False,
    ratio_clip_min=0.2,
    ratio_clip_max=0.2,
    ratio_clip_c=None,
    use_cispo=False,
    use_importance_sampling_correction=False,
    truncated_importance_sampling_type=None,
    truncated_importance_sampling_ratio=None,
    truncated_importance_sampling_ratio_min=None,
    token_level_loss=True,
    global_valid_toks=None,
    global_valid_seqs=None,
):
    """NeMo-RL's ``ClippedPGLossFn`` loss (``NEMO_RL``, ``__call__`` lines 374-790), in fp32, from its formulas.

    Padded ``[B, T]`` inputs, ``mask`` the token mask of the completions (NeMo-RL's ``token_mask`` times
    ``sample_mask``, shifted), ``advantages`` ``[B]`` or ``[B, T]``; the keywords are NeMo-RL's loss_fn keys (its
    defaults: ``ClippedPGLossConfig``, lines 111-164; ``disable_ppo_ratio``, ``force_on_policy_ratio``,
    ``sequence_level_importance_ratios``, ``use_kl_in_reward`` and ``positive_example_nll_weight`` are left out).
    ``global_valid_toks`` / ``_seqs`` default to this batch's counts. Returns the loss (a 0-d tensor)::

        kl_w   = exp(logp − gen) if use_on_policy_kl_approximation else exp(logp − sg(logp))     (lines 482-495)
        kl     = β · calculate_kl(logp, ref, type, in_clamp, out_clamp, kl_w)                      (lines 496-503)
        r      = exp(logp − prev);  r_c = clamp(r, 1 − clip_min, 1 + clip_max)                    (lines 518-543)
        ℓ      = −A · sg(r_c) · logp  if use_cispo  else  max(−A r, −A r_c)                       (lines 545-552)
        ℓ      = min(ℓ, −c A) where A < 0 (ratio_clip_c = c)                                      (lines 553-562)
        w_is   = exp(prev − gen), then tis / icepop / seq-mask-tis on it (lines 564-664), 1 unless
                 use_importance_sampling_correction                                               (lines 673-676)
        loss   = Σ m w_is ℓ / (toks + 1e-8) + Σ m kl / (toks + 1e-8)     token_level_loss         (lines 678-683)
               = Σ_b [Σ_t m w_is ℓ / (Σ_t m + 1e-8)] / (seqs + 1e-8) + the same of kl   otherwise  (lines 684-691)

    (``masked_mean`` divides by the count + 1e-8: ``nemo_rl/algorithms/utils.py`` lines 212-224.)
    """
    logp, prev, gen = logprobs.float(), prev_logprobs.float(), generation_logprobs.float()
    m = mask.float()  # [B, T]
    adv = advantages.float()
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv  # [B, T]
    toks = m.sum() if global_valid_toks is None else torch.as_tensor(float(global_valid_toks))
    seqs = torch.tensor(float(m.shape[0])) if global_valid_seqs is None else torch.as_tensor(float(global_valid_seqs))

    def reduce(x):
        if token_level_loss:
            return (x * m).sum() / (toks + 1e-8)
        return ((x * m).sum(-1) / (m.sum(-1) + 1e-8)).sum() / (seqs + 1e-8)

    if reference_policy_kl_penalty != 0:
        if use_on_policy_kl_approximation:
            kl_w = torch.exp(logp - gen)
        else:
            kl_w = torch.exp(logp - logp.detach())
        kl_w = torch.nan_to_num(kl_w, nan=0.0, posinf=0.0, neginf=0.0)
        kl = reference_policy_kl_penalty * _calculate_kl_ref(
            logp, reference_policy_logprobs.float(), reference_policy_kl_type, kl_input_clamp_value,
            kl_output_clamp_value, kl_w)
        kl = reduce(kl)
    else:
        kl = torch.zeros(())
    ratios = torch.exp(logp - prev)
    ratios_clamped = ratios.clamp(1.0 - ratio_clip_min, 1.0 + ratio_clip_max)
    if use_cispo:
        clip_loss = -adv * ratios_clamped.detach() * logp
    else:
        clip_loss = torch.max(-adv * ratios, -adv * ratios_clamped)
    if ratio_clip_c is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * ratio_clip_c), clip_loss)
    w_is = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    hi, lo = truncated_importance_sampling_ratio, truncated_importance_sampling_ratio_min
    if truncated_importance_sampling_type == "tis":
        w_is = w_is.clamp(min=0.0 if lo is None else lo, max=hi)
    elif truncated_importance_sampling_type == "icepop":
        w_is = torch.where((w_is >= lo) & (w_is <= hi), w_is, torch.zeros_like(w_is))
    elif truncated_importance_sampling_type == "seq-mask-tis":
        log_is = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geo = torch.exp((log_is * m).sum(-1) / (m.sum(-1) + 1e-8))  # [B]
        w_is = w_is * ((geo >= lo) & (geo <= hi)).float()[:, None]
    if not use_importance_sampling_correction:
        w_is = torch.ones_like(prev)
    return reduce(w_is.detach() * clip_loss) + kl


def dpo_loss_ref(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
    chosen_lengths=None,
    rejected_lengths=None,
    upcast=True,
):
    """DPO family on sequence log-probs ``[B]``, as TRL 1.16's ``DPOTrainer`` defines them.

    ``c = π_c − ref_c``, ``r = π_r − ref_r``, ``h = c − r``;
    sigmoid: ``−(1 − ls) log σ(βh) − ls log σ(−βh)`` (``ls > 0``: conservative DPO, which TRL's sigmoid no longer
    applies; ``ls = 0`` is TRL's); ipo: ``(c/n_c − r/n_r − 1/(2β))²`` with ``n`` the completion lengths clamped to
    ≥ 1 (TRL's per-token average), ``(h − 1/(2β))²`` when no lengths are given; hinge: ``relu(1 − βh)``;
    loss = mean over pairs. Metrics: ``rewards/chosen = β(π_c − ref_c)``, ``rewards/rejected = β(π_r − ref_r)``
    (means), ``rewards/accuracies`` (chosen reward > rejected reward), ``rewards/margins`` (mean difference).
    """
    pc, pr, rc, rr = (_maybe_upcast(x, upcast) for x in (policy_chosen_logps, policy_rejected_logps,
                                                         ref_chosen_logps, ref_rejected_logps))
    h = (pc - pr) - (rc - rr)  # [B]
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "ipo":
        if chosen_lengths is not None:
            nc, nr = chosen_lengths.float().clamp(min=1.0), rejected_lengths.float().clamp(min=1.0)
            h = (pc - rc) / nc - (pr - rr) / nr
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    with torch.no_grad():
        chosen_rewards = beta * (pc - rc)
        rejected_rewards = beta * (pr - rr)
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        }
    return losses.mean(), metrics


def varlen_attention_ref(q, k, v, cu_seqlens, *, causal=True, softmax_scale=None, upcast=True):
    """Per-sequence ``softmax(q kᵀ · scale + causal mask) v`` on packed ``[T, H, D]`` tensors.

    GQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``. Returns ``[T, Hq, D]`` (fp32 when upcast).
    """
    q, k, v = (_maybe_upcast(x, upcast) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)  # [Hq, L, D]
        ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
        vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)  # [Hq, L, D]
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)  # [T, Hq, D]


def decode_attention_ref(q, k, v, lengths, *, softmax_scale=None, upcast=True):
    """``softmax(scale · q kᵀ) v`` over each slot's first ``lengths[s]`` keys, by explicit masked scores.

    q ``[S, Hkv, G, D]``, k/v ``[S, Hkv, T, D]``, lengths ``[S]``. Returns ``[S, Hkv, G, D]`` (fp32 when upcast).
    """
    q, k, v = (_maybe_upcast(x, upcast) for x in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    S, T = k.shape[0], k.shape[2]
    live_S11T = (torch.arange(T, device=q.device) < lengths[:, None].long()).view(S, 1, 1, T)
    scores = (q @ k.transpose(-1, -2)) * scale  # [S, Hkv, G, T]
    return torch.softmax(scores.masked_fill(~live_S11T, float("-inf")), dim=-1) @ v


def gumbel_sample_ref(logits, temperature, u):
    """Gumbel-max sampling with given uniforms ``u ~ U[0, 1)`` ``[S, V]``, in fp32.

    ``x = log_softmax(logits / T)``; token = ``argmax(x − log(−log u))`` (distributed as ``softmax(logits / T)``);
    returns ``(token [S] int64, x[token] [S] fp32)``.
    """
    logp_SV = torch.log_softmax(logits.float() / temperature, dim=-1)
    tok_S = (logp_SV - (-u.log()).log()).argmax(dim=-1)
    return tok_S, logp_SV.gather(1, tok_S[:, None]).squeeze(1)


def distill_loss_ref(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    mask,
    *,
    beta=None,
    mixed_kl_weight=None,
    temperature=1.0,
    student_bias=None,
    teacher_bias=None,
    cu_seqlens=None,
    vocab_size=None,
    loss_type="dapo",
    max_completion_length=None,
    num_items_in_batch=None,
    upcast=True,
):
    """Distillation loss on materialised logits (``kernels/distill_loss.py`` states the math).

    ``z = (hidden @ weightᵀ + bias)[..., :vocab_size] / T`` for each model; element-wise ``ls``, ``lt`` (log-softmax)
    and, per token, TRL's generalized JSD (β = 0: ``Σ q (lt − ls)``; β = 1: ``Σ p (ls − lt)``; else
    ``β Σ q (lt − log m) + (1 − β) Σ p (ls − log m)`` with ``log m = logsumexp(lt + log β, ls + log(1 − β))``) or
    NeMo-RL's mixed KL ``w Σ q (lt − ls) + (1 − w) Σ p (ls − lt)``; then the GRPO loss's token aggregations over the
    mask. Packed inputs ``[N, H]`` with ``cu_seqlens`` are padded first. Returns ``(loss, {"divergence": ...})``.
    """
    if cu_seqlens is not None:
        student_hidden, teacher_hidden, mask = (pad_packed(x, cu_seqlens) for x in (student_hidden, teacher_hidden,
                                                                                     mask))
    hs, ws, bs, ht, wt, bt = (_maybe_upcast(x, upcast) for x in (student_hidden, student_weight, student_bias,
                                                                 teacher_hidden, teacher_weight, teacher_bias))
    V = vocab_size or ws.shape[0]

    def logprobs(h, w, b):
        z = h @ w.t() if b is None else h @ w.t() + b  # [B, T, Vrows]
        return torch.log_softmax(z[..., :V] / temperature, dim=-1)  # [B, T, V]

    ls, lt = logprobs(hs, ws, bs), logprobs(ht.detach(), wt.detach(), None if bt is None else bt.detach())
    p, q = ls.exp(), lt.exp()
    if mixed_kl_weight is not None:
        d = mixed_kl_weight * (q * (lt - ls)).sum(-1) + (1 - mixed_kl_weight) * (p * (ls - lt)).sum(-1)  # [B, T]
    elif beta == 0:
        d = (q * (lt - ls)).sum(-1)
    elif beta == 1:
        d = (p * (ls - lt)).sum(-1)
    else:
        b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
        lm = torch.logsumexp(torch.stack([lt + b.log(), ls + (-b).log1p()]), dim=0)  # [B, T, V]
        d = beta * (q * (lt - lm)).sum(-1) + (1 - beta) * (p * (ls - lm)).sum(-1)
    m = mask.to(d.dtype)  # [B, T]
    B, T = m.shape
    if loss_type == "grpo":
        loss = ((d * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (d * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (d * m).sum() / (B * (max_completion_length or T))
    elif loss_type == "dapo":
        normalizer = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype)
        loss = (d * m).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, got {loss_type!r}")
    return loss, {"divergence": ((d * m).sum() / m.sum().clamp(min=1.0)).detach()}
