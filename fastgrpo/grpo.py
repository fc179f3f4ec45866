"""The GRPO algorithm: group advantages, rollout → packed micro-batches, log-prob forwards, the policy update.

Advantages (one per completion, G completions per prompt, rewards ``r``)::

    baseline  b_i = mean_j r_j                      ("mean", GRPO / TRL)
              b_i = (Σ_j r_j − r_i) / (G − 1)         ("leave_one_out", RLOO / NeMo-RL)
    A_i = (r_i − b_i) / (σ + ADV_EPS)               σ = std of the group ("group"), of the whole batch over all
                                                    ranks ("batch"), or no division ("none"); std is unbiased

σ is the same for every baseline: with "group" it is the std of all G rewards of the group, r_i included, also under
"leave_one_out". Since r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean_j r_j), leave-one-out with group scaling equals
the mean baseline times G/(G−1) (8/7 for G = 8). This departs from NeMo-RL, whose leave-one-out option divides by
the std of the other G−1 rewards, a different σ per completion.

Sequences (prompt + completion) are packed into micro-batches of at most ``train.max_tokens_per_microbatch``
tokens. At packed position ``t`` the target is token ``t + 1`` of the same sequence; the loss mask is 1 exactly
where the target is a completion token (and the completion is trained on: masked truncated completions and, with
dynamic sampling, zero-variance groups get mask 0).

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

from fastgrpo.attention import packed_hidden_states
from fastgrpo.config import Config
from fastgrpo.distributed import ForwardWrapper, all_reduce, gradient_sync, reduce_metrics
from fastgrpo.generation import SamplingParams
from fastgrpo.kernels.grpo_loss import fused_linear_grpo_loss, masked_linear_logprobs
from fastgrpo.models import lm_head_params
from fastgrpo.packing import PackedBatch, pack, plan_microbatches

ADV_EPS = 1e-4  # added to the reward std before dividing (TRL's value): a zero-variance group gets A = 0


def compute_advantages(rewards_PG: torch.Tensor, baseline: str = "mean", scale: str = "group",
                       batch_std: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[P, G]`` and a ``[P]`` bool mask of groups whose rewards are all equal (see module docstring).

    ``batch_std``: the std of every reward in the batch (all ranks) for ``scale="batch"``; computed from
    ``rewards_PG`` when None.
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards_PG must be [P, G] with G >= 2, got shape {tuple(rewards_PG.shape)}")
    r = rewards_PG.double()
    G = r.shape[1]
    if baseline == "mean":
        b = r.mean(1, keepdim=True)  # [P, 1]
    elif baseline == "leave_one_out":
        b = (r.sum(1, keepdim=True) - r) / (G - 1)  # [P, G]
    else:
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    adv = r - b
    zero_std_P = (r.max(1).values - r.min(1).values) == 0
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        std = r.std() if batch_std is None else torch.tensor(batch_std, dtype=r.dtype)
        adv = adv / (std + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return adv.float(), zero_std_P


@dataclass
class Sample:
    """One prompt + completion to train on."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sample_logprobs: list[float]
    """The generation engine's log-probs of the completion tokens."""
    advantage: float
    train: bool = True
    """False: the completion gets no loss (masked truncated completion, filtered group)."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def num_loss_tokens(self) -> int:
        return len(self.completion_ids) if self.train else 0


@dataclass
class MicroBatch:
    """B packed sequences and their per-token training inputs."""

    batch: PackedBatch
    targets: torch.Tensor  # [N] int64, next token (0 where there is none)
    mask: torch.Tensor  # [N] float, 1 where the target is a trained completion token
    advantages: torch.Tensor  # [B] float
    sample_logprobs: torch.Tensor  # [N] float, the engine's log-probs at masked positions (0 elsewhere)
    completion_mask: torch.Tensor  # [N] bool, target is a completion token (trained or not)
    old_logprobs: torch.Tensor | None = None  # [N]
    ref_logprobs: torch.Tensor | None = None  # [N]
    num_loss_tokens: int = 0
    """Σ mask, counted on the host while packing (no device sync to read it)."""

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs


def make_microbatch(samples: list[Sample], device: torch.device) -> MicroBatch:
    """Pack ``samples`` into one row with targets, loss mask and advantages."""
    batch = pack([s.tokens for s in samples])
    targets, mask, comp, slp = [], [], [], []
    for s in samples:
        toks, p, c = s.tokens, len(s.prompt_ids), len(s.completion_ids)
        targets += toks[1:] + [0]
        is_comp = [False] * (p - 1) + [True] * c + [False]
        comp += is_comp
        mask += [float(s.train and x) for x in is_comp]
        slp += [0.0] * (p - 1) + list(s.sample_logprobs) + [0.0]
    return MicroBatch(
        batch=batch.to(device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        mask=torch.tensor(mask, dtype=torch.float32, device=device),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        sample_logprobs=torch.tensor(slp, dtype=torch.float32, device=device),
        completion_mask=torch.tensor(comp, dtype=torch.bool, device=device),
        num_loss_tokens=int(sum(mask)),
    )


def plan(samples: list[Sample], max_tokens: int, device: torch.device) -> list[MicroBatch]:
    """Micro-batches of at most ``max_tokens`` tokens (``fastgrpo.packing.plan_microbatches``)."""
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


def _mismatch(logp_N: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Training–inference mismatch: mean |log p_train − log p_engine| over the micro-batch's trained tokens
    (a device scalar: no host sync)."""
    return ((logp_N - mb.sample_logprobs).abs() * mb.mask).sum() / max(mb.num_loss_tokens, 1)


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

        def add(key, value, weight=1.0):
            sums[key] = sums.get(key, 0.0) + value * weight
            sums[key + "#w"] = sums.get(key + "#w", 0.0) + weight

        # Every rank runs the same number of micro-batches per optimizer step (FSDP2 gathers weights in each
        # forward): the global max of every step's count, in one collective; ranks with fewer pad with copies that
        # carry zero weight.
        counts = torch.tensor([len(mbs) for mbs in plans], device=self.device)
        n_mbs = [int(n) for n in all_reduce(counts, "max").tolist()]  # sync: loop counts

        # Old and reference log-probs: no-grad packed forwards before any update of this rollout. The policy's go
        # through its wrapped forward (under FSDP2 that gathers the sharded weights, a collective: padded counts).
        if len(steps) > 1:
            policy = _no_grad_forward(self.model)
            for mbs, n_mb in zip(plans, n_mbs):
                for i in range(n_mb):
                    logp_N = packed_logprobs(policy, mbs[min(i, len(mbs) - 1)], temperature)
                    if i < len(mbs):
                        mbs[i].old_logprobs = logp_N
        if beta > 0:  # the reference model is a plain module on every rank: no collective
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
                with gradient_sync(self.model, enabled=i == n_mb - 1):
                    loss, metrics, logp_N = self._loss(mb, tokens, seqs, beta, epsilon_high, max_new_tokens)
                    (loss * weight * self.world_size).backward()
                loss_total += loss.detach().double() * weight
                if weight:
                    n_tok = mb.num_loss_tokens
                    for k, v in metrics.items():
                        add(k, v, n_tok)
                    if mb.old_logprobs is None and n_tok:  # the update's own forward is pre-update here
                        add("mismatch/logprob_abs_diff", _mismatch(logp_N, mb), n_tok)
            loss_value = float(all_reduce(loss_total))  # the optimizer step's full loss, all ranks
            if self.cfg.train.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), math.inf)
            grad_norm = float(_local(grad_norm))  # sync: the finiteness check decides whether to step
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                num_bad += 1
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()
            self.scheduler.step()
            add("loss", loss_value)
            add("grad_norm", grad_norm)

        for mbs in plans:  # mismatch from the pre-update forward when old log-probs were computed
            for mb in mbs:
                n_tok = mb.num_loss_tokens
                if mb.old_logprobs is not None and n_tok:
                    add("mismatch/logprob_abs_diff", _mismatch(mb.old_logprobs, mb), n_tok)

        # sync: one per metric per rollout, for the log row
        out = {k: float(v) / sums[k + "#w"] for k, v in sums.items() if not k.endswith("#w") and sums[k + "#w"] > 0}
        out["optimizer_steps"] = float(len(plans) - num_bad - num_skipped)
        out["bad_steps"] = float(num_bad)
        return out

    def _loss(self, mb: MicroBatch, tokens: float, seqs: float, beta: float, epsilon_high: float | None,
              max_new_tokens: int):
        """One micro-batch's re-weighted loss, its metrics, and its detached log-probs ``[N]`` (0 where untrained).

        ``fused_linear_grpo_loss`` with ``return_logprobs``: on-policy (one optimizer step per rollout,
        ``mb.old_logprobs`` None) the log-probs are also the old ones (ratio 1, as TRL), and they give the
        training–inference mismatch — from the loss's own pass over the vocabulary, not a second no-grad one.
        """
        g = self.cfg.grpo
        hidden_NH, weight_VH, bias_V = _call(self.model, mb)
        loss, metrics, logp_N = fused_linear_grpo_loss(
            hidden_NH, weight_VH, mb.targets, mb.old_logprobs, mb.advantages, mb.mask, bias=bias_V,
            temperature=self.cfg.rollout.temperature, return_entropy=True, return_logprobs=True,
            ref_logprobs=mb.ref_logprobs, beta=beta, epsilon_low=g.epsilon_low, epsilon_high=epsilon_high,
            delta=g.delta, dual_clip_c=g.dual_clip_c, loss_type=g.loss_type,
            importance_sampling_level=g.importance_sampling_level, max_completion_length=max_new_tokens,
            num_items_in_batch=tokens if g.loss_type == "dapo" else None, cu_seqlens=mb.batch.cu_seqlens,
            per_token_advantages=False,
        )
        if g.loss_type == "bnpo":
            loss = loss * mb.num_loss_tokens / tokens
        elif g.loss_type in ("grpo", "dr_grpo"):
            loss = loss * mb.num_seqs / seqs
        return loss, metrics, logp_N


# ---------------------------------------------------------------------------------------------- the algorithm

REWARD_COUNTS = ("/failures", "/timeouts", "/nonfinite", "/workers_respawned")  # summed over ranks
SEED_STRIDE = 1_000_003  # separates the per-(step, rank) sampling seeds


def check_world_size(cfg: Config, world_size: int) -> None:
    """The rollout's prompts and optimizer steps must split evenly over ``world_size`` processes."""
    if cfg.grpo.num_prompts_per_step % world_size:
        raise ValueError(f"grpo.num_prompts_per_step={cfg.grpo.num_prompts_per_step} must be a multiple of the "
                         f"number of processes ({world_size})")
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
    stage) is ``model.path`` loaded again: the initial weights. Rewards are scored by a
    :class:`fastgrpo.reward_pool.RewardPool` (its workers start here, during the model set-up and warm-up; the
    trainer calls :meth:`close`).
    """

    progress = {"reward": "reward/mean", "acc": "accuracy"}
    """Progress-bar fields: label → metric."""

    def __init__(self, trainer):
        from fastgrpo.data import load_datasets
        from fastgrpo.models import load_model
        from fastgrpo.reward_pool import RewardPool, default_num_workers

        cfg, st = trainer.cfg, trainer.state
        self.trainer = trainer
        self.cfg = cfg
        self.train_data, self.held_out = load_datasets(cfg.data, trainer.tokenizer)
        workers = cfg.reward.num_workers
        if workers is None:  # a rank keeps its torch threads busy on CPU, one core (its Python thread) on GPU
            busy = torch.get_num_threads() if st.device.type == "cpu" else 1
            workers = default_num_workers(busy, int(os.environ.get("LOCAL_WORLD_SIZE", st.world_size)))
        self.rewards = RewardPool(cfg.reward, workers)
        self.ref_model = None
        if cfg.grpo.beta > 0 or any((s.beta or 0) > 0 for s in cfg.stages):
            self.ref_model, _ = load_model(cfg.model, st.device, seed=cfg.train.seed)
            self.ref_model.requires_grad_(False).eval()
        self.update = PolicyUpdate(cfg, trainer.wrapped, trainer.optimizer, trainer.scheduler, self.ref_model,
                                   st.device, st.world_size)

    @property
    def rows_per_step(self) -> int:
        """Training rows (prompts) one step draws from the data sampler, all ranks together."""
        return self.cfg.grpo.num_prompts_per_step

    def describe_data(self) -> str:
        dropped = self.train_data.num_dropped + (self.held_out.num_dropped if self.held_out else 0)
        return (f"{len(self.train_data)} training prompts"
                + (f", {len(self.held_out)} held-out" if self.held_out else "")
                + (f", {dropped} dropped (longer than data.max_prompt_tokens)" if dropped else ""))

    def warmup_examples(self) -> tuple[list[list[int]], list[str]]:
        """``(prompt ids, reference completions)`` of the supervised warm-up: the answer in ``\\boxed{}``."""
        from fastgrpo.data import sft_completion

        return self.train_data.prompt_ids, [sft_completion(r["answer"]) for r in self.train_data.rows]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def validate(self) -> dict[str, float]:
        """avg@k / pass@k on the held-out prompts (none: nothing to validate)."""
        return self.trainer.accuracy_eval(self.held_out) if self.held_out is not None else {}

    def close(self) -> None:
        """Stop the reward workers."""
        self.rewards.close()

    def rollout(self, indices: list[int], settings: dict) -> tuple[list[Sample], dict[str, float]]:
        """Sample, score and compute advantages for this rank's share of the step's prompts ``indices``.

        Each group goes to the reward pool as soon as the engine finishes it (decoded here, in the engine's
        callback), so scoring overlaps the decoding of the other groups; the scores come back in prompt order.
        """
        t = self.trainer
        cfg, st, g = self.cfg, t.state, self.cfg.grpo
        per_rank = g.num_prompts_per_step // st.world_size
        idx = indices[st.rank * per_rank : (st.rank + 1) * per_rank]
        prompts = [self.train_data.prompt_ids[i] for i in idx]
        G = g.num_generations
        params = SamplingParams(n=G, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, max_new_tokens=settings["max_new_tokens"],
                                seed=(cfg.train.seed * SEED_STRIDE + t.step) * 1024 + st.rank)
        prompt_texts = [t.tokenizer.decode(p) for p in prompts]
        columns = self.train_data.columns(idx)  # column -> one value per prompt

        def score(p: int, group: list) -> None:
            texts = [t.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
            self.rewards.submit(p, [prompt_texts[p]] * len(group), texts,
                                {k: [vals[p]] * len(group) for k, vals in columns.items()})

        with t.timer("generation"):
            outs = t.generate(prompts, params, on_group_done=score)
        completions = [c for group in outs for c in group]  # [P * G], prompt-major
        result, reward_times = self.rewards.gather()
        r_PG = torch.tensor(result.total, dtype=torch.float64).view(len(prompts), G)
        batch_std = None
        if g.scale == "batch":
            s = all_reduce(torch.tensor([r_PG.sum(), (r_PG**2).sum(), r_PG.numel()], dtype=torch.float64,
                                        device=t.coll_device())).cpu().tolist()
            batch_std = math.sqrt(max(s[1] - s[0] ** 2 / s[2], 0.0) / max(s[2] - 1, 1))
        adv_PG, zero_std_P = compute_advantages(r_PG, g.baseline, g.scale, batch_std)
        adv, zero_std = adv_PG.view(-1).tolist(), zero_std_P.tolist()  # CPU tensors: Python lists once
        samples = []
        for j, c in enumerate(completions):
            p = j // G
            keep = not (g.mask_truncated_completions and c.finish_reason == "length")
            keep = keep and not (g.dynamic_sampling and zero_std[p])
            samples.append(Sample(prompts[p], list(c.token_ids), list(c.logprobs), adv[j], keep))
        lengths = [len(c.token_ids) for c in completions]
        correct = result.per_function.get("math", [float(x > 0) for x in result.total])
        m = {
            "reward/sum": float(r_PG.sum()), "reward_sq/sum": float((r_PG**2).sum()), "completions/sum": len(lengths),
            "accuracy": sum(c == 1.0 for c in correct) / len(correct),
            "response_length/mean": sum(lengths) / len(lengths), "response_length/max": float(max(lengths)),
            "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "frac_reward_zero_std": float(zero_std_P.double().mean()),
            "tokens/sum": float(sum(lengths) + G * sum(len(p) for p in prompts)),
            **result.metrics(), **reward_times,
        }
        return samples, m

    def step(self, indices: list[int], settings: dict) -> dict[str, float]:
        """One GRPO step on the prompts ``indices`` (all ranks'); returns the step's metrics, reduced over ranks,
        with ``tokens`` (all ranks) and ``bad_steps`` (non-finite optimizer steps of this step)."""
        t = self.trainer
        samples, local = self.rollout(indices, settings)
        with t.updating(), t.timer("update"):
            upd = self.update.run(samples, beta=settings["beta"], epsilon_high=settings["epsilon_high"],
                                  max_new_tokens=settings["max_new_tokens"])
        # every rank has the same keys: metrics a rank lacks (no optimizer step succeeded) are NaN there
        for key in ("loss", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean", "mismatch/logprob_abs_diff") + (("kl",) if settings["beta"] else ()):
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
