"""Rollout importance-sampling (IS) correction: per-token weights for the policy-gradient term of ``grpo_loss``.

The sampler (a generation engine, vLLM) may not sample from exactly the distribution the trainer differentiates
(bf16 logits, other kernels, a stale policy). The correction re-weights each token's policy-gradient term by the
ratio of the trainer's old policy to the sampler's, truncated or masked (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"). With the mask ``m``, ``old`` the trainer's log-probs of the
rollout (``π_train_old``) and ``samp`` the sampler's::

    δ_t   = m_t · (old_t − samp_t)                      (0 where m_t = 0)
    log ρ = δ_t                                         token_*    one ratio per token
    log ρ = Σ_t δ_t  for every token of the sequence    sequence_* the product of the token ratios
    truncate:  w = clamp(ρ, c_min, c_max)
    mask:      w = ρ if c_min ≤ ρ ≤ c_max else 0

    seq-mask-tis:  w_t = ρ_t (token ratio, not truncated) if c_min ≤ exp(Σ_t δ_t / max(Σ_t m_t, 1)) ≤ c_max
                   else 0 for every token of the sequence (the geometric-mean sequence ratio decides)

and ``grpo_loss`` uses ``w_t · ℓ^pg_t + β · kl_t`` per token (the KL term is not re-weighted); ``w`` is a constant
(no gradient flows through it). This is TRL's ``vllm_importance_sampling_correction`` (checked against
huggingface/trl ``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._generate_and_score_completions`` for the ratio and
its metrics, ``GRPOTrainer._compute_loss`` for where it multiplies; commit f2cd577, VERSION 1.10.0.dev0):
``vllm_importance_sampling_mode`` / ``_clip_max`` / ``_clip_min``; TRL's ``clip_min=None`` is ``c_min = 0`` here
(the same weights, since ρ > 0). As in TRL, the sequence ratio is the full product (a sum of log-ratios, not GSPO's
length-normalised mean), and a float mask scales the log-ratio (TRL multiplies by the mask).

NeMo-RL's ``truncated_importance_sampling_type`` (NVIDIA-NeMo/RL@7ea279a
``nemo_rl/algorithms/loss/loss_functions.py`` ``ClippedPGLossFn.__call__``, lines 597-664, with
``truncated_importance_sampling_ratio{,_min}`` as ``c_max``, ``c_min``):
- ``"tis"`` (lines 597-616: clamp to [min or 0, max]) is ``token_truncate``: accepted as an alias;
- ``"icepop"`` (lines 617-636: zero where the weight is outside [min, max], keep it inside) is ``token_mask``:
  accepted as an alias;
- ``"seq-mask-tis"`` (lines 637-664: the token weights, not truncated, times the 0/1 keep flag of the sequence's
  geometric-mean ratio ``exp(mean_t(old − samp))``) is its own mode here. NeMo-RL divides by ``Σ m + 1e-8``, this
  by ``max(Σ m, 1)``: equal for every non-empty sequence (1e-8 is below half an fp32 ulp of any count ≥ 1); an empty
  sequence has no token to weigh either way.
With NeMo-RL's ``sequence_level_importance_ratios: true`` its tis / icepop weights are the sequence products:
``sequence_truncate`` / ``sequence_mask`` here.

Metrics (detached fp32 0-d tensors, TRL's names; no host synchronisation):
- ``sampling/sampling_logp_difference/mean``, ``/max``: ``|old − samp|`` over tokens with ``m ≠ 0`` (0 if none);
- ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max``: of ``w`` (after truncation or masking, as TRL),
  over tokens with ``m ≠ 0`` (token modes, seq-mask-tis) or over all B sequences (sequence modes, TRL's flatten of
  ``[B, 1]``);
- ``sampling/is_clipped_fraction``: the fraction of tokens with ``m ≠ 0`` whose ``ρ`` lay outside ``[c_min, c_max]``
  (truncated or masked; in sequence modes and seq-mask-tis every token of such a sequence counts). Not in TRL.

Cost: a few elementwise passes and ``[N]`` fp32 temporaries (4 bytes a token: 4 MB per million tokens, nothing next
to the log-prob kernels' work); the weights ``[N]`` fp32 are kept for the loss's backward.
"""

from __future__ import annotations

import torch

from .names import ROLLOUT_IS_ALIASES

DIFF_NAMES = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
RATIO_NAMES = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
               "sampling/importance_sampling_ratio/max", "sampling/is_clipped_fraction")


def canonical_mode(mode: str) -> str:
    """The mode an alias stands for (``tis`` → ``token_truncate``, ``icepop`` → ``token_mask``)."""
    return ROLLOUT_IS_ALIASES.get(mode, mode)


def needs_sequences(mode: str) -> bool:
    """Whether the mode reduces over sequences (packed input then needs every token's sequence index)."""
    return mode.startswith("seq")


def rollout_is_weights(
    old: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    cap: float,
    low: float,
    sid_N: torch.Tensor | None,
    n_seqs: int,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token weights ``w`` (fp32, ``old``'s shape; None when ``mode == "none"``) and the metrics above.

    ``old``, ``sampling``, ``mask``: padded ``[B, T]`` (``sid_N`` None) or packed ``[N]`` with ``sid_N`` ``[N]``
    the sequence index of every token; ``n_seqs`` is B. ``cap`` and ``low`` are ``c_max`` and ``c_min``.
    Inputs are assumed validated (``grpo_loss`` does it).
    """
    with torch.no_grad():
        valid = mask != 0
        m = mask.float()
        diff = torch.where(valid, old.float() - sampling.float(), 0.0)  # log π_old − log π_sampler, 0 off the mask
        n_valid = valid.sum().float()
        denom = n_valid.clamp(min=1.0)
        abs_diff = diff.abs()
        metrics = {DIFF_NAMES[0]: abs_diff.sum() / denom, DIFF_NAMES[1]: abs_diff.max()}
        if mode == "none":
            return None, metrics
        mode = canonical_mode(mode)
        log_rho = m * diff

        def per_seq(x):  # [B, T] / [N] → [B]: the per-sequence sums of x
            if sid_N is None:
                return x.sum(-1)
            return torch.zeros(n_seqs, device=old.device, dtype=torch.float32).index_add_(0, sid_N, x)

        def spread(x_B):  # [B] → old's shape
            return x_B[:, None].expand_as(m) if sid_N is None else x_B[sid_N]

        if mode.startswith("sequence"):
            w_B, out_B = _bound(torch.exp(per_seq(log_rho)), mode, cap, low)
            w, out = spread(w_B), spread(out_B)
            stats = (w_B.min(), w_B.mean(), w_B.max())
        else:
            if mode == "seq-mask-tis":  # geometric-mean sequence ratio decides; kept tokens keep their own ratio
                geo_B = torch.exp(per_seq(log_rho) / per_seq(m).clamp(min=1.0))  # [B]
                out = spread((geo_B < low) | (geo_B > cap))
                w = torch.where(out, 0.0, torch.exp(log_rho))
            else:
                w, out = _bound(torch.exp(log_rho), mode, cap, low)
            stats = (torch.where(n_valid > 0, torch.where(valid, w, torch.inf).min(), 0.0),
                     torch.where(valid, w, 0.0).sum() / denom, torch.where(valid, w, 0.0).max())
        clipped = (out & valid).sum() / denom
        metrics.update(zip(RATIO_NAMES, (*stats, clipped)))
        return w.contiguous(), metrics


def _bound(rho: torch.Tensor, mode: str, cap: float, low: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, outside)``: ``ρ`` truncated to or masked outside ``[low, cap]``, and where ``ρ`` lay outside."""
    outside = (rho < low) | (rho > cap)
    w = rho.clamp(low, cap) if mode.endswith("truncate") else torch.where(outside, 0.0, rho)
    return w, outside


def off_policy_mask(
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float,
    adv_per_token: bool,
    sid_N: torch.Tensor | None,
    n_seqs: int,
) -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2; trl 1.16 ``GRPOTrainer.get_off_policy_mask``): per token
    ``1`` where ``A ≥ 0`` or the sequence's mean ``Σ_t m (behaviour − sg(logp)) / max(Σ_t m, 1) ≤ threshold``, else 0
    (fp32, ``logp``'s shape); ``behaviour`` is the sampler's log-probs (the old ones without them). A constant weight
    on the policy term, like ``w``; NaN differences count 0, as TRL's ``nan_to_num``."""
    with torch.no_grad():
        m = mask.float()
        kl = m * torch.nan_to_num(behaviour.float() - logp.float(), nan=0.0)
        if sid_N is None:
            avg_B = kl.sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
            low = (avg_B <= threshold)[:, None].expand_as(m)
        else:
            zeros = torch.zeros(n_seqs, device=logp.device, dtype=torch.float32)
            avg_B = zeros.index_add(0, sid_N, kl) / zeros.index_add(0, sid_N, m).clamp(min=1.0)
            low = (avg_B <= threshold)[sid_N]
        if adv_per_token:
            a = adv.float()
        else:
            a = adv.float()[:, None].expand_as(m) if sid_N is None else adv.float()[sid_N]
        return ((a >= 0) | low).float().contiguous()

