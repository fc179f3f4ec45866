"""Group advantages and the per-completion reward transforms (reward scaling, overlong shaping).

Advantages (one per completion, G completions per prompt, rewards ``r``)::

    baseline  b_i = mean_j r_j                      ("mean", GRPO / TRL)
              b_i = (Σ_j r_j − r_i) / (G − 1)         ("leave_one_out", RLOO / NeMo-RL)
    A_i = (r_i − b_i) / (σ + ADV_EPS)               σ = std of the group ("group"), of the whole batch over all
                                                    ranks ("batch"), or no division ("none"); std is unbiased
    A_i = (r_i − b_i) / (σ_−i + LOO_STD_EPS)  if σ_−i > 0, else r_i − b_i        ("group_loo", leave_one_out only)
                                                    σ_−i = unbiased std of the other G − 1 rewards of the group

With "group", σ is the std of all G rewards of the group, r_i included, also under "leave_one_out". Since
r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean_j r_j), leave-one-out with group scaling equals the mean baseline times
G/(G−1) (8/7 for G = 8). "group_loo" is NeMo-RL's normalisation (``use_leave_one_out_baseline: true``,
``normalize_rewards: true``): a different σ_−i per completion, and no division where it is 0 (NVIDIA-NeMo/RL
@7ea279a, ``nemo_rl/algorithms/utils.py`` ``calculate_baseline_and_std_per_prompt`` and
``nemo_rl/algorithms/advantage_estimator.py`` ``GRPOAdvantageEstimator``). With binary rewards, a group with one
correct completion gives that completion A = 1 − 0 = 1 (its others all tie at 0), and the wrong ones
A = −(1/7) / σ_−i with σ_−i = sqrt(1/7) (G = 8). NeMo-RL computes σ_−i in float32 as
sqrt((E_−i[r²] − E_−i[r]²)·k/(k−1)) (k = G − 1); fastgrpo computes it in float64 from the deviations, and exactly 0
where the others tie, so the two agree exactly on 0/1 rewards and up to float32 rounding otherwise.

Only valid completions (``valid_PG``; all of them unless a filter says otherwise) enter b and σ; an invalid one
gets A = 0. A group with at most one valid completion gets b_i = r_i, so A = 0 (NeMo-RL's rule).
"""

from __future__ import annotations

import math

import torch

from fastgrpo.config import RewardScalingConfig

ADV_EPS = 1e-4  # added to the reward std before dividing (TRL's value): a zero-variance group gets A = 0
LOO_STD_EPS = 1e-6  # "group_loo": NeMo-RL's epsilon, added only where the leave-one-out std is > 0


def compute_advantages(rewards_PG: torch.Tensor, baseline: str = "mean", scale: str = "group",
                       batch_std: float | None = None,
                       valid_PG: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[P, G]`` and a ``[P]`` bool mask of groups whose valid rewards are all equal (see module
    docstring).

    ``batch_std``: the std of every reward in the batch (all ranks) for ``scale="batch"``; computed from the valid
    rewards of ``rewards_PG`` when None. ``valid_PG``: bool ``[P, G]``, False for completions left out of the baseline
    and the std (they get A = 0); None: every completion is valid.
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards_PG must be [P, G] with G >= 2, got shape {tuple(rewards_PG.shape)}")
    if valid_PG is not None and (valid_PG.shape != rewards_PG.shape or valid_PG.dtype != torch.bool):
        raise ValueError(f"valid_PG must be a bool tensor of shape {tuple(rewards_PG.shape)}, got "
                         f"{valid_PG.dtype} {tuple(valid_PG.shape)}")
    if scale == "group_loo" and baseline != "leave_one_out":
        raise ValueError(f"scale 'group_loo' needs baseline 'leave_one_out', got {baseline!r}")
    r = rewards_PG.double()
    G = r.shape[1]
    v = torch.ones_like(r) if valid_PG is None else valid_PG.double()  # [P, G] 1 = valid
    n_P1 = v.sum(1, keepdim=True)
    sum_P1 = (r * v).sum(1, keepdim=True)
    if baseline == "mean":
        b = sum_P1 / n_P1.clamp(min=1)  # [P, 1]
    elif baseline == "leave_one_out":
        b = (sum_P1 - r * v) / (n_P1 - v).clamp(min=1)  # [P, G] mean of the other valid rewards
    else:
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    adv = torch.where((v > 0) & (n_P1 > 1), r - b, 0.0)  # ≤ 1 valid in the group: b = r, A = 0
    hi_P = torch.where(v > 0, r, -math.inf).max(1).values
    zero_std_P = hi_P <= torch.where(v > 0, r, math.inf).min(1).values  # also True with no valid reward
    if scale == "group":
        mean_P1 = sum_P1 / n_P1.clamp(min=1)
        var_P1 = (v * (r - mean_P1) ** 2).sum(1, keepdim=True) / (n_P1 - 1).clamp(min=1)
        adv = adv / (var_P1.sqrt() + ADV_EPS)
    elif scale == "batch":
        std = r[v > 0].std() if batch_std is None else torch.tensor(batch_std, dtype=r.dtype)
        adv = adv / (std + ADV_EPS)
    elif scale == "group_loo":
        others_PGG = v[:, None, :] * (1 - torch.eye(G, dtype=r.dtype))  # [P, i, j]: j is a valid other of i
        k_PG = others_PGG.sum(2)
        dev_PGG = (r[:, None, :] - b[:, :, None]) ** 2 * others_PGG
        var_PG = dev_PGG.sum(2) / (k_PG - 1).clamp(min=1)  # unbiased; k ≤ 1 others: no spread, σ = 0
        hi = torch.where(others_PGG > 0, r[:, None, :], -math.inf).max(2).values
        lo = torch.where(others_PGG > 0, r[:, None, :], math.inf).min(2).values
        std_PG = torch.where((k_PG > 1) & (hi > lo), var_PG.sqrt(), 0.0)  # tied others: exactly 0, not rounding
        adv = torch.where(std_PG > 0, adv / (std_PG + LOO_STD_EPS), adv)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch', 'group_loo' or 'none', got {scale!r}")
    return adv.float(), zero_std_P


def scale_rewards(rewards: list[float], cfg: RewardScalingConfig) -> list[float]:
    """NeMo-RL's reward_scaling (``nemo_rl/algorithms/grpo.py`` ``scale_rewards`` at 7ea279a): each reward clamped to
    [source_min, source_max], then mapped linearly onto [target_min, target_max]; unchanged when disabled."""
    if not cfg.enabled:
        return list(rewards)
    lo, hi, a, b = cfg.source_min, cfg.source_max, cfg.target_min, cfg.target_max
    return [a + (min(max(r, lo), hi) - lo) / (hi - lo) * (b - a) for r in rewards]


def overlong_penalty(length: int, max_response_length: int, buffer: int, penalty: float) -> float:
    """DAPO's overlong reward shaping of a completion of ``length`` tokens, as NeMo-RL computes it
    (``nemo_rl/algorithms/reward_functions.py`` ``apply_reward_shaping`` at 7ea279a)::

        R(L) = min(-(L - (L_max - B)) / B · p, 0)        L_max = max_response_length, B = buffer, p = penalty

    0 up to L_max − B tokens, then linear down to −p at L = L_max. Past L_max it keeps the slope, as NeMo-RL's; the
    DAPO paper's Eq. 13 and TRL's ``get_soft_overlong_punishment`` (p = 1) hold −1 there instead: the two agree for
    L ≤ L_max, which is every completion when L_max is the response limit (the default, 0 in the config).
    """
    return min(-(length - (max_response_length - buffer)) / buffer * penalty, 0.0)
