"""Async GRPO (fastgrpo.algorithms.async_rollout): a tiny run with the generation session kept across steps.

Every step trains exactly ``num_prompts_per_step`` groups, none older than ``max_trajectory_age_steps``; groups are
conserved (every prompt added is trained, dropped as stale, still in flight or finished and waiting: none is lost
or trained twice), small KV budgets and few rows make groups straddle updates so that old tokens and stale drops
occur; the config refuses what the mode does not support."""

import json
import os

import pytest
from checks import one_thread  # noqa: F401  (one_thread: a module fixture)
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.config import load_config
from fastgrpo.metrics import read_jsonl

P, G = 4, 4
SMALL = [f"grpo.num_prompts_per_step={P}", f"grpo.num_generations={G}", "sft.warmup_steps=0", "eval.at_start=false",
         "eval.at_end=false", "eval.every_steps=0", "checkpoint.every_steps=0", "checkpoint.save_final=false",
         "logging.progress_bar=false", "train.num_threads=1", "reward.num_workers=0", "grpo.async_grpo.enabled=true",
         "grpo.rollout_is=token_truncate"]


def parity_reward(prompts, completions, **_):
    """1 for a completion of odd length: the tiny untrained model's groups get rewards that differ (a loss)."""
    return [float(len(c) % 2) for c in completions]


@pytest.mark.parametrize("recompute", [False, pytest.param(True, marks=pytest.mark.slow)])  # the engine's recompute:
# tests/test_generation_session.py
def test_async_steps_train_fresh_groups_and_lose_none(tmp_path, recompute):
    from fastgrpo.trainer import Trainer

    steps, age = 5, 1
    cfg = load_config(overrides=[*SMALL, f"train.max_steps={steps}", "rollout.max_new_tokens=24",
                                 "rollout.max_batch_size=3", f"grpo.async_grpo.max_trajectory_age_steps={age}",
                                 "reward.functions=[test_async_grpo:parity_reward]",
                                 f"grpo.async_grpo.recompute_kv_cache_after_weight_updates={str(recompute).lower()}",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert 0 <= r["async/group_age/mean"] <= r["async/group_age/max"] <= age
        logged = (tmp_path / "rollouts" / f"step_{r['step']:08d}.jsonl").read_text().splitlines()
        assert len(logged) == P * G and {json.loads(x)["sample"] for x in logged} == set(range(G))
    added = P * (steps + age + sum(r["async/extra_batches/max"] for r in rows))
    last = rows[-1]
    kept = P * steps + sum(r["async/stale_groups/sum"] for r in rows) + last["async/in_flight_groups/sum"] + \
        last["async/waiting_groups/sum"]
    assert added == kept  # every group added is trained, dropped as stale, in flight or waiting
    assert max(r["async/group_age/max"] for r in rows) == age  # some trained groups straddled an update
    # their older tokens: the behaviour log-probs differ from the policy's (nan: a step with no trained token)
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows if r["async/group_age/max"]) > 0


class ScriptedSession:
    """Stands in for the engine's generation session: group ``key`` finishes after ``durations[key]`` rounds
    (cycled) once added; its completions' first token has the version the weights had when it was added, the rest
    the version at its finish (the versions a real session records for a sample that decoded across updates)."""

    def __init__(self, tok, durations, on_group_done, n):
        self.tok, self.durations, self.on_group_done, self.n = tok, durations, on_group_done, n
        self.version, self.tick, self.pending, self.added, self.returned = 0, 0, {}, 0, []

    @property
    def in_flight(self):
        return len(self.pending)

    def add(self, prompts):
        keys = list(range(self.added, self.added + len(prompts)))
        for key in keys:
            self.pending[key] = (self.tick + self.durations[key % len(self.durations)], self.version)
        self.added += len(prompts)
        return keys

    def run(self, groups):
        from fastgrpo.engine.engine import Completion

        out = []
        while len(out) < groups and self.pending:
            self.tick += 1
            for key in [k for k, (due, _) in self.pending.items() if due <= self.tick]:
                _, start = self.pending.pop(key)
                ids = self.tok("\\boxed{3}", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                group = [Completion(ids, [0.0] * len(ids), "stop", versions=[start] + [self.version] * (len(ids) - 1))
                         for _ in range(self.n)]
                self.returned.append((key, self.version - start))
                self.on_group_done(key, group)
                out.append((key, group))
        return out

    def update(self, recompute_kv=False):
        self.version += 1
        return self.version

    def close(self):
        pass


class ScriptedEngine:
    def __init__(self, tok, durations):
        self.tok, self.durations, self.last_stats, self.sessions = tok, durations, {}, []

    def session(self, params, *, max_prompt_tokens, on_group_done):
        self.sessions.append(ScriptedSession(self.tok, self.durations, on_group_done, params.n))
        return self.sessions[-1]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(1, 2))
@settings(max_examples=6, deadline=None, derandomize=True)
def test_stale_groups_are_dropped_and_every_group_is_accounted_for(durations, age):
    """Groups finish in a scripted order (some straddle several updates): no trained group is older than
    max_trajectory_age_steps, every group whose age at its finish already exceeds it is dropped, and every group
    added is trained, dropped, in flight or waiting."""
    import tempfile

    from fastgrpo.trainer import Trainer

    steps = 4
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides=[*SMALL, f"train.max_steps={steps}", "rollout.max_new_tokens=8",
                                     f"grpo.async_grpo.max_trajectory_age_steps={age}", f"logging.output_dir={out}"])
        trainer = Trainer(cfg)
        try:
            trainer.ctx.engine = engine = ScriptedEngine(trainer.tokenizer, durations)
            trainer.fit()
        finally:
            trainer.close()
        rows = read_jsonl(f"{out}/metrics.jsonl")
        for r in rows:
            logged = open(f"{out}/rollouts/step_{r['step']:08d}.jsonl").read().splitlines()
            assert len(logged) == P * G and r["async/group_age/max"] <= age
    (session,) = engine.sessions
    stale = sum(r["async/stale_groups/sum"] for r in rows)
    assert stale >= sum(a > age for _, a in session.returned)
    added = P * (steps + age + sum(r["async/extra_batches/max"] for r in rows))
    assert added == session.added == P * steps + stale + rows[-1]["async/in_flight_groups/sum"] + \
        rows[-1]["async/waiting_groups/sum"]
    assert rows[-1]["async/in_flight_groups/sum"] == session.in_flight


@pytest.mark.slow  # 2 torchrun processes
def test_two_processes_each_train_their_share(tmp_path):
    """2 ranks, each with its own session: every step logs each rank's share of groups (P / 2 x G rows per rank's
    file), the ages within the bound, and the run ends normally (the refill decision is one collective)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(root / "fastgrpo" / "train.py"), *SMALL, "train.max_steps=3", "rollout.max_new_tokens=8",
                           f"logging.output_dir={tmp_path}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["async/group_age/max"] <= 1 for r in rows)
    for step in (1, 2, 3):
        for rank in (0, 1):
            logged = (tmp_path / "rollouts" / f"step_{step:08d}.rank{rank}.jsonl").read_text().splitlines()
            assert len(logged) == P // 2 * G


@pytest.mark.parametrize("override, message", [
    ("grpo.rollout_is=none", "grpo.rollout_is must correct"),
    ("grpo.use_dynamic_sampling=true", "grpo.use_dynamic_sampling is not supported"),
    ("train.strategy=fsdp2", "fsdp2 is not supported"),
    ("grpo.async_grpo.in_flight_weight_updates=false", "in_flight_weight_updates must be true"),
    ("grpo.async_grpo.max_trajectory_age_steps=0", "max_trajectory_age_steps"),
])
def test_config_refuses_what_async_does_not_support(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=[*SMALL, override])
