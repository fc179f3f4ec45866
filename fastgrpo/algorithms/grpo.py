"""The GRPO algorithm (and its DAPO / Dr. GRPO variants): one step is a rollout (sample with the co-located
engine, score, group advantages: :mod:`fastgrpo.algorithms.advantages`), then :class:`PolicyUpdate`
(:mod:`fastgrpo.algorithms.update`) on the packed micro-batches (:mod:`fastgrpo.algorithms.batch`).

Rewards, per completion: the reward functions' weighted sum plus the reward models' and generative judges'
(``reward.models``, ``reward.judges``, :mod:`fastgrpo.algorithms.reward_models`: scored in this process after
generation), then ``reward_scaling`` (:func:`scale_rewards`), then ``reward_shaping``'s overlong penalty
(:func:`overlong_penalty`); a group has signal when its rewards before shaping are not all equal. With
``grpo.use_dynamic_sampling`` (DAPO) a step generates batches until ``num_prompts_per_step`` groups with signal exist
over all ranks and trains on exactly that many (:meth:`GRPO.rollout`). Memory: the kept groups of up to
``dynamic_sampling_max_gen_batches`` batches wait on the host (token ids and log-probs as lists, about 70 bytes a
token: 16 completions of 16K tokens are ~18 MB a group); a group moves between ranks once, pickled
(``broadcast_object``). Time: each further batch is a whole generation.
"""

from __future__ import annotations

import math
import os

import torch

from fastgrpo.algorithms.advantages import compute_advantages, overlong_penalty, scale_rewards
from fastgrpo.algorithms.async_rollout import AsyncRollout
from fastgrpo.algorithms.batch import Group, Sample
from fastgrpo.algorithms.context import AlgorithmContext
from fastgrpo.algorithms.prerequisites import no_prerequisites
from fastgrpo.algorithms.reward_models import GenerativeJudges, RewardModels, join_scores
from fastgrpo.algorithms.rollout_log import RolloutLog, with_scores
from fastgrpo.algorithms.sampling import SEED_STRIDE, sampling_params
from fastgrpo.algorithms.update import PolicyUpdate
from fastgrpo.config import Config
from fastgrpo.distributed import all_reduce, broadcast_object, print0, reduce_metrics
from fastgrpo.engine.engine import SamplingParams
from fastgrpo.kernels.grpo_options import POLICY_METRICS
from fastgrpo.kernels.names import LOSS_POLICY
from fastgrpo.kernels.rollout_is import DIFF_NAMES, RATIO_NAMES
from fastgrpo.models.lora import is_lora
from fastgrpo.rewards import RewardResult, add_faults


def merge_results(a: RewardResult, b: RewardResult) -> RewardResult:
    """Two generation batches' reward results as one (scores concatenated, fault counts added)."""
    faults = {name: dict(counts) for name, counts in a.faults.items()}
    for name, counts in b.faults.items():
        add_faults(faults.setdefault(name, {}), counts)
    return RewardResult(total=a.total + b.total, per_function={k: v + b.per_function[k] for k, v in
                                                               a.per_function.items()}, faults=faults)


# ---------------------------------------------------------------------------------------------- the algorithm

REWARD_COUNTS = ("/failures", "/timeouts", "/nonfinite", "/isolated", "/workers_respawned")  # summed over ranks
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

    ``ctx`` (:class:`fastgrpo.algorithms.context.AlgorithmContext`) gives the wrapped model, optimizer, scheduler,
    tokenizer, generation (``ctx.generate``) and the shared avg@k validation (``ctx.accuracy_eval``). The frozen
    reference model (β > 0 in the config or a stage) is ``model.path`` loaded again: the initial weights (with
    ``model.lora``: no second model, the policy with its adapters disabled,
    ``fastgrpo.models.lora.adapters_disabled``); from a stage with ``reset_reference`` on, the policy's weights at
    that stage's first step, saved once as ``<run dir>/reference/step_N.pt`` (its step is in :meth:`state_dict`, so
    a resumed run loads them back). Rewards are scored by a :class:`fastgrpo.rewards.pool.RewardPool` (its workers
    start here, during the model set-up and warm-up; the trainer calls :meth:`close`; none without reward functions
    and environments), the reward models (``reward.models``: :class:`RewardModels`) and the generative judges
    (``reward.judges``: :class:`GenerativeJudges`), both loaded here.
    """

    progress = {"reward": "reward/mean", "acc": "accuracy"}
    """Progress-bar fields: label → metric."""
    check_world_size = staticmethod(check_world_size)
    prerequisites = staticmethod(no_prerequisites)

    def __init__(self, ctx: AlgorithmContext):
        from fastgrpo.data.prompts import load_datasets
        from fastgrpo.models.loading import load_model
        from fastgrpo.rewards.pool import RewardPool, default_num_workers

        cfg, st = ctx.cfg, ctx.state
        self.ctx = ctx
        self.cfg = cfg
        self.train_data, self.held_out = load_datasets(cfg.data, ctx.tokenizer)
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
        self.rewards = RewardPool(cfg.reward, workers, preload=preload) if cfg.reward.functions or cfg.env.enabled \
            else None
        self.reward_models = RewardModels(cfg, st, ctx.tokenizer) if cfg.reward.models else None
        self.judges = GenerativeJudges(cfg, st) if cfg.reward.judges else None
        if cfg.env.enabled:
            from fastgrpo.environments.rollout import build_environments, build_templates

            self.envs = build_environments(cfg, self.rewards, factory, tools)
            self.templates = build_templates(self.envs, ctx.tokenizer)
        self.ref_model = None
        if not is_lora(ctx.model) and (cfg.grpo.beta > 0 or any((s.beta or 0) > 0 for s in cfg.stages)):
            self.ref_model, _ = load_model(cfg.model, st.device, seed=cfg.train.seed)
            self.ref_model.requires_grad_(False).eval()
        self.reference_step: int | None = None
        """The step whose policy weights the reference holds (None: the initial weights)."""
        self.update = PolicyUpdate(cfg, ctx.wrapped, ctx.optimizer, ctx.scheduler, self.ref_model,
                                   st.device, st.world_size)
        self.rollout_log = RolloutLog(cfg.logging, ctx.run_dir, ctx.tokenizer, st.rank, st.world_size)
        self.async_rollout = AsyncRollout(self) if cfg.grpo.async_grpo.enabled else None

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

        tok = self.ctx.tokenizer
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
        self.ref_model.load_state_dict(torch.load(path, map_location=self.ctx.state.device, weights_only=True))
        self.reference_step = step

    def rank_state_dict(self) -> dict | None:
        """This rank's own resumable state: async GRPO's sequences in flight (``AsyncRollout.state_dict``)."""
        return {"async": self.async_rollout.state_dict()} if self.async_rollout is not None else None

    def load_rank_state_dict(self, state: dict | None) -> None:
        if self.async_rollout is not None:
            self.async_rollout.load_state_dict((state or {}).get("async"))

    def _reference_path(self, step: int):
        return self.ctx.run_dir / "reference" / f"step_{step:08d}.pt"

    @torch.no_grad()
    def _reference_from_policy(self) -> None:
        """The KL reference becomes the policy's current weights (a stage with ``reset_reference``: a NeMo-RL stage is
        a new run from the previous stage's weights, which are its reference); rank 0 saves them once, written to a
        temporary name and then renamed."""
        t = self.ctx
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
        return self.ctx.accuracy_eval(self.held_out) if self.held_out is not None else {}

    def eval_sampler(self):
        """Validation's sampler for ``fastgrpo.eval.evaluate``: multi-turn with the environments (None: the engine
        on the held-out prompts). Its accuracy is the math verifier's when ``reward.functions`` has ``math``, else
        the environment's reward (a game's solve rate)."""
        if self.envs is None:
            return None
        from fastgrpo.environments.rollout import env_rows, generate_trajectories, multi_turn_params

        def sample(indices: list[int], params: SamplingParams):
            rows = env_rows([self.held_out.rows[i] for i in indices], self.cfg)
            _, outs, trajs, _ = generate_trajectories(self.ctx.engine.generate, self.envs, self.templates, rows,
                                                      multi_turn_params(params, self.cfg, self.envs))
            scores = None if "math" in self.cfg.reward.functions else [
                [trajs[(i, j)].reward for j in range(len(group))] for i, group in enumerate(outs)]
            return outs, float(sum(t.tool_calls > 0 for t in trajs.values())), scores

        return sample

    def close(self) -> None:
        """Stop the reward workers and close the generation session (async GRPO)."""
        if self.async_rollout is not None:
            self.async_rollout.close()
        if self.rewards is not None:
            self.rewards.close()

    def _generate(self, indices: list[int], settings: dict, batch: int) -> tuple[list[Group], dict]:
        """One generation batch: this rank's share of the prompts ``indices`` sampled, scored, rescaled and shaped;
        its groups and its sums for the step's metrics.

        Each group goes to the reward pool as soon as the engine finishes it (decoded here, in the engine's
        callback), so scoring overlaps the decoding of the other groups; the scores come back in prompt order.
        """
        t = self.ctx
        cfg, st, g = self.cfg, t.state, self.cfg.grpo
        per_rank = len(indices) // st.world_size
        idx = indices[st.rank * per_rank : (st.rank + 1) * per_rank]
        prompts = [self.train_data.prompt_ids[i] for i in idx]
        G = g.num_generations
        params = sampling_params(cfg, settings, n=G,
                                 seed=(cfg.train.seed * SEED_STRIDE + t.step + batch * DS_SEED_STRIDE) * 1024 + st.rank)
        columns = self.train_data.columns(idx)  # column -> one value per prompt
        if self.envs is not None:
            from fastgrpo.environments.rollout import env_rows, multi_turn_params

            params = multi_turn_params(params, cfg, self.envs)
            rows = env_rows([self.train_data.rows[i] for i in idx], cfg)
        prompt_texts = None

        def score(p: int, group: list) -> None:
            if self.rewards is None:  # reward models only: they score after generation
                return
            texts = [t.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
            self.rewards.submit(p, [prompt_texts[p]] * len(group), texts,
                                {k: [vals[p]] * len(group) for k, vals in columns.items()})

        env_sums = {}
        with t.timer("generation"):
            if self.envs is None:
                prompt_texts = [t.tokenizer.decode(p) for p in prompts]
                outs = t.generate(prompts, params, on_group_done=score)
            else:  # the prompts come from the environments' resets; rewards score the final transcripts
                from fastgrpo.environments.rollout import generate_trajectories

                prompts, outs, trajs, env_sums = generate_trajectories(t.generate, self.envs, self.templates, rows,
                                                                       params)
                prompt_texts = [t.tokenizer.decode(p) for p in prompts]
                for p, group in enumerate(outs):
                    score(p, group)
        if self.rewards is not None:
            result, reward_times = self.rewards.gather()
        else:
            result, reward_times = RewardResult(total=[0.0] * (len(prompts) * G), per_function={}), {}
        return self.score_groups(idx, prompts, outs, result, reward_times, settings,
                                 trajs if self.envs is not None else None, env_sums)

    def score_groups(self, idx: list[int], prompts: list[list[int]], outs: list, result: RewardResult,
                     reward_times: dict, settings: dict, trajs=None, env_sums=None) -> tuple[list[Group], dict]:
        """The groups of ``outs`` (``[prompt][sample]`` completions of the dataset rows ``idx``, whose prompts are
        ``prompts``) with their rewards: the reward functions' ``result`` joined with the reward models' scores
        and, multi-turn, the environment's reward (``trajs``), then rescaled and shaped; and their sums for the
        step's metrics (``reward_times`` and ``env_sums`` added to them)."""
        t = self.ctx
        cfg, G = self.cfg, self.cfg.grpo.num_generations
        completions = [c for group in outs for c in group]  # [P * G], prompt-major
        if self.reward_models is not None or self.judges is not None:  # the question of each completion
            questions = [self.train_data.rows[idx[j // G]]["prompt"] for j in range(len(completions))]
        if self.reward_models is not None:
            with t.timer("reward_models"):
                scores = self.reward_models.score([prompts[j // G] for j in range(len(completions))],
                                                  [list(c.token_ids) for c in completions], questions)
            result = self.reward_models.join(result, scores)
        if self.judges is not None:
            with t.timer("reward_judges"):
                texts = [t.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
                scores, faults = self.judges.score(questions, texts)
            result = join_scores(result, scores, self.judges.weights, faults)
        total = result.total
        if trajs is not None:  # the environment's reward next to the reward functions'
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
        if self.rollout_log.enabled:  # each completion's scores travel with its group (to the rollout log)
            groups = with_scores(groups, result.per_function, trajs)
        lengths = [len(c.token_ids) for c in completions]
        correct = result.per_function.get("math", [float(x > 0) for x in total])
        sums = {"reward/sum": sum(rewards), "reward_sq/sum": sum(r * r for r in rewards),
                "completions/sum": len(lengths), "correct": sum(c == 1.0 for c in correct),
                "length": sum(lengths), "length_max": max(lengths),
                "truncated": sum(c.finish_reason == "length" for c in completions),
                "zero_std": sum(not grp.signal for grp in groups), "groups": len(groups),
                "tokens/sum": float(sum(lengths) + G * sum(len(p) for p in prompts)), "penalty": sum(penalties),
                "result": result, **reward_times, **(env_sums or {})}
        stats = getattr(t.engine, "last_stats", None) or {}  # the engine's scheduling of this batch
        if stats:
            sums.update({"generation/peak_running/max": float(stats["peak_running"]),
                         "generation/preemptions/sum": float(stats["preemptions"]),
                         "generation/decode_steps/max": float(stats["decode_steps"]),
                         "generation/active_row_steps/sum": float(stats["active_row_steps"]),
                         "generation/decode_steps/sum": float(stats["decode_steps"]),
                         "generation/kv_usage/max": stats["peak_kv_tokens"] / stats["kv_capacity_tokens"]})
            if trajs is not None:
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
        st = self.ctx.state
        W, k = st.world_size, target // st.world_size
        counts_WB = torch.zeros(W, len(kept), dtype=torch.long)
        counts_WB[st.rank] = torch.tensor([len(x) for x in kept])
        counts_WB = all_reduce(counts_WB.to(self.ctx.coll_device())).cpu()  # sync: every rank plans the moves
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
        t = self.ctx
        cfg, st, g = self.cfg, t.state, self.cfg.grpo
        G, P = g.num_generations, g.num_prompts_per_step
        kept: list[list[Group]] = []
        totals: dict = {}
        have = dropped = 0
        for batch in range(g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
            if batch:
                indices = t.sampler.next(self.rows_per_step)
            if self.async_rollout is not None:  # groups from the generation session that outlives the step
                groups, sums = self.async_rollout.groups(indices, settings)
            else:
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
            dropped_here = len(groups) - len(kept[-1]) + sums.get("async/dropped_zero_std/sum", 0)  # async: refilled
            n = all_reduce(torch.tensor([len(kept[-1]), dropped_here],
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
                                      loss_mask=list(c.loss_mask) if self.envs is not None else None,
                                      routing=c.routing))
        if self.rollout_log.enabled:  # rollouts/step_<N>.jsonl, N the step metrics.jsonl logs (fastgrpo.trainer)
            rows = self.rollout_log.record(t.step + 1, groups, samples)
            if self.rollout_log.to_log:
                t.tables["rollouts"] = rows[: self.rollout_log.to_log]
        n = totals["completions/sum"]
        m = {key: totals[key] for key in ("reward/sum", "reward_sq/sum", "completions/sum", "tokens/sum")}
        # a reward model has no faults to count (it runs in this process): its mean only
        models = tuple(f"reward/{name}/" for name in cfg.reward.model_names())
        m.update({
            "accuracy": totals["correct"] / n, "response_length/mean": totals["length"] / n,
            "response_length/max": float(totals["length_max"]), "truncated_fraction": totals["truncated"] / n,
            "frac_reward_zero_std": totals["zero_std"] / totals["groups"],
            **{k: v for k, v in totals["result"].metrics().items() if not k.startswith(models) or
               k.endswith("/mean")},
            **{k: v for k, v in totals.items() if k.startswith(("time/", "reward/workers", "generation/", "async/"))},
        })
        if cfg.reward_shaping.enabled:
            m["reward_shaping/penalty_mean"] = totals["penalty"] / n
        if self.envs is not None:
            from fastgrpo.environments.turns import env_metrics

            m.update(env_metrics(totals, n))
        if g.use_dynamic_sampling:  # the same on every rank (counted over all of them)
            m.update({"dynamic_sampling/num_gen_batches": float(len(kept)),
                      "dynamic_sampling/dropped_groups": float(dropped),
                      "dynamic_sampling/discarded_valid_samples": float((have - P) * G),
                      "dynamic_sampling/groups": float(len(groups) * st.world_size)})
        return samples, m

    def step(self, indices: list[int], settings: dict) -> dict[str, float]:
        """One GRPO step on the prompts ``indices`` (all ranks'); returns the step's metrics, reduced over ranks,
        with ``tokens`` (all ranks) and ``bad_steps`` (non-finite optimizer steps of this step)."""
        t = self.ctx
        if self.ref_model is not None and any(s.reset_reference and s.at_step == t.step for s in self.cfg.stages):
            self._reference_from_policy()
        samples, local = self.rollout(indices, settings)
        with t.updating(), t.timer("update"):
            upd = self.update.run(samples, beta=settings["beta"], epsilon_high=settings["epsilon_high"],
                                  max_new_tokens=settings["max_new_tokens"])
        if self.async_rollout is not None:  # the sequences in flight continue on the new weights
            self.async_rollout.after_update()
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
        if "generation/decode_steps/sum" in m:  # the decode batch's mean occupancy, over every rank's decode steps
            m["generation/rows_active_mean"] = m.pop("generation/active_row_steps/sum") / max(
                m.pop("generation/decode_steps/sum"), 1.0)
        if self.async_rollout is not None:  # over the step's trained tokens and groups, all ranks
            self.async_rollout.finish_metrics(m)
        return m
