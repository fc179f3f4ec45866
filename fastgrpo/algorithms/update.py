"""The optimizer step shared by every algorithm (:func:`clip_and_step`) and GRPO's policy update
(:class:`PolicyUpdate`: old / reference log-probs, then the clipped surrogate over packed micro-batches).

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

import dataclasses
import math

import torch

from fastgrpo.algorithms.batch import MicroBatch, Sample, pack_microbatches
from fastgrpo.algorithms.forward import forward_packed, no_grad_forward, packed_forward, packed_logprobs
from fastgrpo.algorithms.moe import MoEUpdate
from fastgrpo.config import Config
from fastgrpo.distributed import ForwardWrapper, all_reduce, unwrap_model
from fastgrpo.kernels.grpo_options import GRPOLossOptions
from fastgrpo.kernels.linear_grpo_loss import fused_linear_grpo_loss
from fastgrpo.models.lora import adapters_disabled
from fastgrpo.models.moe import is_moe
from fastgrpo.precision import accumulate, optimizer_params, train_mode


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full value of a DTensor (``DTensor.full_tensor``: FSDP2's replicated total gradient norm) as a plain
    tensor; other tensors unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_and_step(optimizer, scheduler, max_grad_norm: float, loss_value: float) -> tuple[float, bool]:
    """Clip the gradients (``max_grad_norm``, ``train.max_grad_norm``; 0: only measure), then step the optimizer and
    scheduler unless the loss or the gradient norm is not finite (the gradients are then dropped); returns
    ``(grad_norm, stepped)``."""
    max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
    params = optimizer_params(optimizer)  # the fp32 masters under mixed precision
    grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)))  # sync: the finiteness check
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, False
    optimizer.step()
    scheduler.step()
    return grad_norm, True


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
        self.engine_logprobs_are_old = cfg.numerics.batch_invariant and not cfg.grpo.async_grpo.enabled
        """The engine's log-probs are the pre-update policy's bit for bit: no old-log-prob forward
        (``numerics.batch_invariant``; an async rollout's tokens come from older policies)."""
        self.options = loss_options(cfg)
        """The loss options of the config's base settings (:func:`loss_options`)."""
        self._stage_options: dict[tuple, GRPOLossOptions] = {}  # by (β, ε_high, max_new_tokens): the stages met
        policy = unwrap_model(model)
        self.moe = MoEUpdate(cfg, policy) if is_moe(policy) else None
        """A mixture-of-experts policy's routing, load-balancing loss and replay metrics (``algorithms.moe``)."""

    def _normaliser(self, mbs: list[MicroBatch]) -> tuple[float, float, float]:
        """Global (all ranks) loss-token, sequence and micro-batch counts of one optimizer step."""
        local = torch.tensor([float(sum(mb.num_loss_tokens for mb in mbs)), float(sum(mb.num_seqs for mb in mbs)),
                              float(len(mbs))], dtype=torch.float64, device=self.device)
        tokens, seqs, count = all_reduce(local).tolist()  # sync: the loss normalisers are host floats
        return tokens, seqs, count

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
        plans = [pack_microbatches(s, cfg.train.max_tokens_per_microbatch, self.device) for s in steps]

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
        if self.moe is not None and self.moe.gap:  # the gap without router replay, before any update
            self._policy_logprobs(plans[:1], n_mbs[:1], "fresh_logprobs", temperature, replay=False)
            for mb in plans[0]:
                self.moe.no_replay_gap(mb.fresh_logprobs, mb)
        # With numerics.batch_invariant (and a synchronous rollout) the engine's log-probs are the policy's before
        # any update, bit for bit: the first optimizer step is on-policy (its own log-probs, which equal them: the
        # sampling metrics measure it), later ones take them as the old ones, and the forward is not run.
        if len(steps) > 1 and self.uses_old_logprobs and self.engine_logprobs_are_old:
            for mbs in plans[1:]:
                for mb in mbs:
                    mb.old_logprobs = mb.sample_logprobs
        elif len(steps) > 1 and self.uses_old_logprobs:
            self._policy_logprobs(plans, n_mbs, "old_logprobs", temperature)
        if beta > 0 and self.ref_forward is None:  # LoRA: the policy with its adapters disabled is the reference
            with adapters_disabled(unwrap_model(self.model)):
                self._policy_logprobs(plans, n_mbs, "ref_logprobs", temperature)
        elif beta > 0:  # the reference model is a plain module on every rank: no collective
            for mbs in plans:
                for mb in mbs:
                    mb.ref_logprobs = packed_logprobs(self.ref_forward, mb, temperature, self._routing(mb))

        num_bad, num_skipped = 0, 0
        for mbs, n_mb in zip(plans, n_mbs):
            tokens, seqs, count = self._normaliser(mbs)
            if tokens == 0:  # nothing to learn from (every completion masked): no optimizer step
                num_skipped += 1
                continue
            self.optimizer.zero_grad(set_to_none=True)
            loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
            for i in range(n_mb):
                mb = mbs[min(i, len(mbs) - 1)]
                weight = 0.0 if i >= len(mbs) else 1.0
                with train_mode(self.model), accumulate(self.model, self.optimizer, last=i == n_mb - 1):
                    loss, metrics = self._loss(mb, tokens, seqs, beta, epsilon_high, max_new_tokens, count, weight)
                    (loss * weight * self.world_size).backward()
                loss_total += loss.detach().double() * weight
                if weight:
                    for k, v in metrics.items():
                        add(k, v, mb.num_loss_tokens)
            loss_value = float(all_reduce(loss_total))  # the optimizer step's full loss, all ranks
            grad_norm, stepped = clip_and_step(self.optimizer, self.scheduler, self.cfg.train.max_grad_norm,
                                               loss_value)
            if not stepped:
                num_bad += 1
                continue
            add("loss", loss_value)
            add("grad_norm", grad_norm)

        # sync: one per metric per rollout, for the log row
        out = {k: float(v) / sums[k + "#w"] for k, v in sums.items() if not k.endswith("#w") and sums[k + "#w"] > 0}
        out.update((k, float(v)) for k, v in extremes.items())
        out["optimizer_steps"] = float(len(plans) - num_bad - num_skipped)
        if self.moe is not None:
            out.update(self.moe.metrics())
        out["bad_steps"] = float(num_bad)
        return out

    def _policy_logprobs(self, plans: list[list[MicroBatch]], n_mbs: list[int], attr: str, temperature: float,
                         replay: bool = True):
        """``mb.<attr>`` = the policy's no-grad log-probs of every micro-batch, through its wrapped forward (under
        FSDP2 that gathers the sharded weights, a collective: every rank runs the padded counts ``n_mbs``);
        ``replay``: an MoE policy replays the recorded routing (``model.moe.router_replay``)."""
        policy = no_grad_forward(self.model)
        for mbs, n_mb in zip(plans, n_mbs):
            for i in range(n_mb):
                mb = mbs[min(i, len(mbs) - 1)]
                logp_N = packed_logprobs(policy, mb, temperature, self._routing(mb, replay=replay))
                if i < len(mbs):
                    setattr(mbs[i], attr, logp_N)

    def _routing(self, mb: MicroBatch, *, train: bool = False, replay: bool = True):
        """An MoE policy's routing of one forward of ``mb`` (``MoEUpdate.routing``); None for a dense one."""
        return None if self.moe is None else self.moe.routing(mb, train=train, replay=replay)

    def _loss(self, mb: MicroBatch, tokens: float, seqs: float, beta: float, epsilon_high: float | None,
              max_new_tokens: int, micro_batches: float = 1.0, weight: float = 1.0):
        """One micro-batch's re-weighted loss and its metrics.

        On-policy (one optimizer step per rollout, ``mb.old_logprobs`` None) the loss's own log-probs are also the
        old ones (ratio 1, as TRL). The engine's log-probs go in as ``sampling_logprobs``: the loss measures the
        training–inference gap against the old log-probs (``sampling/sampling_logp_difference/{mean,max}``, from
        the loss's own pass over the vocabulary, not a second no-grad one) and, with ``grpo.rollout_is``, corrects
        it by importance sampling (``sampling/importance_sampling_ratio/{min,mean,max}``,
        ``sampling/is_clipped_fraction``). An MoE policy's loss also gets the router's load-balancing term, one of
        ``micro_batches`` (``fastgrpo.algorithms.moe``; none for a padding copy, ``weight`` 0).
        """
        routing = self._routing(mb, train=weight > 0)
        hidden_NH, weight_VH, bias_V = forward_packed(self.model, mb, routing)
        loss, metrics = self._policy_loss(mb, hidden_NH, weight_VH, bias_V, tokens, beta, epsilon_high,
                                          max_new_tokens)
        loss = self._reweight(loss, mb, tokens, seqs)
        return (loss if self.moe is None else loss + self.moe.aux_term(routing, micro_batches)), metrics

    def _policy_loss(self, mb: MicroBatch, hidden_NH, weight_VH, bias_V, tokens: float, beta: float,
                     epsilon_high: float | None, max_new_tokens: int):
        """``fused_linear_grpo_loss`` of one micro-batch from the policy's hidden states (not re-weighted)."""
        options = self._options_at(beta, epsilon_high, max_new_tokens)
        return fused_linear_grpo_loss(
            hidden_NH, weight_VH, mb.targets, mb.old_logprobs, mb.advantages, mb.mask, bias=bias_V,
            temperature=self.cfg.rollout.temperature, return_entropy=True, ref_logprobs=mb.ref_logprobs,
            num_items_in_batch=tokens if options.reduction == "dapo" else None, cu_seqlens=mb.batch.cu_seqlens,
            per_token_advantages=mb.per_token_advantages, sampling_logprobs=mb.sample_logprobs, options=options,
        )

    def _options_at(self, beta: float, epsilon_high: float | None, max_new_tokens: int) -> GRPOLossOptions:
        """:attr:`options` with a stage's β, ε_high and ``max_completion_length = max_new_tokens``, built once per
        settings."""
        key = (beta, epsilon_high, max_new_tokens)
        if key not in self._stage_options:
            self._stage_options[key] = dataclasses.replace(self.options, beta=beta, epsilon_high=epsilon_high,
                                                           max_completion_length=max_new_tokens)
        return self._stage_options[key]

    def _reweight(self, loss: torch.Tensor, mb: MicroBatch, tokens: float, seqs: float) -> torch.Tensor:
        """A micro-batch's loss, aggregated over its own tokens or sequences, as its share of the optimizer step's
        (module docstring); dapo's is already normalised by the global token count."""
        reduction = self.options.reduction
        if reduction == "bnpo":
            return loss * mb.num_loss_tokens / tokens
        if reduction in ("grpo", "dr_grpo"):
            return loss * mb.num_seqs / seqs
        return loss


def loss_options(cfg: Config) -> GRPOLossOptions:
    """The loss options of ``cfg``: the ``grpo`` group's, with β, ε_high and ``max_completion_length``
    (``rollout.max_new_tokens``) of the base settings; a stage's settings replace those three."""
    g = cfg.grpo
    return GRPOLossOptions(
        beta=g.beta, epsilon_low=g.epsilon_low, epsilon_high=g.epsilon_high, delta=g.delta, dual_clip_c=g.dual_clip_c,
        loss_type=g.loss_type, importance_sampling_level=g.importance_sampling_level,
        max_completion_length=cfg.rollout.max_new_tokens, rollout_is=g.rollout_is, rollout_is_cap=g.rollout_is_cap,
        rollout_is_min=g.rollout_is_min, kl_estimator=g.kl_estimator, kl_weight=g.kl_weight,
        kl_input_clamp=g.kl_input_clamp, kl_output_clamp=g.kl_output_clamp,
        sapo_temperature_pos=g.sapo_temperature_pos, sapo_temperature_neg=g.sapo_temperature_neg,
        off_policy_mask_threshold=g.off_policy_mask_threshold,
    )
