"""Option checks of ``grpo_loss``: every keyword validated once, with a ``ValueError`` that names it, into the frozen
:class:`Options` the kernels (``grpo_kernels.py``) and the torch path (``grpo_torch.py``) read.

Names of the option values (the math is in ``grpo_loss.py``'s docstring):
- ``LOSS_TYPES``: TRL 1.16's ``loss_type`` values this library computes; ``REDUCTIONS`` gives the normalisation each
  one uses (TRL ``_compute_loss``: sapo reduces as grpo, cispo as dapo), ``POLICY_TERMS`` its per-token policy term.
- ``KL_ESTIMATORS`` k1 / k2 / k3 (Schulman's approximations, NeMo-RL's ``reference_policy_kl_type``);
  ``KL_WEIGHTS`` none / ratio / score / sampling_ratio (the factor on the per-token KL, see ``grpo_loss.py``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .reference import KL_ESTIMATORS, KL_WEIGHTS, LOSS_TYPES
from .rollout_is import MODES as ROLLOUT_IS_MODES
from .rollout_is import canonical_mode
from .utils import FLOAT_DTYPES, check_cu_seqlens, check_shape, check_tensor

LEVELS = ("token", "sequence")
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, *FLOAT_DTYPES)
REDUCTIONS = ("grpo", "bnpo", "dr_grpo", "dapo")  # the finaliser's LOSS_TYPE switch, in this order
# luspo: Σ m ℓ / B, dr_grpo's with max_completion_length 1
LOSS_REDUCTION = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "dapo": "dapo", "luspo": "dr_grpo",
                  "sapo": "grpo", "cispo": "dapo", "cispo_clamp": "dapo"}
POLICY_TERMS = ("clipped", "cispo", "cispo_clamp", "sapo")  # the kernels' PG switch, in this order
CLIP_NAMES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
POLICY_METRICS = {"clipped": CLIP_NAMES, "cispo": ("cispo_clip_ratio",), "cispo_clamp": CLIP_NAMES, "sapo": ()}
LOSS_POLICY = {"grpo": "clipped", "bnpo": "clipped", "dr_grpo": "clipped", "dapo": "clipped", "luspo": "clipped",
               "sapo": "sapo", "cispo": "cispo", "cispo_clamp": "cispo_clamp"}


@dataclass(frozen=True)
class Options:
    """Static options of one call (constexpr switches and scalars of the kernels)."""

    loss_type: str
    seq_level: bool
    adv_per_token: bool
    beta: float
    eps_low: float
    eps_high: float
    delta: float | None
    dual_c: float | None
    max_completion_length: int
    num_items: float | torch.Tensor | None
    n_seqs: int
    max_len: int
    packed: bool
    rollout_is: str = "none"
    rollout_is_cap: float = 3.0
    rollout_is_min: float = 0.0
    kl_estimator: str = "k3"
    kl_weight: str = "ratio"
    kl_input_clamp: float | None = None
    kl_output_clamp: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    off_policy_mask_threshold: float | None = None

    @property
    def reduction(self) -> str:
        return LOSS_REDUCTION[self.loss_type]

    @property
    def policy(self) -> str:
        return LOSS_POLICY[self.loss_type]


def check_scalar(name: str, value, *, low: float | None = None, strict: bool = False, allow_none=True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")


def check_normaliser(loss_type: str, max_completion_length, num_items_in_batch, packed: bool) -> None:
    """The normaliser arguments of the losses that aggregate as GRPO's (``loss_type`` grpo / bnpo / dr_grpo / dapo):
    ``max_completion_length`` a positive int (required for packed dr_grpo), ``num_items_in_batch`` a number ≥ 0 or a
    one-element tensor."""
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    if loss_type == "dr_grpo" and packed and max_completion_length is None:
        raise ValueError("max_completion_length is required for loss_type='dr_grpo' with packed input "
                         "(padded input defaults it to T)")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one value, got shape {tuple(num_items_in_batch.shape)}")
    else:
        check_scalar("num_items_in_batch", num_items_in_batch, low=0.0)


def _check_advantages(advantages, per_token_advantages, packed, n_seqs, max_len, n_tok, dev) -> bool:
    """Whether the advantages are per token (else per sequence)."""
    check_tensor("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES, device=dev)
    if per_token_advantages is not None and not isinstance(per_token_advantages, bool):
        raise ValueError(f"per_token_advantages must be None, True or False, got {per_token_advantages!r}")
    if packed:
        if advantages.dim() != 1 or advantages.shape[0] not in (n_seqs, n_tok):
            raise ValueError(f"advantages must be [B={n_seqs}] or [N={n_tok}] for packed input, "
                             f"got {tuple(advantages.shape)}")
        adv_per_token = advantages.shape[0] == n_tok and n_tok != n_seqs
        if per_token_advantages is not None:
            expected = n_tok if per_token_advantages else n_seqs
            if advantages.shape[0] != expected:
                raise ValueError(f"advantages has {advantages.shape[0]} values, per_token_advantages="
                                 f"{per_token_advantages} expects {expected}")
            adv_per_token = per_token_advantages
        return adv_per_token
    if advantages.shape in ((n_seqs,), (n_seqs, 1)):
        adv_per_token = False
    elif advantages.shape == (n_seqs, max_len):
        adv_per_token = True
    else:
        raise ValueError(f"advantages must be [B], [B, 1] or [B, T] with B, T = {n_seqs}, {max_len}, "
                         f"got {tuple(advantages.shape)}")
    if per_token_advantages is not None and per_token_advantages != adv_per_token:
        raise ValueError(f"per_token_advantages={per_token_advantages} contradicts advantages of shape "
                         f"{tuple(advantages.shape)}")
    return adv_per_token


def _check_kl(beta, ref_logprobs, kl_estimator, kl_weight, kl_input_clamp, kl_output_clamp, sampling_logprobs,
              like, shape, dev) -> None:
    check_scalar("beta", beta, allow_none=False)
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta != 0 (the KL penalty needs the reference log-probs)")
    if ref_logprobs is not None:
        check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("ref_logprobs", ref_logprobs, shape, like)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if kl_weight not in KL_WEIGHTS:
        raise ValueError(f"kl_weight must be one of {KL_WEIGHTS}, got {kl_weight!r}")
    if kl_weight == "sampling_ratio" and beta != 0.0 and sampling_logprobs is None:
        raise ValueError("sampling_logprobs is required for kl_weight='sampling_ratio' (the weight exp(logp − "
                         "sampling_logprobs), NeMo-RL's use_on_policy_kl_approximation)")
    check_scalar("kl_input_clamp", kl_input_clamp, low=0.0, strict=True)
    check_scalar("kl_output_clamp", kl_output_clamp, low=0.0, strict=True)


def _check_policy(loss_type, importance_sampling_level, epsilon_low, epsilon_high, delta, dual_clip_c,
                  sapo_temperature_pos, sapo_temperature_neg) -> float:
    """The policy-term options; returns ε_high (defaulting to ε_low)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}")
    check_scalar("epsilon_low", epsilon_low, low=0.0, allow_none=False)
    check_scalar("epsilon_high", epsilon_high, low=0.0)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    policy = LOSS_POLICY[loss_type]
    if policy != "clipped":
        for name, value in (("delta", delta), ("dual_clip_c", dual_clip_c)):
            if value is not None:
                raise ValueError(f"{name} applies to the clipped loss types (grpo, bnpo, dr_grpo, dapo, luspo) only, "
                                 f"not loss_type={loss_type!r}; got {name}={value!r}")
    if policy in ("cispo", "cispo_clamp") and importance_sampling_level != "token":
        raise ValueError(f"loss_type={loss_type!r} needs importance_sampling_level='token' (CISPO weighs each "
                         "token by its own detached ratio; NeMo-RL asserts the same)")
    check_scalar("delta", delta, low=1.0 + eps_high, strict=True)
    check_scalar("dual_clip_c", dual_clip_c, low=1.0, strict=True)
    check_scalar("sapo_temperature_pos", sapo_temperature_pos, low=0.0, strict=True, allow_none=False)
    check_scalar("sapo_temperature_neg", sapo_temperature_neg, low=0.0, strict=True, allow_none=False)
    return eps_high


def validate(logprobs, old_logprobs, advantages, mask, *, ref_logprobs, beta, epsilon_low, epsilon_high, delta,
             dual_clip_c, loss_type, importance_sampling_level, max_completion_length, num_items_in_batch,
             cu_seqlens, per_token_advantages, sampling_logprobs, rollout_is, rollout_is_cap, rollout_is_min,
             kl_estimator, kl_weight, kl_input_clamp, kl_output_clamp, sapo_temperature_pos,
             sapo_temperature_neg, off_policy_mask_threshold) -> Options:
    check_tensor("logprobs", logprobs, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    dev = logprobs.device
    packed = cu_seqlens is not None
    if packed and logprobs.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [N] when cu_seqlens is given (packed), got {tuple(logprobs.shape)}")
    if not packed and logprobs.dim() != 2:
        raise ValueError(f"logprobs must be 2-D [B, T] (padded), or 1-D [N] with cu_seqlens, "
                         f"got {tuple(logprobs.shape)}")
    like = f"logprobs {tuple(logprobs.shape)}"
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES, device=dev)
    check_shape("old_logprobs", old_logprobs, logprobs.shape, like)
    check_tensor("mask", mask, dtypes=MASK_DTYPES, device=dev)
    check_shape("mask", mask, logprobs.shape, like)
    _check_kl(beta, ref_logprobs, kl_estimator, kl_weight, kl_input_clamp, kl_output_clamp, sampling_logprobs,
              like, logprobs.shape, dev)
    if rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, got {rollout_is!r}")
    if sampling_logprobs is not None:
        check_tensor("sampling_logprobs", sampling_logprobs, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("sampling_logprobs", sampling_logprobs, logprobs.shape, like)
    elif rollout_is != "none":
        raise ValueError(f"sampling_logprobs is required when rollout_is={rollout_is!r} (the sampler's log-probs)")
    check_scalar("rollout_is_min", rollout_is_min, low=0.0, allow_none=False)
    check_scalar("rollout_is_cap", rollout_is_cap, low=rollout_is_min, strict=True, allow_none=False)
    if packed:
        check_tensor("cu_seqlens", cu_seqlens, device=dev)
        check_cu_seqlens(cu_seqlens, logprobs.shape[0])
        n_seqs = cu_seqlens.numel() - 1
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # launch geometry: one read of B + 1 offsets
    else:
        n_seqs, max_len = logprobs.shape
    adv_per_token = _check_advantages(advantages, per_token_advantages, packed, n_seqs, max_len,
                                      logprobs.shape[0], dev)
    eps_high = _check_policy(loss_type, importance_sampling_level, epsilon_low, epsilon_high, delta, dual_clip_c,
                             sapo_temperature_pos, sapo_temperature_neg)
    check_normaliser(loss_type, max_completion_length, num_items_in_batch, packed)
    check_scalar("off_policy_mask_threshold", off_policy_mask_threshold)
    if loss_type == "luspo":  # Σ m ℓ / B: dr_grpo's normaliser with a length of 1
        max_completion_length = 1
    num_items = (num_items_in_batch.to(device=dev, dtype=torch.float32).reshape(())
                 if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch)
    return Options(
        loss_type=loss_type, seq_level=importance_sampling_level == "sequence", adv_per_token=adv_per_token,
        beta=float(beta), eps_low=float(epsilon_low), eps_high=float(eps_high),
        delta=None if delta is None else float(delta), dual_c=None if dual_clip_c is None else float(dual_clip_c),
        max_completion_length=max_completion_length or max_len, num_items=num_items, n_seqs=n_seqs,
        max_len=max_len, packed=packed, rollout_is=canonical_mode(rollout_is), rollout_is_cap=float(rollout_is_cap),
        rollout_is_min=float(rollout_is_min), kl_estimator=kl_estimator, kl_weight=kl_weight,
        kl_input_clamp=None if kl_input_clamp is None else float(kl_input_clamp),
        kl_output_clamp=None if kl_output_clamp is None else float(kl_output_clamp),
        sapo_temperature_pos=float(sapo_temperature_pos), sapo_temperature_neg=float(sapo_temperature_neg),
        off_policy_mask_threshold=None if off_policy_mask_threshold is None else float(off_policy_mask_threshold),
    )
