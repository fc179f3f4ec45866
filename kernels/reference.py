"""Plain-torch references for every kernel, optionally upcast to fp32.

These are the specification: tests compare the kernels against them (STYLE.md rule 3: kernel in low precision,
reference in the same precision, reference in fp32), benchmarks use them as the eager baseline. They favour
clarity over memory: ``logprobs_ref`` and ``linear_logprobs_ref`` materialise the full logits.

Shape legend: N packed tokens, B sequences, T padded length, V vocabulary, H hidden size, Hq/Hkv heads, D head dim,
S decode slots, G query heads per kv head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import pad_packed

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


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
    upcast=True,
):
    """GRPO-family loss, written the way TRL 1.16's ``GRPOTrainer._compute_loss`` computes it.

    Padded inputs are ``[B, T]`` with ``mask`` ``[B, T]``; packed inputs are ``[N]`` with ``cu_seqlens``
    ``[B + 1]`` and are padded here first. ``advantages`` is ``[B]`` (one per sequence) or per token.

    With ``r = exp(logp − old)`` per token (``importance_sampling_level="token"``) or
    ``r_b = exp(Σ_t m (logp − old) / max(Σ_t m, 1))`` per sequence (``"sequence"``, GSPO)::

        r1   = min(r, delta)                    if delta is given (TRL's two-sided clipping)
        r2   = clamp(r, 1 − ε_low, 1 + ε_high)  (ε_high defaults to ε_low)
        ℓ    = −min(r1 · A, r2 · A)
        ℓ    = min(ℓ, −c · A) where A < 0       if dual_clip_c = c is given (NeMo-RL / veRL dual clip)
        ℓ   += β · (exp(ref − logp) − (ref − logp) − 1)   (k3 estimator) if β ≠ 0

    Reductions over the mask ``m``:
        grpo     mean_b [ Σ_t m ℓ / max(Σ_t m, 1) ]
        bnpo     Σ m ℓ / max(Σ m, 1)
        dr_grpo  Σ m ℓ / (B · max_completion_length)      (max_completion_length defaults to T)
        dapo     Σ m ℓ / max(num_items_in_batch, 1)        (num_items_in_batch defaults to Σ m)

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
    ``delta`` clamp.
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
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if dual_clip_c is not None:
        per_token_loss = torch.where(adv < 0, torch.min(per_token_loss, -dual_clip_c * adv), per_token_loss)
    if rollout_is != "none":
        is_ratio, is_outside = _rollout_is_ratio_ref(old.detach().float(), sampling_logprobs.float(), m.float(),
                                                     rollout_is, rollout_is_cap, rollout_is_min)
        per_token_loss = per_token_loss * is_ratio.to(per_token_loss.dtype)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + beta * per_token_kl

    B, T = logp.shape
    if loss_type == "grpo":
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * m).sum() / (B * (max_completion_length or T))
    elif loss_type == "dapo":
        normalizer = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype)
        loss = (per_token_loss * m).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")

    def masked_mean(x):
        if x.shape[1] == 1:  # sequence level: one value per sequence
            return x.mean()
        return (x * m).sum() / m.sum().clamp(min=1.0)

    with torch.no_grad():
        is_low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).float()
        is_high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).float()
        metrics = {
            "clip_ratio/low_mean": masked_mean(is_low),
            "clip_ratio/high_mean": masked_mean(is_high),
            "clip_ratio/region_mean": masked_mean(torch.maximum(is_low, is_high)),
        }
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


def _rollout_is_ratio_ref(old, sampling, m, mode, cap, low):
    """TRL's bounded importance ratio ``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes), and where the raw
    ratio lay outside ``[low, cap]``."""
    d = (old - sampling) * m  # [B, T]
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)  # [B, 1]
    ratio = torch.exp(d)
    outside = (ratio < low) | (ratio > cap)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=cap), outside
    if mode.endswith("mask"):
        return ratio.masked_fill(outside, 0.0), outside
    raise ValueError(f"rollout_is must be token_/sequence_ truncate or mask, got {mode!r}")


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
