"""Supervised fine-tuning on the trainer's loop (``algorithm: sft``), and the supervised warm-up before GRPO / DPO.

Loss of one step over the examples of every rank, each a token sequence with a loss mask (completion or assistant
tokens: ``fastgrpo.data.datasets.SFTExample``), with ``C`` the number of trained tokens of the whole step (all ranks)::

    L = (1 / C) Σ_examples Σ_{t : mask_t} −log p(y_t | y_<t)

Sequences are packed padding-free into micro-batches of at most ``train.max_tokens_per_microbatch`` tokens. Each
micro-batch's summed cross-entropy comes from ``fused_linear_cross_entropy`` on the last hidden state (no logits
in memory; untrained positions are targets ``-100``), divided by the global ``C`` and multiplied by ``world_size``
(DDP averages gradients over ranks), so W processes give the gradients of one process on the whole batch. Every
rank runs the same number of micro-batches (FSDP2 gathers weights in every forward): a rank with fewer repeats
its last one with weight 0. A mixture-of-experts policy's loss (the warm-up's too) also gets the router's
load-balancing term, ``coef · aux_mb / M`` per micro-batch (``fastgrpo.algorithms.moe``, where its departure from
TRL's SFTTrainer is stated), logged as ``moe/aux_loss``; validation's ``eval/loss`` stays the NLL alone.

Under ``model.dtype=bfloat16`` the gradients are accumulated and reduced in fp32 and the step updates fp32 master
weights (:mod:`fastgrpo.precision`); the warm-up's optimizer steps the main optimizer's masters.

``algorithm: sft`` steps with the trainer's optimizer (``train.lr``, clipping at ``train.max_grad_norm``; a step
whose loss or gradient norm is not finite is skipped and counted) on ``sft.batch_size`` rows per step, and
validates with ``eval/loss`` (the same token mean on the held-out rows) plus avg@k on the synthetic task's
held-out prompts.

The warm-up (``sft.warmup_steps`` before GRPO or DPO) runs before the main algorithm with its own AdamW at
``sft.lr`` and no clipping: ``sft.batch_size`` examples drawn with replacement from the algorithm's ``(prompt,
reference response)`` pairs by ``random.Random(train.seed)`` (the same draw on every rank; each rank takes every
``world_size``-th example), each response replaced by a random row's with probability ``sft.answer_noise``.
"""

from __future__ import annotations

import math
import random
import time

import torch

from fastgrpo.algorithms.batch import lm_batch, same_count
from fastgrpo.algorithms.context import AlgorithmContext
from fastgrpo.algorithms.forward import forward_packed, no_grad_forward
from fastgrpo.algorithms.moe import RouterAuxLoss, router_aux_loss
from fastgrpo.algorithms.prerequisites import no_prerequisites
from fastgrpo.algorithms.update import clip_and_step
from fastgrpo.data.responses import SFTExample, load_response_datasets
from fastgrpo.distributed import all_reduce, print0
from fastgrpo.kernels.linear_logprobs import fused_linear_cross_entropy
from fastgrpo.models.packing import plan_microbatches
from fastgrpo.precision import accumulate, make_optimizer, train_mode


def sft_backward(model, optimizer, examples: list[SFTExample], max_tokens: int, device: torch.device,
                 world_size: int, fallback: SFTExample,
                 aux: RouterAuxLoss | None = None) -> tuple[float, float, dict[str, float]]:
    """Forward and backward of one SFT step's loss (module docstring) on this rank's ``examples`` (may be empty:
    ``fallback`` then stands in, with weight 0), accumulated into ``optimizer``'s gradients; returns ``(loss of the
    whole step, its trained tokens, metrics)``. ``aux``: an MoE policy's load-balancing term, ``coef · mean(aux)``
    over the step's micro-batches added to the loss, ``moe/aux_loss`` in the metrics (``fastgrpo.algorithms.moe``)."""
    groups = plan_microbatches([len(ex.input_ids) for ex in examples], max_tokens) if examples else []
    mbs = [lm_batch([examples[i] for i in g], device) for g in groups] or [lm_batch([fallback], device)]
    local = [float(sum(mb.num_loss_tokens for mb in mbs)) if examples else 0.0, float(len(groups))]
    # sync: the normalisers (trained tokens, real micro-batches) of all ranks
    total, count = all_reduce(torch.tensor(local, dtype=torch.float64, device=device)).tolist()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    padded = same_count(mbs, device)
    for i, (mb, weight) in enumerate(padded):
        weight = weight if examples else 0.0
        routing = None if aux is None else aux.training_routing(weight > 0)
        with train_mode(model), accumulate(model, optimizer, last=i == len(padded) - 1):
            hidden_NH, weight_VH, bias_V = forward_packed(model, mb, routing)
            targets = torch.where(mb.mask, mb.targets, -100)
            loss = fused_linear_cross_entropy(hidden_NH, weight_VH, targets, bias=bias_V, reduction="sum")
            objective = loss * weight * world_size / max(total, 1.0)
            if aux is not None:
                objective = objective + aux.aux_term(routing, count) * weight * world_size
            objective.backward()
        loss_sum += loss.detach().double() * weight
    sums = loss_sum[None] if aux is None else torch.cat([loss_sum[None], aux.totals(device)])
    ce_sum, *aux_totals = all_reduce(sums).tolist()  # sync: one per step, for the metrics
    term, metrics = aux.step_result(*aux_totals) if aux is not None else (0.0, {})
    return ce_sum / max(total, 1.0) + term, total, metrics


@torch.no_grad()
def sft_eval_loss(model, examples: list[SFTExample], max_tokens: int, device: torch.device, rank: int,
                  world_size: int) -> float:
    """Token-mean NLL of ``examples`` (every rank passes all of them and scores every ``world_size``-th)."""
    mine = examples[rank::world_size]
    groups = plan_microbatches([len(ex.input_ids) for ex in mine], max_tokens) if mine else []
    mbs = [lm_batch([mine[i] for i in g], device) for g in groups] or [lm_batch(examples[:1], device)]
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    forward = no_grad_forward(model)
    for mb, weight in same_count(mbs, device):
        weight = weight if mine else 0.0
        hidden_NH, weight_VH, bias_V = forward_packed(forward, mb)
        targets = torch.where(mb.mask, mb.targets, -100)
        loss = fused_linear_cross_entropy(hidden_NH, weight_VH, targets, bias=bias_V, reduction="sum")
        sums += torch.stack([loss.double(), torch.tensor(float(mb.num_loss_tokens), device=device).double()]) * weight
    loss_sum, tokens = all_reduce(sums).tolist()  # sync: once per validation
    return loss_sum / max(tokens, 1.0)


def sft_warmup(ctx: AlgorithmContext, examples: list[SFTExample], responses: list[list[int]]) -> None:
    """The supervised warm-up (module docstring) of the run's wrapped policy (``ctx.wrapped``): ``examples`` are the
    algorithm's prompts each followed by its reference response; with probability ``sft.answer_noise`` the
    response is swapped for ``responses[j]`` of a random row ``j``."""
    s_cfg, st = ctx.cfg.sft, ctx.state
    opt = make_optimizer(ctx.wrapped, lr=s_cfg.lr, share_masters_with=ctx.optimizer)  # the same fp32 masters
    aux = router_aux_loss(ctx.cfg, ctx.model)
    rng = random.Random(ctx.cfg.train.seed)  # the same examples on every rank; each takes its share
    start = time.perf_counter()
    for s in range(s_cfg.warmup_steps):
        picks = [rng.randrange(len(examples)) for _ in range(s_cfg.batch_size)]
        swap = [rng.randrange(len(responses)) if rng.random() < s_cfg.answer_noise else None for _ in picks]
        batch = []
        for j in range(st.rank, len(picks), st.world_size):
            ex = examples[picks[j]]
            if swap[j] is not None:
                n_prompt = ex.loss_mask.index(True)
                ex = SFTExample(ex.input_ids[:n_prompt] + responses[swap[j]],
                                [False] * n_prompt + [True] * len(responses[swap[j]]))
            batch.append(ex)
        opt.zero_grad(set_to_none=True)
        loss, _, _ = sft_backward(ctx.wrapped, opt, batch, ctx.cfg.train.max_tokens_per_microbatch, st.device,
                                  st.world_size, examples[0], aux)
        opt.step()
        if (s + 1) % max(1, s_cfg.warmup_steps // 4) == 0 or s + 1 == s_cfg.warmup_steps:
            print0(f"warm-up step {s + 1}/{s_cfg.warmup_steps}: loss {loss:.4f}")
    print0(f"warm-up done in {time.perf_counter() - start:.1f} s")


def check_world_size(cfg, world_size: int) -> None:
    if cfg.sft.batch_size % world_size:
        raise ValueError(f"sft.batch_size={cfg.sft.batch_size} must be a multiple of the number of processes "
                         f"({world_size})")


class SFT:
    """``algorithm: sft`` on ``train.py``'s loop (module docstring)."""

    progress = {"loss": "loss"}
    check_world_size = staticmethod(check_world_size)
    prerequisites = staticmethod(no_prerequisites)

    def __init__(self, ctx: AlgorithmContext):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.train_data, self.held_out, self.held_out_prompts = load_response_datasets(
            self.cfg.data, ctx.tokenizer, "sft")
        self.aux = router_aux_loss(self.cfg, ctx.model)  # an MoE policy's load-balancing term, else None

    @property
    def rows_per_step(self) -> int:
        return self.cfg.sft.batch_size

    def describe_data(self) -> str:
        out = f"{len(self.train_data)} SFT examples{self.train_data.describe()}"
        if self.held_out is not None:
            out += f", {len(self.held_out)} held-out{self.held_out.describe()}"
        return out

    def warmup_examples(self):
        raise AssertionError("algorithm sft has no warm-up (config.py rejects sft.warmup_steps > 0)")

    def begin(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def validate(self) -> dict[str, float]:
        t, st = self.ctx, self.ctx.state
        m = {}
        if self.held_out is not None:
            start = time.perf_counter()
            loss = sft_eval_loss(t.wrapped, self.held_out.items, self.cfg.train.max_tokens_per_microbatch,
                                 st.device, st.rank, st.world_size)
            m.update({"eval/loss": loss, "time/eval_loss": time.perf_counter() - start})
            print0(f"step {t.step}: eval/loss {loss:.4f} on {len(self.held_out)} held-out examples")
        if self.held_out_prompts is not None:
            m.update(t.accuracy_eval(self.held_out_prompts))
        return m

    def step(self, indices: list[int], settings: dict) -> dict[str, float]:
        t, st = self.ctx, self.ctx.state
        per_rank = len(indices) // st.world_size
        mine = [self.train_data.items[i] for i in indices[st.rank * per_rank : (st.rank + 1) * per_rank]]
        with t.updating():
            t.optimizer.zero_grad(set_to_none=True)
            loss, n_loss, aux_metrics = sft_backward(t.wrapped, t.optimizer, mine,
                                                     self.cfg.train.max_tokens_per_microbatch, st.device,
                                                     st.world_size, self.train_data.items[0], self.aux)
            grad_norm, stepped = clip_and_step(t.optimizer, t.scheduler, self.cfg.train.max_grad_norm, loss)
        tokens = float(all_reduce(torch.tensor(float(sum(len(ex.input_ids) for ex in mine)), dtype=torch.float64,
                                               device=t.coll_device())))  # sync: for the log row
        return {"loss": loss if stepped else math.nan, "grad_norm": grad_norm if stepped else math.nan,
                "tokens": tokens, "loss_tokens": n_loss, "bad_steps": float(not stepped), **aux_metrics}
