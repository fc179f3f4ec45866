"""Direct preference optimisation on the trainer's loop (``algorithm: dpo``).

One step takes ``dpo.batch_size`` preference pairs (all ranks together; each rank its share). A pair is two
sequences, prompt + chosen and prompt + rejected. Pairs are packed whole, padding-free, into the same kind of
varlen micro-batches as GRPO (at most ``train.max_tokens_per_microbatch`` tokens; config.py requires two
``data.max_length`` sequences to fit one): a micro-batch of B pairs holds the B chosen sequences, then the B
rejected ones in the same order (``fused_linear_dpo_loss``'s layout). The loss mask covers the response tokens.

Per micro-batch, ``fused_linear_dpo_loss`` computes the sequence log-probs ``π = Σ_t mask_t log p(y_t)`` straight
from the last hidden state and the LM head weight (``fused_linear_logprobs``: no ``[N, V]`` logits, forward or
backward) and the loss (``kernels/dpo_loss.py`` states the math: sigmoid / ipo / hinge, label smoothing, the
per-token average of ``dpo.average_logprobs``, the NLL term of ``dpo.sft_weight``), which is a mean over the
micro-batch's pairs. Re-weighted by ``B_mb / B_step`` (and by ``world_size``, since DDP averages gradients), the
micro-batches and ranks sum to the mean over the step's pairs: W processes equal one on the same pairs. A
mixture-of-experts policy's loss also gets the router's load-balancing term, ``coef · aux_mb / M`` per real
micro-batch (TRL's DPOTrainer: ``loss + coef · aux`` per micro-batch, averaged over its accumulation steps;
``fastgrpo.algorithms.moe``), logged as ``moe/aux_loss``; the reference's and validation's forwards add nothing.

The reference is the policy as DPO starts: ``model.path`` as loaded, or the model after the supervised warm-up
(``sft.warmup_steps``) when one runs. With ``dpo.precompute_ref_logprobs`` (the default) the reference's sequence
log-probs of every training and held-out pair are computed once, before the first step, by no-grad packed
forwards of that policy, and kept in the algorithm's state (two fp32 numbers per pair, saved with every
checkpoint, so a resume never recomputes them).

The table is computed by the very function the loss uses (``fused_linear_dpo_loss``, its ``return_logps``), on
the very micro-batches the steps will train: the sampler's schedule is replayed from the first DPO step until
every training pair has appeared, and each pair's entry comes from the micro-batch of its first step (held-out
pairs: from validation's micro-batches). This matters because a token's log-prob is not a function of the token
alone on every backend: where the matmul behind a kernel gives a row a result that depends on its position in
the block (numpy's OpenBLAS with its Haswell/Zen kernels, which ``tl.dot`` runs on under ``TRITON_INTERPRET=1``,
rounds a row differently when the other rows move), packing a pair with other pairs moves its log-prob by
rounding (2.4e-8 of a reward at β = 0.1, enough to flip ``rewards/accuracies``). With the same layout, the same
forward and the same kernel, the first step's policy log-probs equal the table bit for bit, so every implicit
reward is exactly 0 there, on every path. From the second step on the policy has moved and no such identity is
asked for. Otherwise a frozen copy of the starting policy (a second set of
weights on every rank: 3 GB for a 1.5B model in bf16) computes them in every step; when the warm-up changed the
weights, that copy is also written to ``<run dir>/dpo_reference.safetensors`` for a resume.
With ``model.lora`` the reference is the base, the policy with its adapters disabled (``fastgrpo.models.lora``; TRL's
convention with PEFT), in both modes, with no copy (with ``model.lora.path``: the base, not that adapter).

Metrics (TRL's names): ``loss``, ``rewards/chosen`` = mean β(π_c − ref_c), ``rewards/rejected``,
``rewards/accuracies`` (share of pairs with the chosen reward above the rejected one), ``rewards/margins``,
``logps/chosen``, ``logps/rejected`` (the policy's sequence log-probs; per token with ``dpo.average_logprobs``),
``nll_loss`` when ``dpo.sft_weight > 0``, all means over the step's pairs. Validation on the held-out pairs logs
``eval/loss`` and ``eval/preference_accuracy`` (``rewards/accuracies`` there), and avg@k as ``eval/accuracy`` on the
synthetic task's held-out prompts.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from pathlib import Path

import torch

from fastgrpo.algorithms.batch import LMBatch, lm_batch, same_count
from fastgrpo.algorithms.context import AlgorithmContext
from fastgrpo.algorithms.forward import forward_packed, no_grad_forward, packed_forward
from fastgrpo.algorithms.moe import router_aux_loss
from fastgrpo.algorithms.prerequisites import no_prerequisites
from fastgrpo.algorithms.update import clip_and_step
from fastgrpo.data.responses import PreferencePair, SFTExample, load_response_datasets
from fastgrpo.distributed import (
    ForwardWrapper,
    all_reduce,
    broadcast_object,
    full_state_dict,
    is_fsdp,
    print0,
    unwrap_model,
)
from fastgrpo.kernels.dpo_loss import fused_linear_dpo_loss
from fastgrpo.models.lora import adapters_disabled, is_lora
from fastgrpo.models.packing import plan_microbatches
from fastgrpo.precision import accumulate, train_mode

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
REFERENCE_FILE = "dpo_reference.safetensors"


def pair_examples(pairs: list[PreferencePair]) -> list[SFTExample]:
    """The 2B sequences of ``pairs``: every prompt + chosen, then every prompt + rejected; the responses trained."""
    out = []
    for side in ("chosen_ids", "rejected_ids"):
        for p in pairs:
            resp = getattr(p, side)
            out.append(SFTExample(p.prompt_ids + resp, [False] * len(p.prompt_ids) + [True] * len(resp)))
    return out


def plan_pairs(pairs: list[PreferencePair], max_tokens: int) -> list[list[int]]:
    """Micro-batches of whole pairs (both sequences), at most ``max_tokens`` tokens each."""
    return plan_microbatches([2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs],
                             max_tokens)


@torch.no_grad()
def sequence_logps(model, mb: LMBatch) -> torch.Tensor:
    """``[2B]`` fp32 sums of the response tokens' log-probs under ``model`` (a packed-forward module), no grad:
    the policy's own path (``fused_linear_dpo_loss``, the same forward and kernel), so that the same weights on
    the same micro-batch give the policy's numbers bit for bit."""
    hidden_NH, weight_VH, bias_V = forward_packed(model, mb)
    zeros_B = torch.zeros(mb.batch.num_seqs // 2, device=hidden_NH.device)  # [B]
    return fused_linear_dpo_loss(hidden_NH, weight_VH, mb.targets, mb.mask, zeros_B, zeros_B, bias=bias_V,
                                 cu_seqlens=mb.batch.cu_seqlens, return_logps=True)[2]


class DPO:
    """``algorithm: dpo`` on ``train.py``'s loop (module docstring)."""

    progress = {"loss": "loss", "acc": "rewards/accuracies"}
    prerequisites = staticmethod(no_prerequisites)

    @staticmethod
    def check_world_size(cfg, world_size: int) -> None:
        if cfg.dpo.batch_size % world_size:
            raise ValueError(f"dpo.batch_size={cfg.dpo.batch_size} must be a multiple of the number of processes "
                             f"({world_size})")

    def __init__(self, ctx: AlgorithmContext):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.train_data, self.held_out, self.held_out_prompts = load_response_datasets(
            self.cfg.data, ctx.tokenizer, "dpo")
        self.ref_tables: dict[str, torch.Tensor | None] = {}  # split → [n, 2] (chosen, rejected) fp32 sums
        self.ref_forward = None  # the frozen reference model (on the fly), as a packed-forward module
        self.reference_saved = False
        self.base_reference = is_lora(ctx.model)  # LoRA: the reference is the policy, adapters disabled
        self.aux = router_aux_loss(self.cfg, ctx.model)  # an MoE policy's load-balancing term, else None

    @property
    def rows_per_step(self) -> int:
        return self.cfg.dpo.batch_size

    def describe_data(self) -> str:
        out = f"{len(self.train_data)} preference pairs{self.train_data.describe()}"
        if self.held_out is not None:
            out += f", {len(self.held_out)} held-out{self.held_out.describe()}"
        return out

    def warmup_examples(self):
        """The warm-up trains on each prompt followed by its chosen response."""
        return pair_examples(self.train_data.items)[: len(self.train_data)], [p.chosen_ids for p in
                                                                               self.train_data.items]

    # ------------------------------------------------------------------ the reference

    def _splits(self) -> dict[str, list[PreferencePair]]:
        out = {"train": self.train_data.items}
        if self.held_out is not None:
            out["eval"] = self.held_out.items
        return out

    def _rank_share(self, indices: list[int]) -> list[int]:
        """This rank's pairs of a step's ``indices`` (consecutive equal shares)."""
        st = self.ctx.state
        per_rank = len(indices) // st.world_size
        return indices[st.rank * per_rank : (st.rank + 1) * per_rank]

    def _step_schedule(self) -> list[list[int]]:
        """The training pairs of the coming steps, replayed on a copy of the run's sampler (``ctx.sampler``), until
        every pair has appeared once (one epoch, plus the rest of the step that ends it)."""
        sampler, seen, steps = copy.deepcopy(self.ctx.sampler), set(), []
        while len(seen) < len(self.train_data):
            steps.append(sampler.next(self.rows_per_step))
            seen.update(steps[-1])
        return steps

    def _layouts(self, split: str):
        """``(owner, padded)`` per step that will use pairs of ``split``: this rank's micro-batches of that step
        and, for each pair no earlier step held, the rank whose share holds its first occurrence. Held-out pairs:
        validation's one layout (rank r holds pairs r, r + W, ...)."""
        st = self.ctx.state
        if split != "train":
            yield {i: i % st.world_size for i in range(len(self.held_out))}, self._eval_microbatches()
            return
        done: set[int] = set()
        for indices in self._step_schedule():
            per_rank = len(indices) // st.world_size
            owner = {}
            for pos, i in enumerate(indices):
                if i not in done:
                    owner.setdefault(i, pos // per_rank)
            done.update(indices)
            mine = self._rank_share(indices)
            yield owner, self._microbatches([self.train_data.items[i] for i in mine], mine)

    @torch.no_grad()
    def _table(self, split: str) -> torch.Tensor:
        """``[n, 2]`` reference sums of every pair of ``split``, computed by the current policy on the
        micro-batches that will use them (module docstring). Each entry is written by exactly one rank, then the
        table is summed over ranks."""
        st = self.ctx.state
        table = torch.zeros(len(self._splits()[split]), 2, device=st.device)
        policy = no_grad_forward(self.ctx.wrapped)
        with self._as_reference():
            self._fill_table(table, policy, split)
        return all_reduce(table).cpu()

    def _as_reference(self):
        """The policy's forwards compute the reference's log-probs in the block: with LoRA, adapters disabled."""
        return adapters_disabled(self.ctx.model) if self.base_reference else contextlib.nullcontext()

    def _fill_table(self, table: torch.Tensor, policy, split: str) -> None:
        st = self.ctx.state
        for owner, padded in self._layouts(split):
            for (idx, mb), weight in padded:
                logps = sequence_logps(policy, mb)  # [2B]; stand-ins (no pair of this rank) too, for FSDP2
                new = [j for j, i in enumerate(idx) if weight and owner.get(i) == st.rank]
                for j in new:
                    if owner.pop(idx[j], None) is not None:  # a repeat in the same share is not written twice
                        table[idx[j]] = torch.stack(logps.chunk(2), 1)[j]

    def _reference_model(self, path: Path | None):
        """A frozen copy of the starting policy: model.path loaded again, then the weights at ``path`` or, with
        ``path`` None, the live policy's (after a warm-up)."""
        from safetensors.torch import load_model as load_weights

        from fastgrpo.models.loading import load_model

        st = self.ctx.state
        if self.base_reference:  # no copy: _reference runs the policy with its adapters disabled
            return
        ref, _ = load_model(self.cfg.model, st.device, seed=self.cfg.train.seed)
        if path is not None:
            load_weights(ref, str(path), device=str(st.device))
        elif self.cfg.sft.warmup_steps:
            wrapped = self.ctx.wrapped
            sd = (broadcast_object(full_state_dict(wrapped, st)) if is_fsdp(wrapped)
                  else unwrap_model(wrapped).state_dict())
            ref.load_state_dict(sd)
        ref.requires_grad_(False).eval()
        self.ref_forward = ForwardWrapper(ref, packed_forward)

    def begin(self) -> None:
        """As DPO starts (after the warm-up, on a fresh run): fix the reference."""
        t = self.ctx
        if self.cfg.dpo.precompute_ref_logprobs:
            start = time.perf_counter()
            self.ref_tables = {name: self._table(name) for name in self._splits()}
            print0(f"reference log-probs of {sum(len(p) for p in self._splits().values())} pairs computed in "
                   f"{time.perf_counter() - start:.1f} s")
            return
        self._reference_model(None)
        if self.cfg.sft.warmup_steps and not self.base_reference:  # not model.path: keep it for a resume
            if t.state.is_main:
                from safetensors.torch import save_model

                save_model(self.ref_forward.module, str(t.run_dir / REFERENCE_FILE))
            self.reference_saved = True

    def state_dict(self) -> dict:
        if self.cfg.dpo.precompute_ref_logprobs:
            return {"ref_logps": dict(self.ref_tables)}
        return {"reference_saved": self.reference_saved}

    def load_state_dict(self, state: dict) -> None:
        if self.cfg.dpo.precompute_ref_logprobs:
            tables = state.get("ref_logps")
            if tables is None:
                raise ValueError("the checkpoint holds no reference log-probs (it was saved with "
                                 "dpo.precompute_ref_logprobs=false): resume with the same setting")
            for name, pairs in self._splits().items():
                if name not in tables or tables[name].shape[0] != len(pairs):
                    raise ValueError(f"the checkpoint's reference log-probs do not match the {name} pairs "
                                     f"({len(pairs)}): the data changed since the run started")
            self.ref_tables = tables
            return
        if "reference_saved" not in state:
            raise ValueError("the checkpoint was saved with dpo.precompute_ref_logprobs=true: resume with the "
                             "same setting")
        self.reference_saved = bool(state["reference_saved"])
        path = self.ctx.run_dir / REFERENCE_FILE
        if self.reference_saved and not path.is_file():
            raise ValueError(f"{path} (the DPO reference model after the warm-up) is missing: cannot resume")
        self._reference_model(path if self.reference_saved else None)

    def _reference(self, split: str, idx: list[int], mb: LMBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B], [B])`` reference sums of the micro-batch's pairs ``idx`` of ``split``."""
        if self.ref_forward is not None:
            return sequence_logps(self.ref_forward, mb).chunk(2)
        if self.base_reference and not self.cfg.dpo.precompute_ref_logprobs:
            with torch.no_grad(), self._as_reference():
                return sequence_logps(no_grad_forward(self.ctx.wrapped), mb).chunk(2)
        table = self.ref_tables[split][idx].to(mb.targets.device)  # [B, 2]
        return table[:, 0], table[:, 1]

    # ------------------------------------------------------------------ step and validation

    def _loss(self, model, split: str, idx: list[int], mb: LMBatch, routing=None):
        d = self.cfg.dpo
        ref_c, ref_r = self._reference(split, idx, mb)
        hidden_NH, weight_VH, bias_V = forward_packed(model, mb, routing)
        return fused_linear_dpo_loss(hidden_NH, weight_VH, mb.targets, mb.mask, ref_c, ref_r, bias=bias_V,
                                     beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                                     cu_seqlens=mb.batch.cu_seqlens, average_logprobs=d.average_logprobs,
                                     sft_weight=d.sft_weight)

    def _microbatches(self, pairs: list[PreferencePair], indices: list[int]):
        """``[((pair indices, LMBatch), weight)]``: ``pairs`` (this rank's, numbered ``indices``) packed, padded
        to the same count on every rank (weight 0 on stand-ins; with no pair, a stand-in of the first pair)."""
        st = self.ctx.state
        groups = plan_pairs(pairs, self.cfg.train.max_tokens_per_microbatch)
        mbs = [([indices[j] for j in g], lm_batch(pair_examples([pairs[j] for j in g]), st.device)) for g in groups]
        return same_count(mbs or [([], lm_batch(pair_examples(self.train_data.items[:1]), st.device))], st.device)

    def _eval_microbatches(self):
        """Validation's micro-batches: this rank's share of the held-out pairs (strided)."""
        st = self.ctx.state
        mine = list(range(st.rank, len(self.held_out), st.world_size))
        return self._microbatches([self.held_out.items[i] for i in mine], mine)

    def _keys(self) -> tuple[str, ...]:
        return ("loss", *METRICS) + (("nll_loss",) if self.cfg.dpo.sft_weight > 0 else ())

    def step(self, indices: list[int], settings: dict) -> dict[str, float]:
        t, st = self.ctx, self.ctx.state
        mine = self._rank_share(indices)
        pairs = [self.train_data.items[i] for i in mine]
        keys = self._keys()
        sums = torch.zeros(len(keys) + 1, dtype=torch.float64, device=st.device)  # Σ B_mb · value, then tokens
        aux = self.aux
        with t.updating():
            t.optimizer.zero_grad(set_to_none=True)
            padded = self._microbatches(pairs, mine)
            real = [bool(weight and idx) for (idx, _), weight in padded]  # not a padding copy nor a stand-in
            # sync: an MoE policy's load-balancing term is a mean over the step's real micro-batches, all ranks
            count = float(all_reduce(torch.tensor(float(sum(real)), device=st.device))) if aux else 1.0
            for i, ((idx, mb), weight) in enumerate(padded):
                routing = aux.training_routing(real[i]) if aux else None
                with train_mode(t.wrapped), accumulate(t.wrapped, t.optimizer, last=i == len(padded) - 1):
                    loss, metrics = self._loss(t.wrapped, "train", idx, mb, routing)
                    objective = loss * (weight * len(idx) * st.world_size / len(indices))
                    if aux is not None:
                        objective = objective + aux.aux_term(routing, count) * weight * st.world_size
                    objective.backward()
                values = torch.stack([loss.detach(), *(metrics[k] for k in keys[1:])]).double()
                sums[:-1] += values * (weight * len(idx))
                sums[-1] += float(mb.batch.num_tokens) * weight
            if aux is not None:
                sums = torch.cat([sums, aux.totals(st.device)])
            reduced = all_reduce(sums).tolist()  # sync: once per step, the loss and the log row
            tokens = reduced[len(keys)]
            m = {k: v / len(indices) for k, v in zip(keys, reduced)}
            if aux is not None:  # the aux term's sum and count follow the tokens
                term, aux_metrics = aux.step_result(*reduced[len(keys) + 1 :])
                m["loss"] += term
                m.update(aux_metrics)
            grad_norm, stepped = clip_and_step(t.optimizer, t.scheduler, self.cfg.train.max_grad_norm, m["loss"])
        if not stepped:
            m["loss"] = math.nan
        m.update({"grad_norm": grad_norm if stepped else math.nan, "tokens": tokens, "bad_steps": float(not stepped)})
        return m

    @torch.no_grad()
    def _eval_pairs(self) -> dict[str, float]:
        t, st = self.ctx, self.ctx.state
        padded = self._eval_microbatches()
        sums = torch.zeros(2, dtype=torch.float64, device=st.device)
        model = no_grad_forward(t.wrapped)
        for (idx, mb), weight in padded:
            if not idx:  # a stand-in (this rank has no held-out pair): the forward only, for FSDP2's collectives
                forward_packed(model, mb)
                continue
            loss, metrics = self._loss(model, "eval", idx, mb)
            sums += torch.stack([loss, metrics["rewards/accuracies"]]).double() * (weight * len(idx))
        loss, acc = (all_reduce(sums) / len(self.held_out)).tolist()  # sync: once per validation
        return {"eval/loss": loss, "eval/preference_accuracy": acc}

    def validate(self) -> dict[str, float]:
        t = self.ctx
        m = {}
        if self.held_out is not None:
            start = time.perf_counter()
            m.update(self._eval_pairs())
            m["time/eval_pairs"] = time.perf_counter() - start
            print0(f"step {t.step}: eval/loss {m['eval/loss']:.4f}, eval/preference_accuracy "
                   f"{m['eval/preference_accuracy']:.3f} on {len(self.held_out)} held-out pairs")
        if self.held_out_prompts is not None:
            m.update(t.accuracy_eval(self.held_out_prompts))
        return m
