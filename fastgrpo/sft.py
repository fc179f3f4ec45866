"""Supervised fine-tuning through the trainer's packed forward: the loss of the SFT steps and of the warm-up.

Loss of one step over the ``(prompt_ids, completion_ids)`` examples of every rank, with ``C`` the total number of
completion tokens (all ranks)::

    L = (1 / C) Σ_examples Σ_{t ∈ completion} −log p(y_t | y_<t)

Each micro-batch's summed cross-entropy comes from ``fused_linear_cross_entropy`` (no logits in memory), divided by
the global ``C`` and multiplied by ``world_size`` (DDP averages gradients over ranks), so W processes give the
gradients of one process on the whole batch. Prompt tokens are targets of no loss (``-100``).

Under ``model.dtype=bfloat16`` the gradients are accumulated and reduced in fp32 and the step updates fp32 master
weights (:mod:`fastgrpo.precision`); the warm-up's optimizer steps the main optimizer's masters.

The warm-up (``train.sft_warmup_steps``) runs before the main algorithm with its own AdamW at ``train.sft_lr``:
``train.sft_batch_size`` examples drawn with replacement from the algorithm's ``(prompt, reference completion)``
pairs by ``random.Random(train.seed)`` (the same on every rank; each rank takes every ``world_size``-th example),
each completion replaced by a random row's with probability ``train.sft_answer_noise``.
"""

from __future__ import annotations

import random
import time

import torch

from fastgrpo.distributed import all_reduce, print0
from fastgrpo.grpo import Sample, _call, plan
from fastgrpo.kernels.linear_logprobs import fused_linear_cross_entropy
from fastgrpo.precision import accumulate, make_optimizer, train_mode


def sft_step(model, optimizer, samples: list[tuple[list[int], list[int]]], max_tokens: int,
             device: torch.device, world_size: int) -> float:
    """One supervised step (module docstring) on this rank's ``(prompt_ids, completion_ids)`` pairs; returns the
    loss of the whole step (all ranks)."""
    seqs = [Sample(p, c, [0.0] * len(c), 0.0) for p, c in samples]
    mbs = plan(seqs, max_tokens, device)
    total = all_reduce(torch.tensor(float(sum(len(c) for _, c in samples)), device=device))
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    for i, mb in enumerate(mbs):
        with train_mode(model), accumulate(model, optimizer, last=i == len(mbs) - 1):
            hidden_NH, weight_VH, bias_V = _call(model, mb)
            targets = torch.where(mb.mask > 0, mb.targets, -100)
            loss = fused_linear_cross_entropy(hidden_NH, weight_VH, targets, bias=bias_V, reduction="sum")
            (loss * world_size / total).backward()
            loss_sum += loss.detach()
    optimizer.step()
    return float(all_reduce(loss_sum)) / float(total)  # sync: one per warm-up step, for the log line


def sft_warmup(trainer, prompt_ids: list[list[int]], completions: list[str]) -> None:
    """The supervised warm-up (module docstring) of ``trainer``'s wrapped model on ``(prompt_ids[i],
    completions[i])`` pairs; the completions are texts, tokenised here with the EOS token appended."""
    t, st = trainer.cfg.train, trainer.state
    if not t.sft_warmup_steps:
        return
    opt = make_optimizer(trainer.wrapped, lr=t.sft_lr, share_masters_with=trainer.optimizer)  # the same fp32 masters
    rng = random.Random(t.seed)  # the same examples on every rank; each takes its share
    eos = [trainer.tokenizer.eos_token_id]
    start = time.perf_counter()
    for s in range(t.sft_warmup_steps):
        picks = [rng.randrange(len(prompt_ids)) for _ in range(t.sft_batch_size)]
        texts = [completions[rng.randrange(len(completions))] if rng.random() < t.sft_answer_noise
                 else completions[i] for i in picks]
        mine = range(st.rank, len(picks), st.world_size)
        pairs = [(prompt_ids[picks[j]], trainer.tokenizer(texts[j], add_special_tokens=False)["input_ids"] + eos)
                 for j in mine]
        loss = sft_step(trainer.wrapped, opt, pairs, t.max_tokens_per_microbatch, st.device, st.world_size)
        if (s + 1) % max(1, t.sft_warmup_steps // 4) == 0 or s + 1 == t.sft_warmup_steps:
            print0(f"warm-up step {s + 1}/{t.sft_warmup_steps}: loss {loss:.4f}")
    print0(f"warm-up done in {time.perf_counter() - start:.1f} s")
