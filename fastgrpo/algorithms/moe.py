"""A mixture-of-experts policy's training (Qwen3-MoE, Qwen2-MoE, :mod:`fastgrpo.models.moe`): the router's
load-balancing loss in every algorithm that trains it (:class:`RouterAuxLoss`: SFT and its warm-up, DPO, distillation,
GRPO) and GRPO's routing of each packed forward with the router-replay metrics (:class:`MoEUpdate`, held by
``fastgrpo.algorithms.update.PolicyUpdate``).

**Load-balancing loss** (transformers' ``load_balancing_loss_func``, ``router_aux_loss_coef``; TRL adds it to the loss
of each training forward when the model is an MoE and the coefficient is not 0, its ``aux_loss_enabled``): each
training micro-batch's forward keeps every MoE layer's router logits and adds

    coef · aux_mb / M        aux_mb = E · Σ_e f_e P_e over the micro-batch's tokens (all real: no padding)

to its loss, M the real micro-batches of the optimizer step over all ranks, so the step's gradient is that of
``coef · mean(aux)`` over its micro-batches whatever their sizes, the ranks and the algorithm. ``aux_mb`` itself is
not a sum over tokens: another packing (``train.max_tokens_per_microbatch``, the number of ranks) gives other terms,
as TRL's depend on its per-device batch size. ``coef`` is
``model.moe.router_aux_loss_coef``, else the model config's (0.001 in Qwen3-MoE's and Qwen2-MoE's; 0 turns it off).
Logged: ``moe/aux_loss``, the mean of ``aux_mb`` over the step's micro-batches (TRL's ``aux_loss``), and the step's
``loss`` includes the term, as TRL's does. Against TRL (huggingface/trl @f2cd577, ``trl/trainer/grpo_trainer.py``,
``dpo_trainer.py``, ``sft_trainer.py``), per trainer:

- GRPOTrainer (and distillation, whose update is GRPO's): ``coef · aux / gradient_accumulation_steps`` per
  micro-batch, its ranks holding equal counts: the same mean.
- DPOTrainer: ``loss + coef · aux`` per micro-batch, divided by the accumulation steps by the Trainer (its
  ``model_accepts_loss_kwargs`` is False): the same mean.
- SFTTrainer: ``coef · aux`` added by the forward to a token-normalised cross-entropy that the Trainer neither divides
  by the accumulation steps nor averages over ranks (it multiplies by the process count before DDP's mean): the sum
  over micro-batches and ranks. fastgrpo takes the mean there too, so the coefficient means one thing in every
  algorithm and no term grows with the number of micro-batches (one micro-batch on one process: the same number).
- The no-grad forwards (old-policy, reference, DPO's reference table, validation's ``eval/loss``) add nothing.

**Router replay** (``model.moe.router_replay``, GRPO): the old-policy, reference and policy forwards replay each
sample's ``Completion.routing`` (:class:`fastgrpo.models.moe.MoERouting`): R3, the weights from the current router.
Logged: ``moe/replay_mismatch``, the fraction of replayed (token, MoE layer) pairs whose current top-K set differs from
the replayed one, over the policy forwards of the rollout; with ``model.moe.replay_gap`` also the engine-vs-trainer gap
without replay, ``moe/no_replay_logp_difference/{mean,max}`` (``|log π − log π_sampler|`` over the trained tokens of
the first optimizer step, before any update, by one no-grad forward that routes afresh), next to the loss's
``sampling/sampling_logp_difference/{mean,max}``, which is the gap with replay.
"""

from __future__ import annotations

import math

import torch

from fastgrpo.config import Config
from fastgrpo.models.moe import MoERouting, is_moe

METRICS = ("moe/aux_loss", "moe/replay_mismatch")
GAP_METRICS = ("moe/no_replay_logp_difference/mean", "moe/no_replay_logp_difference/max")


class RouterAuxLoss:
    """The load-balancing term of an MoE policy's training forwards (module docstring); ``model``: the unwrapped MoE
    causal LM."""

    def __init__(self, cfg: Config, model):
        moe, config = cfg.model.moe, model.config
        self.coef = config.router_aux_loss_coef if moe.router_aux_loss_coef is None else moe.router_aux_loss_coef
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.sums: dict[str, torch.Tensor | float] = {}

    def training_routing(self, train: bool) -> MoERouting | None:
        """The routing of one forward: the router logits kept for the load-balancing loss in a training forward
        (``train``: a real micro-batch with gradients); None: the router as it is."""
        return MoERouting(keep_logits=True) if train and self.coef > 0 else None

    def aux_term(self, routing: MoERouting | None, micro_batches: float) -> torch.Tensor | float:
        """``coef · aux / M`` of a training forward's routing (module docstring); its aux is kept for the metric."""
        if routing is None or not routing.keep_logits:
            return 0.0
        aux = routing.aux_loss(self.num_experts, self.top_k)
        self._add("aux", aux.detach())
        self._add("aux_count", 1.0)
        return self.coef * aux / micro_batches

    def totals(self, device: torch.device) -> torch.Tensor:
        """``[2]`` fp64: this rank's summed aux and its count since the last call (for one all-reduce with a step's
        other sums), then reset."""
        s, self.sums = self.sums, {}
        return torch.stack([torch.as_tensor(s.get(k, 0.0), device=device).double() for k in ("aux", "aux_count")])

    def step_result(self, aux_sum: float, count: float) -> tuple[float, dict[str, float]]:
        """From a step's all-ranks :meth:`totals`: the term its loss got, ``coef · mean(aux)``, and ``moe/aux_loss``
        (0 and NaN when no forward kept logits)."""
        if count <= 0:
            return 0.0, {METRICS[0]: math.nan}
        return self.coef * aux_sum / count, {METRICS[0]: aux_sum / count}

    def _add(self, key: str, value) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value


def router_aux_loss(cfg: Config, model) -> RouterAuxLoss | None:
    """The load-balancing term of ``model`` (unwrapped) when it is an MoE with a coefficient above 0 (TRL's
    ``aux_loss_enabled``), else None."""
    aux = RouterAuxLoss(cfg, model) if is_moe(model) else None
    return aux if aux is not None and aux.coef > 0 else None


class MoEUpdate(RouterAuxLoss):
    """GRPO's MoE part of one policy's updates (module docstring): the load-balancing term and router replay."""

    def __init__(self, cfg: Config, model):
        super().__init__(cfg, model)
        moe = cfg.model.moe
        self.replay = moe.router_replay
        self.gap = moe.replay_gap

    def routing(self, mb, *, train: bool = False, replay: bool = True) -> MoERouting | None:
        """The routing of one forward of ``mb``: its samples' recorded experts (when replaying), the router logits
        kept for the load-balancing loss (a policy forward with gradients, ``train``); None: the router as it is."""
        ids = mb.routing if self.replay and replay else None
        keep = train and self.coef > 0
        return MoERouting(ids, keep) if ids is not None or keep else None

    def aux_term(self, routing: MoERouting | None, micro_batches: float) -> torch.Tensor | float:
        """``coef · aux / M`` of a policy forward's routing (module docstring); its aux and replay counts are
        kept for :meth:`metrics`."""
        if routing is not None and routing.differ is not None:
            self._add("differ", routing.differ)
            self._add("compared", routing.compared)
        return super().aux_term(routing, micro_batches)

    def no_replay_gap(self, fresh_N: torch.Tensor, mb) -> None:
        """One micro-batch's gap without replay: ``|fresh − sampler|`` over its trained tokens."""
        mask = mb.mask != 0
        diff = torch.where(mask, (fresh_N - mb.sample_logprobs).abs(), 0.0)
        self._add("gap", diff.sum())
        self._add("gap_count", mask.sum())
        self.sums["gap_max"] = torch.maximum(self.sums["gap_max"], diff.max()) if "gap_max" in self.sums else diff.max()

    def metrics(self) -> dict[str, float]:
        """The rollout's metrics (NaN where nothing was measured: every rank has the same keys), then reset."""
        s, self.sums = self.sums, {}

        def ratio(a, b):
            return float(s[a]) / float(s[b]) if float(s.get(b, 0.0)) > 0 else math.nan

        out = {METRICS[0]: ratio("aux", "aux_count"), METRICS[1]: ratio("differ", "compared")}
        if self.gap:
            out.update({GAP_METRICS[0]: ratio("gap", "gap_count"),
                        GAP_METRICS[1]: float(s["gap_max"]) if "gap_max" in s else math.nan})
        return out
