"""GRPO's update of a mixture-of-experts policy (Qwen3-MoE, :mod:`fastgrpo.models.moe`): the routing of each packed
forward, the router's load-balancing loss and the router-replay metrics (:class:`MoEUpdate`, held by
``fastgrpo.algorithms.update.PolicyUpdate``).

**Load-balancing loss** (TRL's GRPOTrainer, ``router_aux_loss_coef``; transformers' ``load_balancing_loss_func``): each
policy micro-batch's forward keeps every MoE layer's router logits and adds

    coef · aux_mb / M        aux_mb = E · Σ_e f_e P_e over the micro-batch's tokens (all real: no padding)

to its loss, M the real micro-batches of the optimizer step over all ranks, so the step's gradient is that of
``coef · mean(aux)`` over its micro-batches, TRL's ``coef · aux / gradient_accumulation_steps`` per micro-batch (its
ranks hold equal counts) before DDP's mean. ``coef`` is ``model.moe.router_aux_loss_coef``, else the model config's
(0.001 in Qwen3-MoE's; 0 turns it off). Logged: ``moe/aux_loss``, the mean of ``aux_mb`` (TRL's ``aux_loss``), so the
term added is ``coef`` times the logged number. SFT, DPO and distillation forwards route without it (as they do
without replay).

**Router replay** (``model.moe.router_replay``): the old-policy, reference and policy forwards replay each sample's
``Completion.routing`` (:class:`fastgrpo.models.moe.MoERouting`): R3, the weights from the current router. Logged:
``moe/replay_mismatch``, the fraction of replayed (token, MoE layer) pairs whose current top-K set differs from the
replayed one, over the policy forwards of the rollout; with ``model.moe.replay_gap`` also the engine-vs-trainer gap
without replay, ``moe/no_replay_logp_difference/{mean,max}`` (``|log π − log π_sampler|`` over the trained tokens of
the first optimizer step, before any update, by one no-grad forward that routes afresh), next to the loss's
``sampling/sampling_logp_difference/{mean,max}``, which is the gap with replay.
"""

from __future__ import annotations

import math

import torch

from fastgrpo.config import Config
from fastgrpo.models.moe import MoERouting

METRICS = ("moe/aux_loss", "moe/replay_mismatch")
GAP_METRICS = ("moe/no_replay_logp_difference/mean", "moe/no_replay_logp_difference/max")


class MoEUpdate:
    """The MoE part of one policy's updates (module docstring); ``model``: the unwrapped MoE causal LM."""

    def __init__(self, cfg: Config, model):
        moe, config = cfg.model.moe, model.config
        self.coef = config.router_aux_loss_coef if moe.router_aux_loss_coef is None else moe.router_aux_loss_coef
        self.replay = moe.router_replay
        self.gap = moe.replay_gap
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.sums: dict[str, torch.Tensor | float] = {}

    def routing(self, mb, *, train: bool = False, replay: bool = True) -> MoERouting | None:
        """The routing of one forward of ``mb``: its samples' recorded experts (when replaying), the router logits
        kept for the load-balancing loss (a policy forward with gradients, ``train``); None: the router as it is."""
        ids = mb.routing if self.replay and replay else None
        keep = train and self.coef > 0
        return MoERouting(ids, keep) if ids is not None or keep else None

    def aux_term(self, routing: MoERouting | None, micro_batches: float) -> torch.Tensor | float:
        """``coef · aux / M`` of a policy forward's routing (module docstring); its aux and replay counts are
        kept for :meth:`metrics`."""
        if routing is None:
            return 0.0
        if routing.differ is not None:
            self._add("differ", routing.differ)
            self._add("compared", routing.compared)
        if not routing.keep_logits:
            return 0.0
        aux = routing.aux_loss(self.num_experts, self.top_k)
        self._add("aux", aux.detach())
        self._add("aux_count", 1.0)
        return self.coef * aux / micro_batches

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

    def _add(self, key: str, value) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
