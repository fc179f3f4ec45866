"""Options of the GRPO-family losses: :class:`GRPOLossOptions`, the user-facing options of ``grpo_loss`` and
``fused_linear_grpo_loss`` (each validated once, at construction, with a ``ValueError`` that names it), and
:func:`validate`, which checks one call's tensors against them into the :class:`LossCall` the kernels
(``grpo_kernels.py``) and the torch path (``grpo_torch.py``) read. The option values' names are ``names.py``'s; the
math is in ``grpo_loss.py``'s docstring. ``POLICY_TERMS`` are the kernels' policy-term switch, ``POLICY_METRICS``
the metrics each policy term returns.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from .names import (
    CLIPPED_LOSS_TYPES,
    IS_LEVELS,
    KL_ESTIMATORS,
    KL_WEIGHTS,
    LOSS_POLICY,
    LOSS_REDUCTION,
    LOSS_TYPES,
    ROLLOUT_IS_MODES,
)
from .utils import FLOAT_DTYPES, MASK_DTYPES, check_cu_seqlens, check_shape, check_tensor

POLICY_TERMS = ("clipped", "cispo", "cispo_clamp", "sapo")  # the kernels' PG switch, in this order
CLIP_NAMES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
POLICY_METRICS = {"clipped": CLIP_NAMES, "cispo": ("cispo_clip_ratio",), "cispo_clamp": CLIP_NAMES, "sapo": ()}
# the fields held as floats (validated numbers of any real type, then converted)
FLOAT_FIELDS = ("beta", "epsilon_low", "epsilon_high", "delta", "dual_clip_c", "rollout_is_cap", "rollout_is_min",
                "kl_input_clamp", "kl_output_clamp", "sapo_temperature_pos", "sapo_temperature_neg",
                "off_policy_mask_threshold")


def check_scalar(name: str, value, *, low: float | None = None, strict: bool = False, allow_none=True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")


def check_max_completion_length(max_completion_length) -> None:
    """``max_completion_length``: None or a positive int."""
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")


def check_normaliser(loss_type: str, max_completion_length, num_items_in_batch, packed: bool) -> None:
    """The normaliser arguments of the losses that aggregate as GRPO's (``loss_type`` grpo / bnpo / dr_grpo / dapo):
    ``max_completion_length`` a positive int (required for packed dr_grpo), ``num_items_in_batch`` a number ≥ 0 or a
    one-element tensor."""
    check_max_completion_length(max_completion_length)
    if loss_type == "dr_grpo" and packed and max_completion_length is None:
        raise ValueError("max_completion_length is required for loss_type='dr_grpo' with packed input "
                         "(padded input defaults it to T)")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one value, got shape {tuple(num_items_in_batch.shape)}")
    else:
        check_scalar("num_items_in_batch", num_items_in_batch, low=0.0)


@dataclass(frozen=True)
class GRPOLossOptions:
    """The options of ``grpo_loss`` and ``fused_linear_grpo_loss`` (their keywords of the same names and defaults;
    pass one as ``options=``). Frozen and validated at construction: a bad value raises a ``ValueError`` naming its
    field. The numbers are held as floats. Notation of ``grpo_loss.py``'s docstring: ratio ``r``, advantage ``A``,
    per-token policy term ``ℓ``.

    - ``loss_type``: one of ``LOSS_TYPES`` (grpo, bnpo, dr_grpo, dapo, luspo: the clipped term; sapo; cispo;
      cispo_clamp); it picks the policy term and the normalisation (``names.LOSS_POLICY``, ``LOSS_REDUCTION``).
    - ``beta``: β, finite, the weight of the per-token KL term ``β·kl``; β ≠ 0 needs ``ref_logprobs``.
    - ``epsilon_low``: ε_low ≥ 0, the lower clip bound ``1 − ε_low`` of r (clipped types, cispo_clamp).
    - ``epsilon_high``: ε_high ≥ 0, the upper clip bound ``1 + ε_high``; cispo's absolute cap ``min(r, ε_high)``
      (TRL recommends 5.0). None: ε_low (``eps_high``).
    - ``delta``: δ > 1 + ε_high, caps r at δ in the unclipped branch ``min(r, δ)·A`` (clipped types only).
    - ``dual_clip_c``: c > 1, the dual clip ``ℓ = min(ℓ, −c·A)`` where A < 0 (clipped types only; NeMo-RL, veRL).
    - ``importance_sampling_level``: ``"token"`` (r per token) or ``"sequence"`` (GSPO: ``r_b = exp(Σ_t m (logp −
      old) / max(Σ_t m, 1))``); cispo and cispo_clamp need ``"token"``.
    - ``max_completion_length``: L, a positive int: dr_grpo's normaliser ``B·L``. None: T of padded input (packed
      dr_grpo needs it); luspo uses 1 whatever it is.
    - ``rollout_is``: one of ``ROLLOUT_IS_MODES`` (none, token_truncate = tis, token_mask = icepop,
      sequence_truncate, sequence_mask, seq-mask-tis): the weight ``ω = π_old / π_sampler`` on the policy term
      (``rollout_is.py``); a mode other than none needs ``sampling_logprobs``.
    - ``rollout_is_cap``, ``rollout_is_min``: ``0 ≤ c_min < c_max``, the bounds of ω (truncated to, or masked
      outside, ``[c_min, c_max]``).
    - ``kl_estimator``: k1 ``−x``, k2 ``x²/2``, k3 ``eˣ − 1 − x`` with ``x = ref − logp``.
    - ``kl_weight``: the factor W on the estimator: none (1), ratio (r), score (``exp(logp − sg(logp))``, value 1),
      sampling_ratio (``exp(logp − sampling_logprobs)``; with β ≠ 0 it needs ``sampling_logprobs``).
    - ``kl_input_clamp``, ``kl_output_clamp``: > 0 or None: x clamped to ``±kl_input_clamp``, ``W·k`` to
      ``±kl_output_clamp`` (NeMo-RL: 20 and 10).
    - ``sapo_temperature_pos``, ``sapo_temperature_neg``: τ > 0 of sapo's ``ℓ = −(4/τ)·σ(τ (r − 1))·A`` for A > 0
      and A ≤ 0.
    - ``off_policy_mask_threshold``: finite δ or None: drops the policy term of a sequence with A < 0 whose mean
      ``sampling_logprobs − logp`` (``old_logprobs − logp`` without them) exceeds δ (TRL's off-policy mask).
    """

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    dual_clip_c: float | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
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

    def __post_init__(self):
        check_scalar("beta", self.beta, allow_none=False)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_weight not in KL_WEIGHTS:
            raise ValueError(f"kl_weight must be one of {KL_WEIGHTS}, got {self.kl_weight!r}")
        check_scalar("kl_input_clamp", self.kl_input_clamp, low=0.0, strict=True)
        check_scalar("kl_output_clamp", self.kl_output_clamp, low=0.0, strict=True)
        if self.rollout_is not in ROLLOUT_IS_MODES:
            raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, got {self.rollout_is!r}")
        check_scalar("rollout_is_min", self.rollout_is_min, low=0.0, allow_none=False)
        check_scalar("rollout_is_cap", self.rollout_is_cap, low=self.rollout_is_min, strict=True, allow_none=False)
        self._check_policy()
        check_max_completion_length(self.max_completion_length)
        check_scalar("off_policy_mask_threshold", self.off_policy_mask_threshold)
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))

    def _check_policy(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        check_scalar("epsilon_low", self.epsilon_low, low=0.0, allow_none=False)
        check_scalar("epsilon_high", self.epsilon_high, low=0.0)
        if self.policy != "clipped":
            for name in ("delta", "dual_clip_c"):
                value = getattr(self, name)
                if value is not None:
                    raise ValueError(f"{name} applies to the clipped loss types ({', '.join(CLIPPED_LOSS_TYPES)}) "
                                     f"only, not loss_type={self.loss_type!r}; got {name}={value!r}")
        if self.policy in ("cispo", "cispo_clamp") and self.importance_sampling_level != "token":
            raise ValueError(f"loss_type={self.loss_type!r} needs importance_sampling_level='token' (CISPO weighs "
                             "each token by its own detached ratio; NeMo-RL asserts the same)")
        check_scalar("delta", self.delta, low=1.0 + self.eps_high, strict=True)
        check_scalar("dual_clip_c", self.dual_clip_c, low=1.0, strict=True)
        check_scalar("sapo_temperature_pos", self.sapo_temperature_pos, low=0.0, strict=True, allow_none=False)
        check_scalar("sapo_temperature_neg", self.sapo_temperature_neg, low=0.0, strict=True, allow_none=False)

    @property
    def eps_high(self) -> float:
        """ε_high as the loss uses it: ``epsilon_high``, or ``epsilon_low`` when that is None."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def seq_level(self) -> bool:
        return self.importance_sampling_level == "sequence"

    @property
    def reduction(self) -> str:
        return LOSS_REDUCTION[self.loss_type]

    @property
    def policy(self) -> str:
        return LOSS_POLICY[self.loss_type]


def resolve_options(options: GRPOLossOptions | None, **keywords) -> GRPOLossOptions:
    """The options of a call given its option ``keywords`` (every field of :class:`GRPOLossOptions`) and its
    ``options``: the keywords' options when ``options`` is None, else ``options``, and then a keyword away from its
    default is a ``ValueError`` that names it (it would be ignored)."""
    if options is None:
        return GRPOLossOptions(**keywords)
    if not isinstance(options, GRPOLossOptions):
        raise ValueError(f"options must be a GRPOLossOptions or None, got {type(options).__name__}")
    for f in dataclasses.fields(GRPOLossOptions):
        value = keywords[f.name]
        if value is not f.default and value != f.default:
            raise ValueError(f"{f.name}={value!r} is given together with options: set {f.name} in the "
                             "GRPOLossOptions instead")
    return options


@dataclass(frozen=True)
class LossCall:
    """One call's options and what its tensors add to them: the kernels' and the torch path's view."""

    options: GRPOLossOptions
    adv_per_token: bool
    n_seqs: int
    max_len: int
    packed: bool
    num_items: float | torch.Tensor | None
    completion_length: int
    """L of the normaliser ``B·L``: ``max_completion_length``, T of padded input without it, 1 for luspo."""


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


def _check_log_probs(o: GRPOLossOptions, ref_logprobs, sampling_logprobs, like, shape, dev) -> None:
    """The optional log-probs: present where the options need them, of the log-probs' shape and device."""
    if o.beta != 0.0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta != 0 (the KL penalty needs the reference log-probs)")
    if ref_logprobs is not None:
        check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("ref_logprobs", ref_logprobs, shape, like)
    if o.kl_weight == "sampling_ratio" and o.beta != 0.0 and sampling_logprobs is None:
        raise ValueError("sampling_logprobs is required for kl_weight='sampling_ratio' (the weight exp(logp − "
                         "sampling_logprobs), NeMo-RL's use_on_policy_kl_approximation)")
    if sampling_logprobs is not None:
        check_tensor("sampling_logprobs", sampling_logprobs, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("sampling_logprobs", sampling_logprobs, shape, like)
    elif o.rollout_is != "none":
        raise ValueError(f"sampling_logprobs is required when rollout_is={o.rollout_is!r} (the sampler's log-probs)")


def validate(logprobs, old_logprobs, advantages, mask, o: GRPOLossOptions, *, ref_logprobs, num_items_in_batch,
             cu_seqlens, per_token_advantages, sampling_logprobs) -> LossCall:
    """Check one call's tensors and per-call arguments against its options ``o``."""
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
    _check_log_probs(o, ref_logprobs, sampling_logprobs, like, logprobs.shape, dev)
    if packed:
        check_tensor("cu_seqlens", cu_seqlens, device=dev)
        check_cu_seqlens(cu_seqlens, logprobs.shape[0])
        n_seqs = cu_seqlens.numel() - 1
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # launch geometry: one read of B + 1 offsets
    else:
        n_seqs, max_len = logprobs.shape
    adv_per_token = _check_advantages(advantages, per_token_advantages, packed, n_seqs, max_len,
                                      logprobs.shape[0], dev)
    check_normaliser(o.loss_type, o.max_completion_length, num_items_in_batch, packed)
    num_items = (num_items_in_batch.to(device=dev, dtype=torch.float32).reshape(())
                 if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch)
    # luspo: Σ m ℓ / B, dr_grpo's normaliser with a length of 1
    completion_length = 1 if o.loss_type == "luspo" else o.max_completion_length or max_len
    return LossCall(options=o, adv_per_token=adv_per_token, n_seqs=n_seqs, max_len=max_len, packed=packed,
                    num_items=num_items, completion_length=completion_length)
