"""The GRPO algorithm: group advantages, rollout → packed micro-batches, log-prob forwards, the policy update.

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

Sequences (prompt + completion) are packed into micro-batches of at most ``train.max_tokens_per_microbatch``
tokens. At packed position ``t`` the target is token ``t + 1`` of the same sequence; the loss mask is 1 exactly
where the target is a completion token (and the completion is trained on: masked truncated completions and, with
``grpo.mask_zero_std_groups``, zero-variance groups get mask 0).

Rewards, per completion: the reward functions' weighted sum, then ``reward_scaling`` (:func:`scale_rewards`), then
``reward_shaping``'s overlong penalty (:func:`overlong_penalty`); a group has signal when its rewards before shaping
are not all equal. With ``grpo.use_dynamic_sampling`` (DAPO) a step generates batches until
``num_prompts_per_step`` groups with signal exist over all ranks and trains on exactly that many
(:meth:`GRPO.rollout`). Memory: the kept groups of up to ``dynamic_sampling_max_gen_batches`` batches wait on the host
(token ids and log-probs as lists, about 70 bytes a token: 16 completions of 16K tokens are ~18 MB a group); a
group moves between ranks once, pickled (``broadcast_object``). Time: each further batch is a whole generation.

The update of one optimizer step over the micro-batches ``m`` of every rank: each micro-batch's loss is
``fused_linear_grpo_loss`` on its own tokens (straight from the last hidden state and the LM head weight),
re-weighted so that the sum over micro-batches and ranks is the loss of the whole optimizer-step batch; DDP then
averages gradients over ranks, so every loss is also multiplied by ``world_size``::

    dapo      num_items_in_batch = Σ_all m (global completion tokens)     weight 1
    bnpo      per-micro-batch Σ m ℓ / Σ_mb m                              weight Σ_mb m / Σ_all m
    grpo      mean over the micro-batch's sequences                       weight B_mb / B_all
    dr_grpo   Σ m ℓ / (B_mb · L_max)                                      weight B_mb / B_all

so 1 process and W processes on the same global batch give the same loss and gradients (up to float rounding).
A step whose loss or gradient norm is not finite is skipped (no optimizer step) and counted.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from fastgrpo.config import Config, RewardScalingConfig
from fastgrpo.distributed import ForwardWrapper, all_reduce, broadcast_object, print0, reduce_metrics, unwrap_model
from fastgrpo.engine.engine import Completion, SamplingParams
from fastgrpo.kernels.grpo_options import LOSS_POLICY, LOSS_REDUCTION, POLICY_METRICS
from fastgrpo.kernels.linear_grpo_loss import fused_linear_grpo_loss
from fastgrpo.kernels.linear_logprobs import masked_linear_logprobs
from fastgrpo.kernels.rollout_is import DIFF_NAMES, RATIO_NAMES
from fastgrpo.models.attention import packed_hidden_states
from fastgrpo.models.loading import lm_head_params
from fastgrpo.models.lora import adapters_disabled, is_lora
from fastgrpo.models.packing import PackedBatch, pack, plan_microbatches
from fastgrpo.precision import accumulate, optimizer_params, train_mode
from fastgrpo.rewards import RewardResult, add_faults

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


def merge_results(a: RewardResult, b: RewardResult) -> RewardResult:
    """Two generation batches' reward results as one (scores concatenated, fault counts added)."""
    faults = {name: dict(counts) for name, counts in a.faults.items()}
    for name, counts in b.faults.items():
        add_faults(faults.setdefault(name, {}), counts)
    return RewardResult(total=a.total + b.total, per_function={k: v + b.per_function[k] for k, v in
                                                               a.per_function.items()}, faults=faults)


@dataclass
class Group:
    """One prompt's G completions, as the rollout scored them."""

    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float]
    """[G] after reward_scaling and reward_shaping: what the advantages are computed from."""
    signal: bool
    """The rewards before reward_shaping are not all equal (dynamic sampling keeps the group)."""


@dataclass
class Sample:
    """One prompt + completion to train on.

    A multi-turn completion holds the policy's turns and the observations appended between them; ``loss_mask``
    says which tokens the policy sampled. ``token_advantages`` (on-policy distillation's
    ``logp_teacher - logp_student``) adds a per-token term to the trajectory's advantage.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    sample_logprobs: list[float]
    """The generation engine's log-probs of the completion tokens (0 at tokens the policy did not sample)."""
    advantage: float
    train: bool = True
    """False: the completion gets no loss (masked truncated completion, filtered group)."""
    loss_mask: list[int] | None = None
    """Per completion token: 1 where the policy sampled it, 0 where it was appended (observation, template
    suffix). None: every completion token is sampled (single-turn)."""
    token_advantages: list[float] | None = None
    """Per completion token, added to ``advantage`` (None: none)."""

    def __post_init__(self):
        c = len(self.completion_ids)
        for name in ("sample_logprobs", "loss_mask", "token_advantages"):
            v = getattr(self, name)
            if v is not None and len(v) != c:
                raise ValueError(f"Sample.{name} has {len(v)} values for {c} completion tokens")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def completion_loss_mask(self) -> list[int]:
        """Per completion token: 1 where it gets a loss (sampled, and the sample trains)."""
        if not self.train:
            return [0] * len(self.completion_ids)
        return [1] * len(self.completion_ids) if self.loss_mask is None else [int(m != 0) for m in self.loss_mask]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.completion_loss_mask)


@dataclass
class MicroBatch:
    """B packed sequences and their per-token training inputs."""

    batch: PackedBatch
    targets: torch.Tensor  # [N] int64, next token (0 where there is none)
    mask: torch.Tensor  # [N] float, 1 where the target is a trained, policy-sampled completion token
    advantages: torch.Tensor  # [B] float, or [N] when per_token_advantages
    sample_logprobs: torch.Tensor  # [N] float, the engine's log-probs at masked positions (0 elsewhere)
    completion_mask: torch.Tensor  # [N] bool, target is a completion token (trained or not, sampled or appended)
    old_logprobs: torch.Tensor | None = None  # [N]
    ref_logprobs: torch.Tensor | None = None  # [N]
    num_loss_tokens: int = 0
    """Σ mask, counted on the host while packing (no device sync to read it)."""
    per_token_advantages: bool = False
    """``advantages`` is per token ([N], the sequence's advantage plus its token terms; 0 off the mask)."""

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs


def make_microbatch(samples: list[Sample], device: torch.device) -> MicroBatch:
    """Pack ``samples`` into one row with targets, loss mask and advantages.

    Advantages are per sequence (``[B]``) unless a sample has ``token_advantages``; then every token gets
    ``advantage + token_advantages[t]`` (``[N]``, 0 where there is no completion target).
    """
    batch = pack([s.tokens for s in samples])
    per_token = any(s.token_advantages is not None for s in samples)
    targets, mask, comp, slp, adv = [], [], [], [], []
    for s in samples:
        toks, p, c = s.tokens, len(s.prompt_ids), len(s.completion_ids)
        targets += toks[1:] + [0]
        comp += [False] * (p - 1) + [True] * c + [False]
        mask += [0.0] * (p - 1) + [float(m) for m in s.completion_loss_mask] + [0.0]
        slp += [0.0] * (p - 1) + list(s.sample_logprobs) + [0.0]
        if per_token:
            extra = s.token_advantages if s.token_advantages is not None else [0.0] * c
            adv += [0.0] * (p - 1) + [s.advantage + float(x) for x in extra] + [0.0]
        else:
            adv.append(s.advantage)
    return MicroBatch(
        batch=batch.to(device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        mask=torch.tensor(mask, dtype=torch.float32, device=device),
        advantages=torch.tensor(adv, dtype=torch.float32, device=device),
        sample_logprobs=torch.tensor(slp, dtype=torch.float32, device=device),
        completion_mask=torch.tensor(comp, dtype=torch.bool, device=device),
        num_loss_tokens=int(sum(mask)),
        per_token_advantages=per_token,
    )


def plan(samples: list[Sample], max_tokens: int, device: torch.device) -> list[MicroBatch]:
    """Micro-batches of at most ``max_tokens`` tokens (``fastgrpo.models.packing.plan_microbatches``)."""
    groups = plan_microbatches([len(s.tokens) for s in samples], max_tokens)
    return [make_microbatch([samples[i] for i in g], device) for g in groups]


def packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen):
    """The training forward (run as the DDP/FSDP-wrapped model's forward): hidden ``[N, H]``, LM head weight, bias."""
    batch = PackedBatch(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    hidden_NH = packed_hidden_states(model, batch)
    weight_VH, bias_V = lm_head_params(model)
    return hidden_NH, weight_VH, bias_V


def _call(model, mb: MicroBatch):
    b = mb.batch
    return model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)


def _no_grad_forward(model):
    """The module to call for no-grad log-prob forwards: the wrapped model itself, except DDP's ``ForwardWrapper``
    inside it (a forward that backward will never follow must not arm DDP's all-reduce).

    Under FSDP2 the call must go through the wrapped model: its forward gathers the sharded weights (the unwrapped
    model would see sharded root weights), so every rank must make it the same number of times.
    """
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def packed_logprobs(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """``[N]`` log-probs of the targets where ``mb.mask`` is nonzero, 0 elsewhere (no grad).

    ``model``: a module whose call is :func:`packed_forward` (a ``ForwardWrapper``, FSDP2-wrapped or not).
    Untrained positions (prompts, masked completions) cost no vocabulary work.
    """
    hidden_NH, weight_VH, bias_V = _call(model, mb)
    return masked_linear_logprobs(hidden_NH, weight_VH, mb.targets, mb.mask != 0, bias=bias_V,
                                  temperature=temperature)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (FSDP2's total gradient norm) as a plain tensor; other tensors unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class PolicyUpdate:
    """The optimizer steps of one rollout: old / reference log-probs, then the clipped surrogate update."""

    def __init__(self, cfg: Config, model, optimizer, scheduler, ref_model, device: torch.device, world_size: int):
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.ref_forward = ForwardWrapper(ref_model, packed_forward) if ref_model is not None else None
        self.device = device
        self.world_size = world_size
        self.uses_old_logprobs = True
        """The loss has an importance ratio: several optimizer steps per rollout need the old log-probs."""

    def _normaliser(self, mbs: list[MicroBatch]) -> tuple[float, float]:
        """Global (all ranks) loss-token and sequence counts of one optimizer step."""
        local = torch.tensor([float(sum(mb.num_loss_tokens for mb in mbs)), float(sum(mb.num_seqs for mb in mbs))],
                             dtype=torch.float64, device=self.device)
        tokens, seqs = all_reduce(local).tolist()  # sync: the loss normalisers are host floats
        return tokens, seqs

    def run(self, samples: list[Sample], *, beta: float, epsilon_high: float | None,
            max_new_tokens: int) -> dict[str, float]:
        """All optimizer steps over this rank's ``samples``; returns local metrics (means over micro-batches)."""
        cfg = self.cfg
        temperature = cfg.rollout.temperature
        per_rank = len(samples)
        if cfg.train.sequences_per_optimizer_step:
            chunk = cfg.train.sequences_per_optimizer_step // self.world_size
        else:
            chunk = per_rank
        steps = [samples[i : i + chunk] for i in range(0, per_rank, chunk)]
        plans = [plan(s, cfg.train.max_tokens_per_microbatch, self.device) for s in steps]

        sums: dict[str, torch.Tensor | float] = {}  # metric values stay on the device until the end of the rollout
        extremes: dict[str, torch.Tensor] = {}  # ".../min" and ".../max" metrics: extremes over micro-batches

        def add(key, value, weight=1.0):
            if key.endswith(("/min", "/max")):
                if weight:  # a micro-batch without loss tokens has no extremes
                    pick = torch.minimum if key.endswith("/min") else torch.maximum
                    extremes[key] = pick(extremes[key], value) if key in extremes else value
                return
            sums[key] = sums.get(key, 0.0) + value * weight
            sums[key + "#w"] = sums.get(key + "#w", 0.0) + weight

        # Every rank runs the same number of micro-batches per optimizer step (FSDP2 gathers weights in each
        # forward): the global max of every step's count, in one collective; ranks with fewer pad with copies that
        # carry zero weight.
        counts = torch.tensor([len(mbs) for mbs in plans], device=self.device)
        n_mbs = [int(n) for n in all_reduce(counts, "max").tolist()]  # sync: loop counts

        # Old and reference log-probs: no-grad packed forwards before any update of this rollout. The policy's go
        # through its wrapped forward (under FSDP2 that gathers the sharded weights, a collective: padded counts).
        if len(steps) > 1 and self.uses_old_logprobs:
            self._policy_logprobs(plans, n_mbs, "old_logprobs", temperature)
        if beta > 0 and self.ref_forward is None:  # LoRA: the policy with its adapters disabled is the reference
            with adapters_disabled(unwrap_model(self.model)):
                self._policy_logprobs(plans, n_mbs, "ref_logprobs", temperature)
        elif beta > 0:  # the reference model is a plain module on every rank: no collective
            for mbs in plans:
                for mb in mbs:
                    mb.ref_logprobs = packed_logprobs(self.ref_forward, mb, temperature)

        num_bad, num_skipped = 0, 0
        for mbs, n_mb in zip(plans, n_mbs):
            tokens, seqs = self._normaliser(mbs)
            if tokens == 0:  # nothing to learn from (every completion masked): no optimizer step
                num_skipped += 1
                continue
            self.optimizer.zero_grad(set_to_none=True)
            loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
            for i in range(n_mb):
                mb = mbs[min(i, len(mbs) - 1)]
                weight = 0.0 if i >= len(mbs) else 1.0
                with train_mode(self.model), accumulate(self.model, self.optimizer, last=i == n_mb - 1):
                    loss, metrics = self._loss(mb, tokens, seqs, beta, epsilon_high, max_new_tokens)
                    (loss * weight * self.world_size).backward()
                loss_total += loss.detach().double() * weight
                if weight:
                    for k, v in metrics.items():
                        add(k, v, mb.num_loss_tokens)
            loss_value = float(all_reduce(loss_total))  # the optimizer step's full loss, all ranks
            max_norm = self.cfg.train.max_grad_norm if self.cfg.train.max_grad_norm > 0 else math.inf
            # the fp32 gradients the optimizer steps (fp32 masters' under mixed precision)
            grad_norm = torch.nn.utils.clip_grad_norm_(optimizer_params(self.optimizer), max_norm)
            grad_norm = float(_local(grad_norm))  # sync: the finiteness check decides whether to step
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                num_bad += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()
            self.scheduler.step()
            add("loss", loss_value)
            add("grad_norm", grad_norm)

        # sync: one per metric per rollout, for the log row
        out = {k: float(v) / sums[k + "#w"] for k, v in sums.items() if not k.endswith("#w") and sums[k + "#w"] > 0}
        out.update((k, float(v)) for k, v in extremes.items())
        out["optimizer_steps"] = float(len(plans) - num_bad - num_skipped)
        out["bad_steps"] = float(num_bad)
        return out

    def _policy_logprobs(self, plans: list[list[MicroBatch]], n_mbs: list[int], attr: str, temperature: float):
        """``mb.<attr>`` = the policy's no-grad log-probs of every micro-batch, through its wrapped forward (under
        FSDP2 that gathers the sharded weights, a collective: every rank runs the padded counts ``n_mbs``)."""
        policy = _no_grad_forward(self.model)
        for mbs, n_mb in zip(plans, n_mbs):
            for i in range(n_mb):
                logp_N = packed_logprobs(policy, mbs[min(i, len(mbs) - 1)], temperature)
                if i < len(mbs):
                    setattr(mbs[i], attr, logp_N)

    def _loss(self, mb: MicroBatch, tokens: float, seqs: float, beta: float, epsilon_high: float | None,
              max_new_tokens: int):
        """One micro-batch's re-weighted loss and its metrics.

        On-policy (one optimizer step per rollout, ``mb.old_logprobs`` None) the loss's own log-probs are also the
        old ones (ratio 1, as TRL). The engine's log-probs go in as ``sampling_logprobs``: the loss measures the
        training–inference gap against the old log-probs (``sampling/sampling_logp_difference/{mean,max}``, from
        the loss's own pass over the vocabulary, not a second no-grad one) and, with ``grpo.rollout_is``, corrects
        it by importance sampling (``sampling/importance_sampling_ratio/{min,mean,max}``,
        ``sampling/is_clipped_fraction``).
        """
        hidden_NH, weight_VH, bias_V = _call(self.model, mb)
        loss, metrics = self._policy_loss(mb, hidden_NH, weight_VH, bias_V, tokens, beta, epsilon_high,
                                          max_new_tokens)
        return self._reweight(loss, mb, tokens, seqs), metrics

    def _policy_loss(self, mb: MicroBatch, hidden_NH, weight_VH, bias_V, tokens: float, beta: float,
                     epsilon_high: float | None, max_new_tokens: int):
        """``fused_linear_grpo_loss`` of one micro-batch from the policy's hidden states (not re-weighted)."""
        reduction = LOSS_REDUCTION[self.cfg.grpo.loss_type]
        return fused_linear_grpo_loss(
            hidden_NH, weight_VH, mb.targets, mb.old_logprobs, mb.advantages, mb.mask, bias=bias_V,
            temperature=self.cfg.rollout.temperature, return_entropy=True,
            ref_logprobs=mb.ref_logprobs, beta=beta, epsilon_high=epsilon_high, max_completion_length=max_new_tokens,
            num_items_in_batch=tokens if reduction == "dapo" else None, cu_seqlens=mb.batch.cu_seqlens,
            per_token_advantages=mb.per_token_advantages, sampling_logprobs=mb.sample_logprobs,
            **loss_options(self.cfg),
        )

    def _reweight(self, loss: torch.Tensor, mb: MicroBatch, tokens: float, seqs: float) -> torch.Tensor:
        """A micro-batch's loss, aggregated over its own tokens or sequences, as its share of the optimizer step's
        (module docstring); dapo's is already normalised by the global token count."""
        reduction = LOSS_REDUCTION[self.cfg.grpo.loss_type]
        if reduction == "bnpo":
            return loss * mb.num_loss_tokens / tokens
        if reduction in ("grpo", "dr_grpo"):
            return loss * mb.num_seqs / seqs
        return loss


def loss_options(cfg: Config) -> dict:
    """The ``grpo_loss`` keywords the ``grpo`` group sets directly (β and ε_high come from the stage settings)."""
    g = cfg.grpo
    return dict(
        epsilon_low=g.epsilon_low, delta=g.delta, dual_clip_c=g.dual_clip_c, loss_type=g.loss_type,
        importance_sampling_level=g.importance_sampling_level, rollout_is=g.rollout_is,
        rollout_is_cap=g.rollout_is_cap, rollout_is_min=g.rollout_is_min, kl_estimator=g.kl_estimator,
        kl_weight=g.kl_weight, kl_input_clamp=g.kl_input_clamp, kl_output_clamp=g.kl_output_clamp,
        sapo_temperature_pos=g.sapo_temperature_pos, sapo_temperature_neg=g.sapo_temperature_neg,
        off_policy_mask_threshold=g.off_policy_mask_threshold,
    )


# ---------------------------------------------------------------------------------------------- the algorithm

REWARD_COUNTS = ("/failures", "/timeouts", "/nonfinite", "/workers_respawned")  # summed over ranks
SEED_STRIDE = 1_000_003  # separates the per-(step, rank) sampling seeds
# Generation batch b of step s samples with the seed of batch 0 of step s + b * DS_SEED_STRIDE (the engine keeps 31 bits
# of a seed: the step is taken modulo 2^21), a step no run reaches
DS_SEED_STRIDE = 100_003


def check_world_size(cfg: Config, world_size: int) -> None:
    """The rollout's prompts and optimizer steps must split evenly over ``world_size`` processes."""
    if cfg.grpo.num_prompts_per_step % world_size:
        raise ValueError(f"grpo.num_prompts_per_step={cfg.grpo.num_prompts_per_step} must be a multiple of the "
                         f"number of processes ({world_size})")
    if cfg.grpo.prompts_per_gen_batch % world_size:
        raise ValueError(f"int(grpo.batch_multiplier x grpo.num_prompts_per_step) = {cfg.grpo.prompts_per_gen_batch} "
                         f"prompts per generation batch must be a multiple of the number of processes ({world_size})")
    seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations
    per_step = cfg.train.sequences_per_optimizer_step
    if per_step and (seqs % per_step or per_step % world_size):
        raise ValueError(f"train.sequences_per_optimizer_step={per_step} must divide the rollout's {seqs} "
                         f"sequences (grpo.num_prompts_per_step x grpo.num_generations) and be a multiple of "
                         f"the number of processes ({world_size})")


class GRPO:
    """GRPO on ``train.py``'s loop: one step = rollout (sample, score, advantages) → :class:`PolicyUpdate`.

    ``trainer`` gives the wrapped model, optimizer, scheduler, tokenizer, generation (``trainer.generate``) and the
    shared avg@k validation (``trainer.accuracy_eval``). The frozen reference model (β > 0 in the config or a
    stage) is ``model.path`` loaded again: the initial weights (with ``model.lora``: no second model, the policy
    with its adapters disabled, ``fastgrpo.models.lora.adapters_disabled``); from a stage with ``reset_reference`` on,
    the
    policy's weights at that stage's first step, saved once as ``<run dir>/reference/step_N.pt`` (its step is in
    :meth:`state_dict`, so a resumed run loads them back). Rewards are scored by a
    :class:`fastgrpo.rewards.pool.RewardPool` (its workers start here, during the model set-up and warm-up; the
    trainer calls :meth:`close`).
    """

    progress = {"reward": "reward/mean", "acc": "accuracy"}
    """Progress-bar fields: label → metric."""
    check_world_size = staticmethod(check_world_size)

    def __init__(self, trainer):
        from fastgrpo.data.prompts import load_datasets
        from fastgrpo.models.loading import load_model
        from fastgrpo.rewards.pool import RewardPool, default_num_workers

        cfg, st = trainer.cfg, trainer.state
        self.trainer = trainer
        self.cfg = cfg
        self.train_data, self.held_out = load_datasets(cfg.data, trainer.tokenizer)
        workers = cfg.reward.num_workers
        if workers is None:  # a rank keeps its torch threads busy on CPU, one core (its Python thread) on GPU
            busy = torch.get_num_threads() if st.device.type == "cpu" else 1
            workers = default_num_workers(busy, int(os.environ.get("LOCAL_WORLD_SIZE", st.world_size)))
        self.envs = self.templates = None
        preload: list[str] = []
        if cfg.env.enabled:  # multi-turn: the environments run in the reward workers (fastgrpo.environments.rollout)
            from fastgrpo.environments import environment_modules
            from fastgrpo.environments.rollout import env_objects

            factory, tools = env_objects(cfg)
            preload = environment_modules(factory, tools)
        self.rewards = RewardPool(cfg.reward, workers, preload=preload)
        if cfg.env.enabled:
            from fastgrpo.environments.rollout import build_environments, build_templates

            self.envs = build_environments(cfg, self.rewards, factory, tools)
            self.templates = build_templates(self.envs, trainer.tokenizer)
        self.ref_model = None
        if not is_lora(trainer.model) and (cfg.grpo.beta > 0 or any((s.beta or 0) > 0 for s in cfg.stages)):
            self.ref_model, _ = load_model(cfg.model, st.device, seed=cfg.train.seed)
            self.ref_model.requires_grad_(False).eval()
        self.reference_step: int | None = None
        """The step whose policy weights the reference holds (None: the initial weights)."""
        self.update = PolicyUpdate(cfg, trainer.wrapped, trainer.optimizer, trainer.scheduler, self.ref_model,
                                   st.device, st.world_size)

    @property
    def rows_per_step(self) -> int:
        """Training rows (prompts) of one generation batch, all ranks together: what a step draws from the data
        sampler (dynamic sampling draws the next ones for each further batch)."""
        return self.cfg.grpo.prompts_per_gen_batch

    def describe_data(self) -> str:
        dropped = self.train_data.num_dropped + (self.held_out.num_dropped if self.held_out else 0)
        no_answer = self.train_data.num_no_answer + (self.held_out.num_no_answer if self.held_out else 0)
        return (f"{len(self.train_data)} training prompts"
                + (f", {len(self.held_out)} held-out" if self.held_out else "")
                + (f", {dropped} dropped (longer than data.max_prompt_tokens)" if dropped else "")
                + (f", {no_answer} dropped (no answer)" if no_answer else ""))

    def warmup_examples(self):
        """The supervised warm-up's examples (each prompt and its reference completion: the answer in
        ``\\boxed{}`` and EOS) and the completions alone (``fastgrpo.algorithms.sft.sft_warmup``)."""
        from fastgrpo.data.responses import SFTExample
        from fastgrpo.data.synthetic import sft_completion

        tok = self.trainer.tokenizer
        if self.cfg.sft.warmup_format == "tool_calls":  # whole tool-calling conversations, as a rollout builds them
            from fastgrpo.data.tool_tiny import tool_tiny_warmup

            return tool_tiny_warmup(self.train_data.rows, self.templates, self.cfg.data)
        responses = [tok(sft_completion(r["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                     for r in self.train_data.rows]
        examples = [SFTExample(p + c, [False] * len(p) + [True] * len(c))
                    for p, c in zip(self.train_data.prompt_ids, responses)]
        return examples, responses

    def begin(self) -> None:
        """Nothing to prepare once the warm-up is done: the reference model (β > 0) is model.path as loaded."""

    def state_dict(self) -> dict:
        return {"reference_step": self.reference_step}

    def load_state_dict(self, state: dict) -> None:
        step = state.get("reference_step")
        if step is None or self.ref_model is None:
            return
        path = self._reference_path(step)
        if not path.is_file():
            raise ValueError(f"resuming needs the KL reference saved at step {step} (stages[].reset_reference), but "
                             f"{path} does not exist")
        self.ref_model.load_state_dict(torch.load(path, map_location=self.trainer.state.device, weights_only=True))
        self.reference_step = step

    def _reference_path(self, step: int):
        return self.trainer.run_dir / "reference" / f"step_{step:08d}.pt"

    @torch.no_grad()
    def _reference_from_policy(self) -> None:
        """The KL reference becomes the policy's current weights (a stage with ``reset_reference``: a NeMo-RL stage is
        a new run from the previous stage's weights, which are its reference); rank 0 saves them once, written to a
        temporary name and then renamed."""
        t = self.trainer
        t.copy_policy_into(self.ref_model)
        self.reference_step = t.step
        if t.state.is_main:
            path = self._reference_path(t.step)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.ref_model.state_dict(), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        print0(f"step {t.step}: the KL reference is now the policy's weights")

    def validate(self) -> dict[str, float]:
        """avg@k / pass@k on the held-out prompts (none: nothing to validate)."""
        return self.trainer.accuracy_eval(self.held_out) if self.held_out is not None else {}

    def eval_sampler(self):
        """Validation's sampler for ``fastgrpo.eval.evaluate``: multi-turn with the environments (None: the engine
        on the held-out prompts). Its accuracy is the math verifier's when ``reward.functions`` has ``math``, else
        the environment's reward (a game's solve rate)."""
        if self.envs is None:
            return None
        from fastgrpo.environments.rollout import env_rows, generate_trajectories, multi_turn_params

        def sample(indices: list[int], params: SamplingParams):
            rows = env_rows([self.held_out.rows[i] for i in indices], self.cfg)
            _, outs, trajs, _ = generate_trajectories(self.trainer.engine.generate, self.envs, self.templates, rows,
                                                      multi_turn_params(params, self.cfg, self.envs))
            scores = None if "math" in self.cfg.reward.functions else [
                [trajs[(i, j)].reward for j in range(len(group))] for i, group in enumerate(outs)]
            return outs, float(sum(t.tool_calls > 0 for t in trajs.values())), scores

        return sample

    def close(self) -> None:
        """Stop the reward workers."""
        self.rewards.close()

    def _generate(self, indices: list[int], settings: dict, batch: int) -> tuple[list[Group], dict]:
        """One generation batch: this rank's share of the prompts ``indices`` sampled, scored, rescaled and shaped;
        its groups and its sums for the step's metrics.

        Each group goes to the reward pool as soon as the engine finishes it (decoded here, in the engine's
        callback), so scoring overlaps the decoding of the other groups; the scores come back in prompt order.
        """
        t = self.trainer
        cfg, st, g = self.cfg, t.state, self.cfg.grpo
        per_rank = len(indices) // st.world_size
        idx = indices[st.rank * per_rank : (st.rank + 1) * per_rank]
        prompts = [self.train_data.prompt_ids[i] for i in idx]
        G = g.num_generations
        params = SamplingParams(n=G, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, max_new_tokens=settings["max_new_tokens"],
                                max_sequence_tokens=settings["max_sequence_tokens"] or None,
                                seed=(cfg.train.seed * SEED_STRIDE + t.step + batch * DS_SEED_STRIDE) * 1024 + st.rank)
        columns = self.train_data.columns(idx)  # column -> one value per prompt
        if self.envs is not None:
            from fastgrpo.environments.rollout import env_rows, multi_turn_params

            params = multi_turn_params(params, cfg, self.envs)
            rows = env_rows([self.train_data.rows[i] for i in idx], cfg)
        prompt_texts = None

        def score(p: int, group: list) -> None:
            texts = [t.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
            self.rewards.submit(p, [prompt_texts[p]] * len(group), texts,
                                {k: [vals[p]] * len(group) for k, vals in columns.items()})

        env_sums = {}
        with t.timer("generation"):
            if self.envs is None:
                prompt_texts = [t.tokenizer.decode(p) for p in prompts]
                outs = t.generate(prompts, params, on_group_done=score)
            else:  # the prompts come from the environments' resets; rewards score the final transcripts
                from fastgrpo.environments.rollout import generate_trajectories, trajectory_sums

                prompts, outs, trajs, handler_metrics = generate_trajectories(t.generate, self.envs, self.templates,
                                                                              rows, params)
                prompt_texts = [t.tokenizer.decode(p) for p in prompts]
                for p, group in enumerate(outs):
                    score(p, group)
                env_sums = trajectory_sums(outs, trajs, handler_metrics)
        completions = [c for group in outs for c in group]  # [P * G], prompt-major
        result, reward_times = self.rewards.gather()
        total = result.total
        if self.envs is not None:  # the environment's reward next to the reward functions'
            w = cfg.env.reward_weight
            total = [r + w * trajs[(i // G, i % G)].reward for i, r in enumerate(total)]
        raw = scale_rewards(total, cfg.reward_scaling)
        penalties = [0.0] * len(completions)
        shaping = cfg.reward_shaping
        if shaping.enabled:
            limit = shaping.max_response_length or settings["max_new_tokens"]
            penalties = [overlong_penalty(len(c.token_ids), limit, shaping.overlong_buffer_length,
                                          shaping.overlong_buffer_penalty) for c in completions]
        rewards = [r + x for r, x in zip(raw, penalties)]
        groups = [Group(prompts[p], outs[p], rewards[p * G : (p + 1) * G], max(raw[p * G : (p + 1) * G]) >
                        min(raw[p * G : (p + 1) * G])) for p in range(len(prompts))]
        lengths = [len(c.token_ids) for c in completions]
        correct = result.per_function.get("math", [float(x > 0) for x in total])
        sums = {"reward/sum": sum(rewards), "reward_sq/sum": sum(r * r for r in rewards),
                "completions/sum": len(lengths), "correct": sum(c == 1.0 for c in correct),
                "length": sum(lengths), "length_max": max(lengths),
                "truncated": sum(c.finish_reason == "length" for c in completions),
                "zero_std": sum(not grp.signal for grp in groups), "groups": len(groups),
                "tokens/sum": float(sum(lengths) + G * sum(len(p) for p in prompts)), "penalty": sum(penalties),
                "result": result, **reward_times, **env_sums}
        stats = getattr(t.engine, "last_stats", None) or {}  # the engine's scheduling of this batch
        if stats:
            sums.update({"generation/peak_running/max": float(stats["peak_running"]),
                         "generation/preemptions/sum": float(stats["preemptions"]),
                         "generation/decode_steps/max": float(stats["decode_steps"]),
                         "generation/kv_usage/max": stats["peak_kv_tokens"] / stats["kv_capacity_tokens"]})
            if self.envs is not None:
                sums.update({"generation/resume_prefill_tokens/sum": float(stats["resume_prefill_tokens"]),
                             "generation/re_prefill_tokens/sum": float(stats["re_prefill_tokens"])})
        return groups, sums

    def _balance(self, kept: list[list[Group]], target: int) -> list[Group]:
        """The first ``target`` groups of ``kept`` (this rank's groups with signal, per generation batch) over all
        ranks, ``target / world_size`` of them on each rank.

        The order is generation batch, then rank, then prompt; rank r trains on positions [r·k, (r+1)·k) of it
        (k = target / world_size). A group that another rank trains on travels once, by ``broadcast_object`` from
        the rank that generated it: only the unevenness between ranks moves, a few groups in a typical step.
        """
        st = self.trainer.state
        W, k = st.world_size, target // st.world_size
        counts_WB = torch.zeros(W, len(kept), dtype=torch.long)
        counts_WB[st.rank] = torch.tensor([len(x) for x in kept])
        counts_WB = all_reduce(counts_WB.to(self.trainer.coll_device())).cpu()  # sync: every rank plans the moves
        order = [(r, b, i) for b in range(len(kept)) for r in range(W) for i in range(int(counts_WB[r, b]))][:target]
        mine = {pos: kept[b][i] for pos, (r, b, i) in enumerate(order) if r == st.rank and pos // k == r}
        for src in range(W):
            leaving = {pos: (b, i) for pos, (r, b, i) in enumerate(order) if r == src and pos // k != src}
            if leaving:  # every rank knows the plan, so every rank takes part in the same broadcasts
                sent = {pos: kept[b][i] for pos, (b, i) in leaving.items()} if src == st.rank else None
                mine.update({pos: grp for pos, grp in broadcast_object(sent, src=src).items() if pos // k == st.rank})
        return [mine[pos] for pos in sorted(mine)]

    def rollout(self, indices: list[int], settings: dict) -> tuple[list[Sample], dict[str, float]]:
        """Sample, score and compute advantages for this rank's share of the step's prompts ``indices``.

        With ``grpo.use_dynamic_sampling``, groups whose rewards (before ``reward_shaping``) are all equal are
        dropped, and further generation batches of ``grpo.prompts_per_gen_batch`` prompts (the data sampler's next
        ones) are generated until ``num_prompts_per_step`` groups with signal exist over all ranks, at most
        ``grpo.dynamic_sampling_max_gen_batches`` batches; the first ``num_prompts_per_step`` of them (by batch,
        rank and prompt) are trained on, the same number on every rank (:meth:`_balance`).
        """
        t = self.trainer
        cfg, st, g = self.cfg, t.state, self.cfg.grpo
        G, P = g.num_generations, g.num_prompts_per_step
        kept: list[list[Group]] = []
        totals: dict = {}
        have = dropped = 0
        for batch in range(g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
            if batch:
                indices = t.sampler.next(self.rows_per_step)
            groups, sums = self._generate(indices, settings, batch)
            for key, value in sums.items():
                if key == "result":
                    totals[key] = merge_results(totals[key], value) if key in totals else value
                elif key.endswith("/max") or key == "length_max":
                    totals[key] = max(totals.get(key, value), value)
                else:
                    totals[key] = totals.get(key, 0) + value
            if not g.use_dynamic_sampling:
                kept.append(groups)
                break
            kept.append([grp for grp in groups if grp.signal])
            n = all_reduce(torch.tensor([len(kept[-1]), len(groups) - len(kept[-1])],
                                        device=t.coll_device())).tolist()  # sync: the decision to generate more
            have, dropped = have + n[0], dropped + n[1]
            if have >= P:
                break
        else:
            raise RuntimeError(
                f"dynamic sampling (step {t.step}): {have} of grpo.num_prompts_per_step={P} groups have rewards that "
                f"differ after grpo.dynamic_sampling_max_gen_batches={g.dynamic_sampling_max_gen_batches} generation "
                f"batches of {self.rows_per_step} prompts ({dropped} groups dropped: every completion scored the same)"
                "; raise grpo.batch_multiplier or grpo.dynamic_sampling_max_gen_batches, or train on prompts the "
                "policy neither always solves nor always fails")
        groups = self._balance(kept, P) if g.use_dynamic_sampling else kept[0]
        r_PG = torch.tensor([grp.rewards for grp in groups], dtype=torch.float64).view(len(groups), G)
        batch_std = None
        if g.scale == "batch":
            s = all_reduce(torch.tensor([r_PG.sum(), (r_PG**2).sum(), r_PG.numel()], dtype=torch.float64,
                                        device=t.coll_device())).cpu().tolist()
            batch_std = math.sqrt(max(s[1] - s[0] ** 2 / s[2], 0.0) / max(s[2] - 1, 1))
        if G > 1:
            adv = compute_advantages(r_PG, g.baseline, g.scale, batch_std)[0].view(-1).tolist()  # CPU: a list once
        else:  # one completion per prompt (pure distillation, config.py): no group baseline, no reward advantage
            adv = [0.0] * r_PG.numel()
        samples = []
        for p, grp in enumerate(groups):
            for j, c in enumerate(grp.completions):
                keep = not (g.mask_truncated_completions and c.finish_reason == "length")
                keep = keep and not (g.mask_zero_std_groups and not grp.signal)
                samples.append(Sample(grp.prompt_ids, list(c.token_ids), list(c.logprobs), adv[p * G + j], keep,
                                      loss_mask=list(c.loss_mask) if self.envs is not None else None))
        n = totals["completions/sum"]
        m = {key: totals[key] for key in ("reward/sum", "reward_sq/sum", "completions/sum", "tokens/sum")}
        m.update({
            "accuracy": totals["correct"] / n, "response_length/mean": totals["length"] / n,
            "response_length/max": float(totals["length_max"]), "truncated_fraction": totals["truncated"] / n,
            "frac_reward_zero_std": totals["zero_std"] / totals["groups"], **totals["result"].metrics(),
            **{k: v for k, v in totals.items() if k.startswith(("time/", "reward/workers", "generation/"))},
        })
        if cfg.reward_shaping.enabled:
            m["reward_shaping/penalty_mean"] = totals["penalty"] / n
        if self.envs is not None:
            from fastgrpo.environments.rollout import step_metrics

            m.update(step_metrics(totals, n))
        if g.use_dynamic_sampling:  # the same on every rank (counted over all of them)
            m.update({"dynamic_sampling/num_gen_batches": float(len(kept)),
                      "dynamic_sampling/dropped_groups": float(dropped),
                      "dynamic_sampling/discarded_valid_samples": float((have - P) * G),
                      "dynamic_sampling/groups": float(len(groups) * st.world_size)})
        return samples, m

    def step(self, indices: list[int], settings: dict) -> dict[str, float]:
        """One GRPO step on the prompts ``indices`` (all ranks'); returns the step's metrics, reduced over ranks,
        with ``tokens`` (all ranks) and ``bad_steps`` (non-finite optimizer steps of this step)."""
        t = self.trainer
        if self.ref_model is not None and any(s.reset_reference and s.at_step == t.step for s in self.cfg.stages):
            self._reference_from_policy()
        samples, local = self.rollout(indices, settings)
        with t.updating(), t.timer("update"):
            upd = self.update.run(samples, beta=settings["beta"], epsilon_high=settings["epsilon_high"],
                                  max_new_tokens=settings["max_new_tokens"])
        # every rank has the same keys: metrics a rank lacks (no optimizer step succeeded) are NaN there
        for key in ("loss", "grad_norm", "entropy", *POLICY_METRICS[LOSS_POLICY[self.cfg.grpo.loss_type]],
                    *DIFF_NAMES) + (("kl",) if settings["beta"] else ()) + (
                        RATIO_NAMES if self.cfg.grpo.rollout_is != "none" else ()):
            upd.setdefault(key, math.nan)
        local.update(upd)
        local["bad_steps/sum"] = local.pop("bad_steps")
        local["optimizer_steps/max"] = local.pop("optimizer_steps")
        local.update(t.timer.pop(prefix="time/"))
        counts = {k: "sum" for k in local if k.startswith("reward/") and k.endswith(REWARD_COUNTS)}
        m = reduce_metrics(local, ops=counts)
        n = m.pop("completions/sum")
        mean = m.pop("reward/sum") / n
        m["reward/mean"] = mean
        m["reward/std"] = math.sqrt(max(m.pop("reward_sq/sum") / n - mean**2, 0.0) * n / max(n - 1, 1))
        m["tokens"] = m.pop("tokens/sum")
        m["max_new_tokens"] = settings["max_new_tokens"]
        m["bad_steps"] = m.pop("bad_steps/sum")
        return m
