"""Reward-model training on the trainer's loop (``algorithm: rm``): Bradley-Terry on preference pairs, TRL
RewardTrainer's loss.

The data are DPO's (``fastgrpo.data.responses``: the same pair formats and columns, the synthetic task's pairs, the
held-out split), with TRL's optional ``margin`` column. The model is the policy's architecture with a scalar head
(:mod:`fastgrpo.models.reward_model`): ``r(x, y)`` is the head on the final hidden state of the sequence's last
non-padding token (Hugging Face's pooling). Per step, over the step's B pairs (``rm.batch_size``, all ranks), with
``r_c`` / ``r_r`` the rewards of prompt + chosen / prompt + rejected and ``m`` the margin (0 without the column)::

    loss = mean_b −log σ(r_c − r_r − m)  +  λ · mean_b (r_c + r_r)²        λ = rm.center_rewards_coefficient

exactly TRL's ``RewardTrainer.compute_loss`` (its ``center_rewards_coefficient`` term included: the mean over the
pairs of the squared sum, which pulls the rewards towards zero mean). Pairs are packed whole, padding-free, into
varlen micro-batches of at most ``train.max_tokens_per_microbatch`` tokens (the B_mb chosen sequences, then the B_mb
rejected ones: ``dpo.plan_pairs``); one packed forward scores all 2·B_mb sequences; each micro-batch's loss (a mean
over its pairs) is re-weighted by ``B_mb / B`` (and by ``world_size``, since DDP averages gradients), so the
micro-batches and ranks sum to the mean over the step's pairs: W processes equal one on the same pairs.

Metrics, means over the step's pairs (TRL's names where it has them): ``loss``, ``accuracy`` (share of pairs with
``r_c > r_r``; a tie counts as wrong, as TRL's), ``margin`` (mean ``r_c − r_r``, the margin column not subtracted, as
TRL's), ``rewards/chosen`` and ``rewards/rejected`` (mean ``r_c``, ``r_r``), and TRL's ``mean_reward``,
``min_reward``, ``max_reward`` over all 2B scores. Validation on the held-out pairs logs ``eval/loss``,
``eval/preference_accuracy`` (``accuracy`` there: the pair accuracy, DPO's name) and ``eval/margin``. No generation:
the trainer builds no engine for this algorithm.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from fastgrpo.algorithms.batch import same_count
from fastgrpo.algorithms.context import AlgorithmContext
from fastgrpo.algorithms.dpo import DPO, pair_examples, plan_pairs
from fastgrpo.algorithms.forward import no_grad_forward
from fastgrpo.algorithms.prerequisites import no_prerequisites
from fastgrpo.algorithms.update import clip_and_step
from fastgrpo.data.responses import PreferencePair, load_response_datasets
from fastgrpo.distributed import all_reduce, print0
from fastgrpo.models.packing import PackedBatch, pack
from fastgrpo.models.reward_model import build_reward_model, packed_scores
from fastgrpo.precision import accumulate, train_mode

MEAN_METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected", "mean_reward")
"""Means over pairs (summed over micro-batches and ranks, weighted by their pairs)."""


def reward_loss(chosen_B: torch.Tensor, rejected_B: torch.Tensor, margin_B: torch.Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Bradley-Terry loss of B pairs' rewards (module docstring: TRL RewardTrainer's) and its metrics (fp32
    0-d tensors, means over the B pairs, no grad), plus ``min_reward`` / ``max_reward``."""
    diff_B = chosen_B.float() - rejected_B.float()  # [B]
    loss = -F.logsigmoid(diff_B - margin_B if margin_B is not None else diff_B).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen_B.float() + rejected_B.float()) ** 2).mean()
    with torch.no_grad():
        both = torch.cat([chosen_B, rejected_B]).float()  # [2B]
        metrics = {"accuracy": (diff_B > 0).float().mean(), "margin": diff_B.mean(),
                   "rewards/chosen": chosen_B.float().mean(), "rewards/rejected": rejected_B.float().mean(),
                   "mean_reward": both.mean(), "min_reward": both.min(), "max_reward": both.max()}
    return loss, metrics


def pair_batch(pairs: list[PreferencePair], device: torch.device) -> tuple[PackedBatch, torch.Tensor]:
    """``pairs`` packed (every prompt + chosen, then every prompt + rejected) on ``device``, and their ``[B]``
    margins."""
    batch = pack([ex.input_ids for ex in pair_examples(pairs)]).to(device)
    return batch, torch.tensor([p.margin for p in pairs], dtype=torch.float32, device=device)


def score_pairs(model, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B], [B])`` the chosen and rejected rewards of a :func:`pair_batch` (``model``: a module whose call is
    :func:`fastgrpo.models.reward_model.packed_scores`)."""
    scores_2B = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
    return scores_2B.chunk(2)


class RM:
    """``algorithm: rm`` on ``train.py``'s loop (module docstring)."""

    progress = {"loss": "loss", "acc": "accuracy"}
    prerequisites = staticmethod(no_prerequisites)
    load_model = staticmethod(build_reward_model)
    """The trainer builds the model with it (a scalar head, not an LM head)."""
    forward = staticmethod(packed_scores)
    """The wrapped model's forward."""
    generates = False
    """The trainer builds no generation engine."""

    @staticmethod
    def check_world_size(cfg, world_size: int) -> None:
        if cfg.rm.batch_size % world_size:
            raise ValueError(f"rm.batch_size={cfg.rm.batch_size} must be a multiple of the number of processes "
                             f"({world_size})")

    def __init__(self, ctx: AlgorithmContext):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.train_data, self.held_out, _ = load_response_datasets(self.cfg.data, ctx.tokenizer, "dpo")

    @property
    def rows_per_step(self) -> int:
        return self.cfg.rm.batch_size

    describe_data = DPO.describe_data  # the same pairs, the same start-up line

    def begin(self) -> None:
        """Nothing to prepare: the reward model trains from its initial weights."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing beyond the weights, optimizer and data position."""

    def _microbatches(self, pairs: list[PreferencePair], indices: list[int]):
        """``[((pair indices, batch, margins), weight)]``: ``pairs`` (numbered ``indices``) packed, padded to the same
        count on every rank (weight 0 on stand-ins; with no pair, a stand-in of the first training pair)."""
        st = self.ctx.state
        groups = plan_pairs(pairs, self.cfg.train.max_tokens_per_microbatch)
        mbs = [([indices[j] for j in g], *pair_batch([pairs[j] for j in g], st.device)) for g in groups]
        return same_count(mbs or [([], *pair_batch(self.train_data.items[:1], st.device))], st.device)

    def _loss(self, model, batch: PackedBatch, margin_B: torch.Tensor):
        chosen_B, rejected_B = score_pairs(model, batch)
        return reward_loss(chosen_B, rejected_B, margin_B, self.cfg.rm.center_rewards_coefficient)

    def step(self, indices: list[int], settings: dict) -> dict[str, float]:
        t, st = self.ctx, self.ctx.state
        per_rank = len(indices) // st.world_size
        mine = indices[st.rank * per_rank : (st.rank + 1) * per_rank]
        keys = ("loss", *MEAN_METRICS)
        sums = torch.zeros(len(keys) + 1, dtype=torch.float64, device=st.device)  # Σ B_mb · value, then tokens
        extremes = torch.tensor([math.inf, math.inf], dtype=torch.float64, device=st.device)  # min, −max
        with t.updating():
            t.optimizer.zero_grad(set_to_none=True)
            padded = self._microbatches([self.train_data.items[i] for i in mine], mine)
            for i, ((idx, batch, margin_B), weight) in enumerate(padded):
                with train_mode(t.wrapped), accumulate(t.wrapped, t.optimizer, last=i == len(padded) - 1):
                    loss, metrics = self._loss(t.wrapped, batch, margin_B)
                    (loss * (weight * len(idx) * st.world_size / len(indices))).backward()
                values = torch.stack([loss.detach(), *(metrics[k] for k in keys[1:])]).double()
                sums[:-1] += values * (weight * len(idx))
                sums[-1] += float(batch.num_tokens) * weight
                if weight:
                    extremes = torch.minimum(extremes, torch.stack([metrics["min_reward"],
                                                                    -metrics["max_reward"]]).double())
            *totals, tokens = all_reduce(sums).tolist()  # sync: once per step, the loss and the log row
            low, neg_high = all_reduce(extremes, "min").tolist()
            m = {k: v / len(indices) for k, v in zip(keys, totals)}
            grad_norm, stepped = clip_and_step(t.optimizer, t.scheduler, self.cfg.train.max_grad_norm, m["loss"])
        if not stepped:
            m["loss"] = math.nan
        m.update({"min_reward": low, "max_reward": -neg_high, "grad_norm": grad_norm if stepped else math.nan,
                  "tokens": tokens, "bad_steps": float(not stepped)})
        return m

    @torch.no_grad()
    def _eval_pairs(self) -> dict[str, float]:
        t, st = self.ctx, self.ctx.state
        mine = list(range(st.rank, len(self.held_out), st.world_size))
        padded = self._microbatches([self.held_out.items[i] for i in mine], mine)
        sums = torch.zeros(3, dtype=torch.float64, device=st.device)
        model = no_grad_forward(t.wrapped)
        for (idx, batch, margin_B), weight in padded:  # stand-ins too (weight 0): FSDP2's collectives
            loss, metrics = self._loss(model, batch, margin_B)
            sums += torch.stack([loss, metrics["accuracy"], metrics["margin"]]).double() * (weight * len(idx))
        loss, acc, margin = (all_reduce(sums) / len(self.held_out)).tolist()  # sync: once per validation
        return {"eval/loss": loss, "eval/preference_accuracy": acc, "eval/margin": margin}

    def validate(self) -> dict[str, float]:
        if self.held_out is None:
            return {}
        start = time.perf_counter()
        m = self._eval_pairs()
        m["time/eval_pairs"] = time.perf_counter() - start
        print0(f"step {self.ctx.step}: eval/loss {m['eval/loss']:.4f}, eval/preference_accuracy "
               f"{m['eval/preference_accuracy']:.3f}, eval/margin {m['eval/margin']:.3f} on {len(self.held_out)} "
               "held-out pairs")
        return m
