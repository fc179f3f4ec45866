"""Asynchronous GRPO on the co-located engine (``grpo.async_grpo.enabled``): generation that never drains.

A synchronous step waits for its longest rollout: at long, long-tailed response lengths most of the batch finishes
early and the last rows decode alone. Here the engine keeps one generation session per rank
(:class:`fastgrpo.engine.session.GenerationSession`) for the whole run:

1. **Refill.** Each step adds its prompts (the rank's share of the data sampler's ``num_prompts_per_step``) to the
   session, then tops the buffer up so that a rank keeps ``B = (max_trajectory_age_steps + 1) · P_r`` groups in
   flight or waiting, within one batch (``P_r`` its share of a step's prompts): the first step adds
   ``max_trajectory_age_steps`` more batches, a later one a batch whenever the groups dropped (without signal;
   stale, only as the safety net of 4.) leave a whole batch missing on some rank (every rank draws it from the
   data sampler: one collective decides). A rank never holds more than ``B`` live groups (added, not trained or
   dropped): rows drawn for it beyond that (another rank was short) are *parked* on the host, unsampled, and added
   in order as its buffer makes room (``async/parked``; a checkpoint keeps them). Added past ``B``, such a group
   would be due a step after its deadline and go stale after decoding in full.
2. **Train in order, by deadline.** Groups are keyed in the order they are added (the data stream's). Step ``t``
   trains the ``P_r`` lowest keys not trained or dropped yet (:func:`due_groups`) and runs the session until all of
   them have finished (a group trains only when all of its ``G`` samples have: the advantage needs the whole group),
   while the rest of the buffer keeps decoding; each group goes to the reward pool the moment it finishes. The
   unfinished groups wait in the session with their KV pages; a finished group beyond the due ones waits on the
   host. A buffer of at most ``(a + 1) · P_r`` groups at a step's start therefore trains a group added at step ``t``
   by step ``t + a``: its oldest token (sampled at version >= ``t``) is at most ``a`` versions old, nothing goes
   stale, and every response length trains in its turn. NeMo-RL's async GRPO does the same: a trajectory
   generated from weights ``v`` targets a step <= ``v + max_trajectory_age_steps`` and the trainer stalls until
   the trajectories due at its step are in (``ReplayBuffer.sample`` and
   ``AsyncTrajectoryCollector._calculate_target_weights`` in ``nemo_rl/algorithms/async_utils.py``, NVIDIA-NeMo/RL
   commit 0a27b1f). Training the first ``P_r`` groups to finish instead (the policy before this one) dropped the
   long tail: on ``bench/bench_async.py``'s workload at age 1 every group longer than ~131 tokens went stale (51%
   of the sampled tokens), so the policy trained 31-token responses against sync's 52, a bias toward short
   answers; in order, async trains sync's groups (README, Asynchronous GRPO). The cost of the order is the wait:
   a step ends when its due groups' longest sample does (at the DeepScaleR scale, a 24K-token response), but that
   sample was admitted before any later group's (the queue is in key order) up to ``a`` steps earlier, and the next
   groups fill the rows meanwhile: the wait takes at most the decode steps a synchronous step would spend on it.
3. **In-flight weight updates.** After the optimizer step the session's sequences resume on the updated weights,
   which the engine reads in place: the update costs nothing (:meth:`AsyncRollout.after_update`). With
   ``recompute_kv_cache_after_weight_updates`` every in-flight sequence's K/V is recomputed on the new weights
   (one prefill of its prompt and tokens), otherwise the K/V the older weights wrote is kept.
4. **Staleness.** Every sampled token records the policy version (optimizer steps taken) that sampled it and its
   behaviour log-prob (the engine's). A group's age is the trained policy's version minus its oldest token's; a
   group older than ``max_trajectory_age_steps`` is dropped and counted (``async/dropped_stale``), never trained: a
   safety net, since the order above keeps every group within the bound (a run resumed from a checkpoint saved
   under another rule, a bug). The policy update corrects the older tokens by importance sampling against their
   behaviour log-probs (``grpo.rollout_is``, required). When a rank has fewer live groups than ``P_r`` (dynamic
   sampling's drops), every rank adds another batch from the data sampler (one collective decides).

Metrics (over all ranks; NeMo-RL-style names): ``async/age_mean`` and ``async/age_max``, the age (the trained
policy's version minus the token's) of the trained tokens (loss-mask 1), mean and max; ``async/in_flight`` (groups
added and not finished at the step's end), ``async/dropped_stale`` (groups dropped this step),
``async/carried_tokens`` (tokens already sampled by the groups carried into the next step: in flight, or finished
and waiting), ``async/waiting`` (finished groups waiting for the next step), ``async/topup_batches`` (batches added
at the step's start to keep the buffer at ``B``), ``async/refill_batches`` (batches added during the step because the
rank had fewer live groups than its step, the most on any rank), ``async/dropped_zero_std`` and
``async/dropped_stage`` (below), ``async/parked`` (rows drawn and not added yet, 1.), ``async/dropped_resume``
(groups a checkpoint could not carry into the resumed run, counted at its first step: Checkpoints; under another
world size each rank counts its own file's live and parked groups, and the files of ranks beyond the new world are
not read).
``time/generation``, ``time/update``, ``tokens_per_second`` and ``generation/rows_active_mean`` are the synchronous
step's.

**Memory.** The session's page pool lives through the update: set ``rollout.max_total_tokens`` so that the KV pool
and the update's activations fit together (``python -m fastgrpo.plan`` gives both; on CUDA the engine otherwise
takes 80% of the free memory at the session's start). At the DeepScaleR scale (1.5B, bf16, 28 KiB of K/V per
token) a rank keeping B = 2 · 16 groups of 8 samples in flight at 12K tokens on average holds 256 · 12K · 28 KiB =
84 GiB of K/V if all were resident at once; the pool bounds it (the latest-admitted sequences wait in the queue or
are preempted and recomputed), so on an 80 GiB GPU size the pool at the plan's KV share (e.g. 40 GiB) and let the
queue hold the rest. The host keeps the in-flight samples' tokens and log-probs (about 70 bytes a token).

**Checkpoints** (single-turn; multi-turn below). Each rank saves its sequences in flight with the checkpoint
(``state_rank{r}.pt``: :meth:`AsyncRollout.state_dict`): the session's state (every unfinished sample's tokens,
behaviour log-probs, versions, finish state and random stream position, the queue's order, the counters;
``fastgrpo.engine.snapshot``), the finished groups waiting with their scores, each key's training row. A resumed
run opens its session with them (their K/V recomputed by prefill on the loaded weights) and goes on. With
``recompute_kv_cache_after_weight_updates`` the uninterrupted run had just recomputed every K/V on the same
weights, so the resumed run's metrics rows equal the uninterrupted run's (tests/test_async_grpo.py kills a run with
SIGKILL after a checkpoint and compares). Without it the uninterrupted run's running samples kept K/V of the older
weights, which the checkpoint does not hold (the pages: up to the pool, e.g. 40 GiB per GPU at the DeepScaleR
scale): the resumed run's samples continue on K/V of the newest weights, so from the resumed step its rows differ
from the uninterrupted run's by that (every token's version and behaviour log-prob stay exact). A checkpoint taken
mid-step (an interruption) holds no session: the resumed run starts a new one (those prompts are not trained).

**Dynamic sampling** (``grpo.use_dynamic_sampling``): the over-sampling is the refill. A group whose rewards
(before shaping) are all equal is dropped the moment it is scored (``async/dropped_zero_std``, also counted in
``dynamic_sampling/dropped_groups``): the next live key becomes due in its place, and its replacement joins the back
of the order (the top-up at the next step's start, or a refill when the rank has fewer live groups than its step, at
most ``dynamic_sampling_max_gen_batches - 1`` batches a step); groups with signal beyond the step's wait for the
next one (none is discarded). Not with
``reward.models`` / ``reward.judges``: their scores come after the step's groups are chosen (refused).

**Stages.** A stage that changes the sampling (``max_new_tokens``, ``max_sequence_tokens``) drains the buffer at its
first step: the finished groups waiting are kept and trained (sampled under the previous stage's limit), the
unfinished ones are dropped (``async/dropped_stage``: finishing them would decode the old stage's long tail), and a
new session with the stage's settings is topped up to ``B`` as at the start. A
stage that changes only the learning rate, β or ε keeps the session.

**FSDP2.** The step's generation runs inside one ``full_weights`` block (the full weights gathered once per step on
every rank, held while the session decodes, freed for the update, as a synchronous step's generation does), and the
session is told that the gathered storage may move between runs (``moving_weights``: its CUDA graphs are captured
again each step).

**Multi-turn environments** (``env``): a paused turn is just another pause. The session takes one
:class:`fastgrpo.environments.EnvTurns` for its life: each batch's rows join it as they are added (their
environments reset in the reward workers, their prompts rendered with the tools), a sample that ends a turn waits
on its worker while the others decode, across the session's runs and the weight updates (with
``recompute_kv_cache_after_weight_updates`` its conversation is prefilled again on the new weights when it resumes,
as any paused sample's). When a group finishes, its transcripts go to the reward pool and its environments'
rewards are asked for (``get_reward()`` in the workers, while the rest decode); :meth:`AsyncRollout._collect` takes
its trajectories and frees their instances, so the handler and the workers hold only the groups in flight. A
group's reward is the synchronous rule: the reward functions on the final transcript plus ``env.reward_weight`` ×
the environment's reward (dynamic sampling judges the sum), and the step logs the ``env/`` metrics of the groups it
trains (the synchronous step's keys; ``time/env`` and ``time/env_wait`` over the step's generation). The loss mask
is 1 on the sampled tokens only; versions and ages count the sampled tokens as for single-turn. A stage change or
the run's end closes the handler, freeing the unfinished groups' instances.

A multi-turn checkpoint holds no sequences in flight: the environments' instances are the user's objects, in the
reward workers, and cannot be saved (nor can a turn waiting on its worker). It records how many groups were in
flight or waiting; the resumed run says that it does not train them (and counts them in ``async/dropped_resume`` at
its first step, as a resume under another world size counts the saved live groups) and starts a new session (topped
up as at the start), so from the resumed step on it differs from the uninterrupted run (tests/test_async_multiturn.py).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch

from fastgrpo.algorithms.advantages import scale_rewards
from fastgrpo.algorithms.sampling import SEED_STRIDE, sampling_params
from fastgrpo.distributed import all_reduce, full_weights, is_fsdp, print0
from fastgrpo.engine.session import RUN_COUNTS
from fastgrpo.engine.snapshot import completion_from_state, completion_state
from fastgrpo.rewards import RewardResult, add_faults


def due_groups(live: Iterable[int], finished: Container[int], count: int) -> tuple[list[int], int]:
    """The in-order rule (module docstring, 2.): a step trains the ``count`` lowest of the ``live`` keys (added, not
    trained or dropped yet), in key order, once all of them have finished. Returns those keys (fewer when fewer are
    live: the caller refills) and how many of them are not in ``finished`` yet (at least that many more groups must
    finish before the step trains). ``bench/bench_async.py`` runs the same rule."""
    due = sorted(live)[:count]
    return due, sum(key not in finished for key in due)


def oldest_version(group: list) -> int:
    """The weight version of a group's oldest sampled token (``Completion.versions``)."""
    return min(min(c.versions) for c in group)


SAMPLING_SETTINGS = ("max_new_tokens", "max_sequence_tokens")
"""The stage settings the session's sampling depends on: a stage that changes one opens a new session."""


class AsyncRollout:
    """The generation session and the finished groups of one rank (module docstring); made by ``GRPO``.

    Groups are keyed ``base + k``, ``k`` the session's own key: a stage change opens a new session, whose keys start
    again at 0, after ``base`` (the keys of the sessions before it)."""

    def __init__(self, grpo):
        self.grpo = grpo
        self.ctx, self.cfg = grpo.ctx, grpo.cfg
        self.session = None
        self.turns = None  # multi-turn: the session's EnvTurns (fastgrpo.environments.turns)
        self.base = 0  # the run's key of the session's key 0
        self.version = 0  # the weights' version a new session starts at (a stage's goes on from the last one's)
        self.sampling: dict = {}  # SAMPLING_SETTINGS of the session
        self.rows: dict[int, int] = {}  # key -> its training row
        self.ready: list[tuple[int, list, list[float], dict[str, list[float]], list | None]] = []
        """Finished groups kept and not trained yet, in finishing order: (key, completions, the reward functions'
        total, per-function scores, multi-turn the trajectories else None). The live groups (``rows``' keys) are
        these and those in flight."""
        self.prompt_texts: dict[int, str] = {}
        self.prompts: dict[int, list[int]] = {}  # key -> its prompt ids (multi-turn: rendered after the reset)
        self.at_boundary = True  # between a step's end (after_update) and the next step's start
        self.saved: dict | None = None  # a checkpoint's state, taken back when the session opens
        self.lost_at_resume = 0  # groups a checkpoint could not carry (async/dropped_resume, once)
        self.parked: list[int] = []
        """Rows drawn for this rank and not added to the session yet, in data order: a top-up or refill that another
        rank needed and this rank's buffer had no room for (module docstring, 1.)."""

    @property
    def share(self) -> int:
        """This rank's groups per step."""
        return self.cfg.grpo.num_prompts_per_step // self.ctx.state.world_size

    def _open(self, settings: dict) -> None:
        """The session, fresh or (after a resume) with the checkpoint's sequences in flight and waiting groups (and
        the sampling settings they were started with, so that a stage change after the resume is seen)."""
        t, cfg, saved = self.ctx, self.cfg, self.saved
        seed = saved["session"]["seed"] if saved else (cfg.train.seed * SEED_STRIDE + t.step) * 1024 + t.state.rank
        self.sampling = dict(saved["sampling"]) if saved else {k: settings[k] for k in SAMPLING_SETTINGS}
        params = sampling_params(cfg, {**settings, **self.sampling}, n=cfg.grpo.num_generations, seed=seed)
        if self.grpo.envs is not None:  # multi-turn: one turn handler for the session's life
            from fastgrpo.environments import EnvTurns
            from fastgrpo.environments.rollout import multi_turn_params

            params = multi_turn_params(params, cfg, self.grpo.envs)
            self.turns = EnvTurns(self.grpo.envs, self.grpo.templates, [], params.n)
        longest = max(map(len, self.grpo.train_data.prompt_ids))
        self.session = t.engine.session(params, max_prompt_tokens=longest, on_group_done=self._submit,
                                        turns=self.turns, moving_weights=is_fsdp(t.wrapped),
                                        version=0 if saved else self.version)
        if saved:
            self.session.load_state_dict(saved["session"])
            self.base, self.rows = saved["base"], dict(saved["rows"])
            self.prompts = {key: self.grpo.train_data.prompt_ids[row] for key, row in self.rows.items()}
            self.prompt_texts = {key: t.tokenizer.decode(p) for key, p in self.prompts.items()}
            self.ready = [(g["key"], [completion_from_state(c) for c in g["group"]], g["total"], g["per_function"],
                           None) for g in saved["ready"]]
            self.saved = None

    def _submit(self, k: int, group: list) -> None:
        """A finished group goes to the reward pool at once (scored while the others decode; multi-turn, the
        environments' rewards too: the synchronous rule, reward functions on the final transcript)."""
        if self.turns is not None:
            self.turns.end_group(k)
        if self.grpo.rewards is None:
            return
        tok, data, key = self.ctx.tokenizer, self.grpo.train_data, self.base + k
        row = self.rows[key]
        texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in group]
        columns = data.columns([row])
        self.grpo.rewards.submit(key, [self.prompt_texts[key]] * len(group), texts,
                                 {k: v * len(group) for k, v in columns.items()})

    def _park(self, indices: list[int]) -> None:
        """This rank's share of the rows ``indices`` (all ranks') behind the parked ones."""
        st = self.ctx.state
        per_rank = len(indices) // st.world_size
        self.parked += indices[st.rank * per_rank : (st.rank + 1) * per_rank]

    def _admit(self, age: int) -> None:
        """Parked rows into the session, in order, while it holds fewer than ``B = (age + 1) · P_r`` live groups
        (multi-turn: their environments reset first, in the reward workers, and the prompts rendered with the
        tools). A group added so trains within ``age`` steps: at most ``B - 1`` live groups are ahead of it."""
        room = (age + 1) * self.share - len(self.rows)
        if room <= 0 or not self.parked:
            return
        idx, self.parked = self.parked[:room], self.parked[room:]
        if self.turns is not None:
            from fastgrpo.environments.rollout import env_rows

            prompts = self.turns.add(env_rows([self.grpo.train_data.rows[i] for i in idx], self.cfg))
        else:
            prompts = [self.grpo.train_data.prompt_ids[i] for i in idx]
        for k, i, p in zip(self.session.add(prompts), idx, prompts, strict=True):
            self.rows[self.base + k] = i
            self.prompts[self.base + k] = p
            self.prompt_texts[self.base + k] = self.ctx.tokenizer.decode(p)

    def _forget(self, keys) -> None:
        for key in keys:
            del self.rows[key], self.prompt_texts[key], self.prompts[key]

    def _collect(self, finished: list, faults: dict) -> tuple[dict, int]:
        """Score the groups the session just returned (the reward pool's scores, in key order) into ``ready``;
        returns the pool's times and how many groups dynamic sampling dropped (all rewards equal, before shaping),
        and adds the pool's fault counts to ``faults``."""
        if not finished:
            return {}, 0
        G = self.cfg.grpo.num_generations
        finished = [(self.base + k, group) for k, group in finished]
        if self.grpo.rewards is not None:
            result, times = self.grpo.rewards.gather()
            for name, counts in result.faults.items():
                add_faults(faults.setdefault(name, {}), counts)
        else:
            result, times = RewardResult(total=[0.0] * (len(finished) * G), per_function={}), {}
        at = {key: i * G for i, key in enumerate(sorted(key for key, _ in finished))}
        dropped = 0
        for key, group in finished:
            total = result.total[at[key] : at[key] + G]
            trajs = self.turns.take_group(key - self.base) if self.turns is not None else None
            w = self.cfg.env.reward_weight
            raw = scale_rewards(total if trajs is None else [r + w * tr.reward for r, tr in zip(total, trajs)],
                                self.cfg.reward_scaling)
            if self.cfg.grpo.use_dynamic_sampling and max(raw) == min(raw):  # no signal: the next live group is due
                self._forget([key])
                dropped += 1
                continue
            self.ready.append((key, group, total, {name: s[at[key] : at[key] + G]
                                                   for name, s in result.per_function.items()}, trajs))
        return times, dropped

    def _new_stage(self) -> int:
        """The stage changed the sampling settings: the unfinished groups are dropped (their rows forgotten), the
        finished ones stay to be trained, and the session is closed (the next :meth:`_open` starts one with the
        stage's settings). Returns the groups dropped."""
        dropped = self.session.in_flight
        waiting = {key for key, *_ in self.ready}
        self._forget([key for key in self.rows if key not in waiting])
        self.base += self.session.added
        self.version = self.session.version  # the next session's count goes on: the waiting groups' ages compare
        self.close()
        return dropped

    def _top_up(self, age: int) -> int:
        """Keep the buffer within one batch of ``B = (age + 1) · P_r`` groups (live, or parked): every rank draws as
        many batches from the data sampler as the rank shortest of ``B`` by whole batches needs (one collective),
        parks its share and admits what its buffer has room for. A new session (the first step, a stage) fills its
        buffer so; later, each signal-less (or stale) group dropped shrinks it by one until a batch's worth is
        missing. Returns the batches drawn."""
        t = self.ctx
        short = (age + 1) * self.share - len(self.rows) - len(self.parked)
        batches = int(all_reduce(torch.tensor([float(max(short, 0) // self.share)], device=t.coll_device()),
                                 op="max").item())
        for _ in range(batches):
            self._park(t.sampler.next(self.grpo.rows_per_step))
        self._admit(age)
        return batches

    def groups(self, indices: list[int], settings: dict) -> tuple[list, dict]:
        """This step's groups (``GRPO.score_groups``: rewards, advantages' inputs, sums) from the session, after
        queueing the rows ``indices`` (module docstring)."""
        t, g = self.ctx, self.cfg.grpo
        age = g.async_grpo.max_trajectory_age_steps
        changed = 0
        self.at_boundary = False
        faults: dict[str, dict[str, int]] = {}
        times: dict[str, float] = {}
        with t.timer("generation"), full_weights(t.wrapped):  # FSDP2: gathered once a step, on every rank
            if self.session is None and self.saved is not None:  # resumed: the saved session first, with its
                self._open(settings)  # sampling settings, so that a stage starting at this step is seen below
            if self.session is not None and self.sampling != {k: settings[k] for k in SAMPLING_SETTINGS}:
                changed = self._new_stage()
            if self.session is None:
                self._open(settings)
            self._park(indices)
            topup = self._top_up(age)
            stale = extra = zero_std = 0
            runs = dict.fromkeys(RUN_COUNTS, 0)  # the counts of the step's session runs
            while True:
                version = self.session.version
                fresh = [x for x in self.ready if version - oldest_version(x[1]) <= age]
                kept = {x[0] for x in fresh}
                self._forget([x[0] for x in self.ready if x[0] not in kept])  # dropped as stale
                stale += len(self.ready) - len(fresh)
                self.ready = fresh
                due, missing = due_groups(self.rows, kept, self.share)
                starving = len(due) < self.share  # dynamic sampling's drops left fewer live groups than the step
                if missing and not starving:
                    if not self.session.in_flight:  # the rows and the session disagree: fail, not spin
                        raise RuntimeError(f"async GRPO (step {t.step}): {missing} due groups are not in flight")
                    got, dropped = self._collect(self.session.run(missing), faults)
                    for k in RUN_COUNTS:  # engine.last_stats holds the last run's counts only
                        runs[k] += t.engine.last_stats.get(k, 0)
                    zero_std += dropped
                    for key, value in got.items():
                        times[key] = times.get(key, 0.0) + value
                    continue
                refill = all_reduce(torch.tensor([float(starving)], device=t.coll_device())).item()
                if not refill:  # sync: every rank decides together whether to refill
                    break
                if g.use_dynamic_sampling and extra + 1 >= g.dynamic_sampling_max_gen_batches:
                    raise RuntimeError(
                        f"dynamic sampling (async, step {t.step}): grpo.dynamic_sampling_max_gen_batches="
                        f"{g.dynamic_sampling_max_gen_batches} batches added and still fewer than the step's groups "
                        f"with rewards that differ ({zero_std} dropped on this rank); raise it, or train on prompts "
                        "the policy neither always solves nor always fails")
                self._park(t.sampler.next(self.grpo.rows_per_step))
                self._admit(age)
                extra += 1
        if not times and self.grpo.rewards is not None:  # nothing scored on this rank this step (its due groups had
            times = self.grpo.rewards.gather()[1]  # finished before): the pool's time keys, as every rank logs them
        if t.engine.last_stats:  # the generation/ metrics count every run of the step (the peaks: the session's)
            t.engine.last_stats = {**t.engine.last_stats, **runs}
        trained = set(due)
        chosen = sorted((x for x in self.ready if x[0] in trained), key=lambda x: x[0])  # in key order
        self.ready = [x for x in self.ready if x[0] not in trained]
        for key, *_ in chosen:
            self.prompt_texts.pop(key)
        idx = [self.rows.pop(key) for key, *_ in chosen]
        prompts = [self.prompts.pop(key) for key, *_ in chosen]
        outs = [group for _, group, *_ in chosen]
        names = list(chosen[0][3]) if chosen else []
        result = RewardResult(total=[r for _, _, total, *_ in chosen for r in total],
                              per_function={n: [s for *_, per, _ in chosen for s in per[n]] for n in names},
                              faults=faults)
        trajs = env_sums = None
        if self.turns is not None:  # the environments' rewards and the env/ sums of the step's groups
            from fastgrpo.environments.turns import trajectory_sums

            trajs = {(p, j): tr for p, x in enumerate(chosen) for j, tr in enumerate(x[4])}
            env_sums = {**trajectory_sums(outs, [x[4] for x in chosen]), **self.turns.lap()}
        groups, sums = self.grpo.score_groups(idx, prompts, outs, result, times, settings, trajs, env_sums)
        version = self.session.version
        ages = [version - v for group in outs for c in group for v, bit in zip(c.versions, c.loss_mask) if bit]
        waiting = sum(len(c.token_ids) for _, group, *_ in self.ready for c in group)
        sums.update({"async/age/sum": float(sum(ages)), "async/age_tokens/sum": float(len(ages)),
                     "async/age_max/max": float(max(ages, default=0)), "async/dropped_stale/sum": float(stale),
                     "async/dropped_stage/sum": float(changed), "async/dropped_zero_std/sum": float(zero_std),
                     "async/dropped_resume/sum": float(self.lost_at_resume),
                     "async/refill_batches/max": float(extra), "async/topup_batches/max": float(topup),
                     "async/in_flight/sum": float(self.session.in_flight),
                     "async/waiting/sum": float(len(self.ready)), "async/parked/sum": float(len(self.parked)),
                     "async/carried_tokens/sum": float(self.session.in_flight_tokens + waiting)})
        self.lost_at_resume = 0
        return groups, sums

    @staticmethod
    def finish_metrics(m: dict) -> None:
        """The step's ``async/`` metrics (module docstring) from their sums over ranks, in place."""
        m["async/age_mean"] = m.pop("async/age/sum") / max(m.pop("async/age_tokens/sum"), 1.0)
        for key in [k for k in m if k.startswith("async/") and k.endswith(("/sum", "/max"))]:
            m[key.rsplit("/", 1)[0]] = m.pop(key)

    def after_update(self) -> None:
        """The optimizer step is done: in-flight sequences continue on the new weights (version + 1)."""
        if self.session is not None:
            self.session.update(recompute_kv=self.cfg.grpo.async_grpo.recompute_kv_cache_after_weight_updates)
        self.at_boundary = True

    def state_dict(self) -> dict | None:
        """This rank's part of a checkpoint: the session's sequences in flight (``GenerationSession.state_dict``),
        the sampling settings it was opened with, the finished groups waiting with their scores, each key's training
        row. None when there is no session at a step boundary (an interruption mid-step: the resumed run opens a new
        session). Multi-turn: only how many groups were in flight or waiting (module docstring, Checkpoints)."""
        if self.session is None or not self.at_boundary:
            return None
        if self.turns is not None:  # the environments' instances (the user's objects, in the workers) are not saved
            return {"world_size": self.ctx.state.world_size, "env_groups": self.session.in_flight + len(self.ready),
                    "parked": list(self.parked)}
        return {"world_size": self.ctx.state.world_size, "parked": list(self.parked),
                "session": self.session.state_dict(), "base": self.base,
                "sampling": dict(self.sampling), "rows": dict(self.rows),
                "ready": [{"key": key, "group": [completion_state(c) for c in group], "total": list(total),
                           "per_function": {k: list(v) for k, v in per.items()}}
                          for key, group, total, per, _ in self.ready]}

    def load_state_dict(self, state: dict | None) -> None:
        """Take back :meth:`state_dict` (the session opens with it at the next step). None, or a state saved under
        another world size: the run goes on with a new session (what was in flight is not trained)."""
        if state is not None and state["world_size"] != self.ctx.state.world_size:
            live = len(state["rows"]) if "rows" in state else state["env_groups"]
            self.lost_at_resume = live + len(state.get("parked", []))  # the drawn rows not added yet too
            state = None
            print0("async GRPO: the checkpoint's sequences in flight were saved under another world size: a new "
                   "generation session starts (they are not trained)")
        if state is not None:  # the rows drawn and not added yet are added in order (a new session's too)
            self.parked = list(state.get("parked", []))
        if state is not None and "env_groups" in state:
            print0(f"async GRPO with environments: the checkpoint holds no sequences in flight (the environments' "
                   f"instances live in the reward workers and cannot be saved): the {state['env_groups']} groups in "
                   "flight or waiting on rank 0 at the save are not trained, a new generation session starts, and "
                   "the resumed run differs from an uninterrupted one from here")
            self.lost_at_resume = state["env_groups"]
            state = None
        self.saved = state

    def close(self) -> None:
        """Close the session and (multi-turn) free the environment instances of its unfinished groups."""
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.turns is not None:
            self.turns.close()
            self.turns = None
