"""The batch types every algorithm trains on: a rollout's groups and samples, packed micro-batches, and the
padding that gives every rank the same number of micro-batches.

Sequences (prompt + completion) are packed into micro-batches of at most ``train.max_tokens_per_microbatch``
tokens. At packed position ``t`` the target is token ``t + 1`` of the same sequence; the loss mask is 1 exactly
where the target is a completion token (and the completion is trained on: masked truncated completions and, with
``grpo.mask_zero_std_groups``, zero-variance groups get mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.data.responses import SFTExample
from fastgrpo.distributed import all_reduce
from fastgrpo.engine.engine import Completion
from fastgrpo.models.packing import PackedBatch, pack, plan_microbatches
from fastgrpo.models.vlm import PackedVision, pack_vision


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
    routing: torch.Tensor | None = None
    """A mixture-of-experts policy's recorded experts, ``[prompt + completion tokens, MoE layers, top_k]``
    (``Completion.routing``: router replay); None: routed afresh."""

    def __post_init__(self):
        c = len(self.completion_ids)
        for name in ("sample_logprobs", "loss_mask", "token_advantages"):
            v = getattr(self, name)
            if v is not None and len(v) != c:
                raise ValueError(f"Sample.{name} has {len(v)} values for {c} completion tokens")
        if self.routing is not None and self.routing.shape[0] != len(self.prompt_ids) + c:
            raise ValueError(f"Sample.routing has {self.routing.shape[0]} rows for {len(self.prompt_ids) + c} tokens")

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
    routing: torch.Tensor | None = None
    """[N, MoE layers, top_k] the samples' recorded experts (router replay), or None."""
    vision: PackedVision | None = None
    """The sequences' images and M-RoPE positions (prompts that are ``fastgrpo.models.vlm.ImagePrompt``)."""

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
        routing=torch.cat([s.routing for s in samples]).to(device) if samples[0].routing is not None else None,
        vision=_vision([s.tokens for s in samples], device),
    )


def pack_microbatches(samples: list[Sample], max_tokens: int, device: torch.device) -> list[MicroBatch]:
    """Micro-batches of at most ``max_tokens`` tokens (``fastgrpo.models.packing.plan_microbatches``)."""
    groups = plan_microbatches([len(s.tokens) for s in samples], max_tokens)
    return [make_microbatch([samples[i] for i in g], device) for g in groups]


@dataclass
class LMBatch:
    """Packed sequences with next-token targets and a loss mask (SFT and DPO; the packed forward reads
    ``batch``)."""

    batch: PackedBatch
    targets: torch.Tensor  # [N] int64, next token (0 where there is none)
    mask: torch.Tensor  # [N] bool, the target is a trained token
    num_loss_tokens: int
    """Σ mask, counted on the host."""
    vision: PackedVision | None = None
    """The sequences' images and M-RoPE positions (``fastgrpo.models.vlm.ImagePrompt`` prompts)."""


def lm_batch(examples: list[SFTExample], device: torch.device) -> LMBatch:
    """Pack ``examples``: at packed position ``t`` the target is token ``t + 1`` of the same sequence, trained
    where that token's ``loss_mask`` is set."""
    targets, mask = [], []
    for ex in examples:
        targets += ex.input_ids[1:] + [0]
        mask += ex.loss_mask[1:] + [False]
    return LMBatch(batch=pack([ex.input_ids for ex in examples]).to(device),
                   targets=torch.tensor(targets, dtype=torch.long, device=device),
                   mask=torch.tensor(mask, dtype=torch.bool, device=device), num_loss_tokens=sum(mask),
                   vision=_vision([ex.input_ids for ex in examples], device))


def _vision(sequences: list, device: torch.device) -> PackedVision | None:
    vision = pack_vision(sequences)
    return None if vision is None else vision.to(device)


def same_count(groups: list, device: torch.device) -> list[tuple[object, float]]:
    """``groups`` (this rank's micro-batches) padded to the largest count over ranks: ``(item, weight)`` with
    weight 0 on the repeats of the last item. ``groups`` must not be empty."""
    n = int(all_reduce(torch.tensor(len(groups), device=device), "max"))  # sync: the loop count
    return [(groups[min(i, len(groups) - 1)], float(i < len(groups))) for i in range(n)]
