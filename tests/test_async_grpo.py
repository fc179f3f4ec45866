"""Async GRPO (fastgrpo.algorithms.async_rollout): a tiny run with the generation session kept across steps.

Every step trains exactly ``num_prompts_per_step`` groups, the lowest live keys in order, none older than
``max_trajectory_age_steps`` and none dropped as stale; groups are conserved (every prompt added is trained, dropped
without signal or at a stage change, still in flight or finished and waiting: none is lost or trained twice), small
KV budgets and few rows make groups straddle updates so that old tokens occur; a run resumed from a checkpoint
(in-process, and after a SIGKILL of torchrun's processes) continues with the sequences that were in flight and logs
the uninterrupted run's rows; the config refuses what the mode does not support."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
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


TIMING = ("time", "tokens_per_second", "peak_memory_gib")  # the wall clock's and the process's, not the run's
RESUMABLE = ["rollout.max_new_tokens=24", "rollout.max_batch_size=3", "checkpoint.every_steps=2",
             "checkpoint.keep_last=10", "reward.functions=[test_async_grpo:parity_reward]"]


def parity_reward(prompts, completions, **_):
    """1 for a completion of odd length: the tiny untrained model's groups get rewards that differ (a loss)."""
    return [float(len(c) % 2) for c in completions]


def fit(*overrides):
    from fastgrpo.trainer import Trainer

    trainer = Trainer(load_config(overrides=[*SMALL, *overrides]))
    try:
        trainer.fit()
    finally:
        trainer.close()


def rows_of(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_jsonl(Path(run_dir) /
                                                                                        "metrics.jsonl")]


def assert_same_rows(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        diff = {k: (ra[k], rb[k]) for k in ra if ra[k] != rb[k] and not (ra[k] != ra[k] and rb[k] != rb[k])}  # nan
        assert not diff, f"step {ra['step']}: {diff}"


def assert_groups_conserved(rows, age):
    """Every group drawn (each step's batch, the top-ups that keep the buffer, the refills) is trained, dropped
    (stale, without signal, at a stage change), in flight, waiting or parked at the end: none lost, none trained
    twice; and each step starts with its buffer within one batch of (age + 1) · P groups."""
    drawn = P * (len(rows) + sum(r["async/topup_batches"] + r["async/refill_batches"] for r in rows))
    dropped = sum(r[f"async/dropped_{why}"] for r in rows for why in ("stale", "zero_std", "stage"))
    last = rows[-1]
    assert drawn == P * len(rows) + dropped + last["async/in_flight"] + last["async/waiting"] + last["async/parked"]
    assert_buffer_kept(rows, age)


def assert_buffer_kept(rows, age):
    """At each step's start (its batch and top-ups drawn): at least (age + 1) · P − (P − 1) groups in flight,
    waiting or parked, i.e. the last step's carried groups (less those a stage change drops first) plus what this
    step drew; exactly (age + 1) · P at the first. At its end at most (age + 1) · P − P live (in flight or
    waiting): the step trained P of at most (age + 1) · P, so none can go stale."""
    carried = 0
    for r in rows:
        start = carried - r["async/dropped_stage"] + P * (1 + r["async/topup_batches"])
        assert start >= (age + 1) * P - (P - 1), (r["step"], start)
        assert r["async/in_flight"] + r["async/waiting"] <= age * P, r
        carried = r["async/in_flight"] + r["async/waiting"] + r["async/parked"]
    assert P * (1 + rows[0]["async/topup_batches"]) == (age + 1) * P


def logged_groups(run_dir, step):
    """The step's trained groups from its rollout log: group index -> [(tokens, reward)] of its samples."""
    groups = {}
    for line in (Path(run_dir) / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines():
        x = json.loads(line)
        groups.setdefault(x["group"], []).append((x["completion_tokens"], x["reward"]))
    return groups


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
        assert 0 <= r["async/age_mean"] <= r["async/age_max"] <= age and r["async/dropped_stale"] == 0  # in order
        logged = (tmp_path / "rollouts" / f"step_{r['step']:08d}.jsonl").read_text().splitlines()
        assert len(logged) == P * G and {json.loads(x)["sample"] for x in logged} == set(range(G))
    assert_groups_conserved(rows, age)
    assert max(r["async/age_max"] for r in rows) == age  # some trained groups straddled an update
    # their older tokens: the behaviour log-probs differ from the policy's (nan: a step with no trained token)
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows if r["async/age_max"]) > 0


@pytest.mark.parametrize("stages", [[], ["stages=[{at_step: 2, max_new_tokens: 12}]"]])
def test_a_resumed_run_continues_with_the_sequences_in_flight(tmp_path, stages):
    """With the K/V recomputed after each update, a run resumed from its step-2 checkpoint (the sequences in flight,
    the finished groups waiting, the session's counters) logs steps 3 and 4 exactly as the run that kept going; also
    when a stage starts at step 3, right after the checkpoint (the resumed run opens the saved session first, with
    its settings, and sees the stage change at the same step)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run = [*RESUMABLE, "train.max_steps=4", "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true", *stages]
    fit(*run, f"logging.output_dir={full}")
    shutil.copytree(full, resumed)  # its latest checkpoint: step 2 (checkpoint.save_final is off)
    state = torch.load(resumed / "checkpoints" / "step_00000002" / "state_rank0.pt", weights_only=True)
    assert state["async"]["session"]["queue"]  # something was in flight
    fit(*run, f"logging.output_dir={resumed}", "checkpoint.resume=auto")
    assert_same_rows(rows_of(full), rows_of(resumed))
    if stages:  # the stage change dropped unfinished groups at step 3 in both
        assert [r["async/dropped_stage"] > 0 for r in rows_of(full)] == [False, False, True, False]


def test_a_checkpoint_from_another_world_size_is_counted_as_lost(tmp_path, capsys):
    """A step-2 checkpoint saved under another world size cannot give this rank its sequences in flight: the resumed
    run says so, starts a new session (topped up as a first step is) and counts the saved groups (in flight and
    waiting: the checkpoint's training rows; parked) in ``async/dropped_resume`` at its first step only."""
    run = [*RESUMABLE, "train.max_steps=4", f"logging.output_dir={tmp_path}"]
    fit(*run[:-2], "train.max_steps=3", run[-1])  # killed after step 3: resumes from step 2's checkpoint
    path = tmp_path / "checkpoints" / "step_00000002" / "state_rank0.pt"
    state = torch.load(path, weights_only=True)
    assert state["async"]["rows"]  # live groups at the save
    state["async"]["world_size"] = 2
    torch.save(state, path)
    capsys.readouterr()
    fit(*run, "checkpoint.resume=auto")
    assert "saved under another world size" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    lost = len(state["async"]["rows"]) + len(state["async"]["parked"])  # live and parked
    assert [r["async/dropped_resume"] for r in rows] == [0, 0, lost, 0]
    assert rows[2]["async/topup_batches"] == 1  # a new session, filled to (age + 1) · P as at the start


def test_dynamic_sampling_refills_with_groups_that_have_signal(tmp_path):
    """grpo.use_dynamic_sampling with async: a group whose rewards are all equal is dropped when it finishes and the
    refill replaces it; every step trains P groups, each with rewards that differ, and every group is accounted
    for (groups of 2: about half tie under the parity reward)."""
    steps = 4
    fit(*RESUMABLE, "checkpoint.every_steps=0", "grpo.num_generations=2", "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=30", f"train.max_steps={steps}", f"logging.output_dir={tmp_path}")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        groups = logged_groups(tmp_path, r["step"])
        assert len(groups) == P and all(len({x[1] for x in g}) == 2 for g in groups.values())
        assert r["frac_reward_zero_std"] == 0 and r["dynamic_sampling/dropped_groups"] == r["async/dropped_zero_std"]
        assert r["loss"] == r["loss"]  # a finite update on every step
    assert sum(r["async/dropped_zero_std"] for r in rows) > 0 and sum(r["async/refill_batches"] for r in rows) > 0
    assert_groups_conserved(rows, 1)


def test_a_stage_change_trains_the_finished_groups_and_drops_the_unfinished(tmp_path):
    """A stage that raises max_new_tokens from 8 to 16 at step 2: the groups still unfinished then are dropped
    (async/dropped_stage), the finished ones are trained, a new session samples with the stage's limit; every group
    is accounted for (two sessions' buffers)."""
    steps = 5
    fit("rollout.max_new_tokens=8", "rollout.max_batch_size=3", "reward.functions=[test_async_grpo:parity_reward]",
        "stages=[{at_step: 2, max_new_tokens: 16}]", f"train.max_steps={steps}", f"logging.output_dir={tmp_path}")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["async/dropped_stage"] > 0 for r in rows] == [False, False, True, False, False]
    assert all(0 <= r["async/age_mean"] <= r["async/age_max"] <= 1 for r in rows)
    lengths = [[n for g in logged_groups(tmp_path, r["step"]).values() for n, _ in g] for r in rows]
    assert all(len(x) == P * G for x in lengths)
    assert max(lengths[0] + lengths[1]) <= 8 and max(x for step in lengths[2:] for x in step) == 16
    assert_groups_conserved(rows, 1)


def test_the_groups_a_stage_change_trains_keep_their_age(tmp_path):
    """Every group finishes in step 1 (room for all rows), so at step 2's stage change the P groups waiting were
    sampled at version 0 and train at version 1: the new session's version goes on from the old one's, so their
    age is 1 (a session counting from 0 again gave them age 0, and would never see them go stale)."""
    fit("rollout.max_new_tokens=8", "rollout.max_batch_size=64", "reward.functions=[test_async_grpo:parity_reward]",
        "stages=[{at_step: 1, max_new_tokens: 16}]", "train.max_steps=2", f"logging.output_dir={tmp_path}")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["async/waiting"] == P and rows[0]["async/in_flight"] == 0 and rows[1]["async/dropped_stage"] == 0
    assert [(r["async/age_mean"], r["async/age_max"]) for r in rows] == [(0, 0), (1, 1)]
    assert logged_groups(tmp_path, 2) and max(n for g in logged_groups(tmp_path, 2).values() for n, _ in g) <= 8


class ScriptedSession:
    """Stands in for the engine's generation session: group ``key`` finishes after ``durations[key]`` rounds
    (cycled) once added; its completions' first token has the version the weights had when it was added, the rest
    the version at its finish (the versions a real session records for a sample that decoded across updates). A
    group with ``ties[key]`` (cycled) has samples of one length (all equal under :func:`parity_reward`), the others
    alternate two lengths."""

    def __init__(self, tok, durations, ties, on_group_done, n):
        self.tok, self.durations, self.ties, self.on_group_done, self.n = tok, durations, ties, on_group_done, n
        self.version, self.tick, self.pending, self.added, self.returned = 0, 0, {}, 0, []
        self.keys = {}  # id of a returned group's first completion -> its key

    @property
    def in_flight(self):
        return len(self.pending)

    in_flight_tokens = 0  # a scripted group samples all its tokens when it finishes

    def tie(self, key):
        return self.ties[key % len(self.ties)]

    def tokens(self, key, sample):
        """Sample ``sample``'s tokens: an answer, one more digit on the odd samples of a group with signal, EOS."""
        text = "\\boxed{3}" if self.tie(key) or sample % 2 == 0 else "\\boxed{33}"
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

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
                group = [Completion(ids, [0.0] * len(ids), "stop", versions=[start] + [self.version] * (len(ids) - 1))
                         for ids in (self.tokens(key, j) for j in range(self.n))]
                self.returned.append((key, self.version - start))
                self.keys[id(group[0])] = key
                self.on_group_done(key, group)
                out.append((key, group))
        return out

    def update(self, recompute_kv=False):
        self.version += 1
        return self.version

    def close(self):
        pass


class ScriptedEngine:
    def __init__(self, tok, durations, ties=(False,)):
        self.tok, self.durations, self.ties, self.last_stats, self.sessions = tok, durations, ties, {}, []

    def session(self, params, *, max_prompt_tokens, on_group_done, moving_weights, turns=None, version=0):
        assert turns is None and version == 0  # single-turn (multi-turn: tests/test_async_multiturn.py), one stage
        self.sessions.append(ScriptedSession(self.tok, self.durations, self.ties, on_group_done, params.n))
        return self.sessions[-1]


@given(st.lists(st.integers(1, 6) | st.integers(8, 16), min_size=1, max_size=12), st.integers(1, 2),
       st.lists(st.booleans(), min_size=1, max_size=4) | st.none(), st.lists(st.integers(0, 1), max_size=6))
@settings(max_examples=8, deadline=None, derandomize=True)
def test_steps_train_the_lowest_live_groups_in_order_and_lose_none(durations, age, ties, other):
    """Groups finish in a scripted order (some straddle several updates; ``ties``: dynamic sampling on, the groups
    whose rewards all tie dropped; ``other``: another rank that needs a top-up or a refill at those collectives,
    so this rank draws rows it has no room for). Each step trains the P lowest live keys (added, not trained, not
    dropped without signal), in key order, waiting for them however long they decode: no trained group is older
    than max_trajectory_age_steps and none is dropped as stale; every group drawn is trained, dropped, in flight,
    waiting or parked. The age metrics are those of the trained tokens (recomputed from the groups the step scored
    and the session's version), the waiting and carried figures those of the groups finished and not trained."""
    import tempfile

    from fastgrpo.algorithms import async_rollout
    from fastgrpo.trainer import Trainer

    demands = iter(other)

    def all_reduce(x, op="sum"):  # this rank's value, or another rank's larger one (the collective's answer)
        return torch.maximum(x, torch.full_like(x, float(next(demands, 0))))

    steps = 6
    ties = ties and [*ties, False]  # at least one group in the cycle has signal
    dynamic = ["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=30"] if ties else []
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides=[*SMALL, f"train.max_steps={steps}", "rollout.max_new_tokens=8",
                                     f"grpo.async_grpo.max_trajectory_age_steps={age}", f"logging.output_dir={out}",
                                     "reward.functions=[test_async_grpo:parity_reward]", *dynamic])
        trainer = Trainer(cfg)
        seen = []  # per step: (the trained tokens' ages, the groups waiting, their tokens)
        trained, score_groups = set(), trainer.algorithm.score_groups

        def spy(idx, prompts, outs, *args):
            session = engine.sessions[0]
            keys = [session.keys[id(group[0])] for group in outs]
            dropped = {k for k, _ in session.returned if ties and session.tie(k)}  # no signal: dynamic sampling's
            live = sorted(set(range(session.added)) - trained - dropped)
            assert keys == live[:P], (keys, live)  # the P lowest live keys, in order
            trained.update(keys)
            waiting = {k for k, _ in session.returned} - trained - dropped
            carried = sum(len(session.tokens(k, j)) for k in waiting for j in range(G))
            seen.append(([session.version - v for group in outs for c in group for v in c.versions], len(waiting),
                         carried))
            return score_groups(idx, prompts, outs, *args)

        trainer.algorithm.score_groups = spy
        try:
            trainer.ctx.engine = engine = ScriptedEngine(trainer.tokenizer, durations, ties or (False,))
            with patch.object(async_rollout, "all_reduce", all_reduce):
                trainer.fit()
        finally:
            trainer.close()
        rows = read_jsonl(f"{out}/metrics.jsonl")
        for r, (a, waiting, carried) in zip(rows, seen, strict=True):
            logged = open(f"{out}/rollouts/step_{r['step']:08d}.jsonl").read().splitlines()
            assert len(logged) == P * G and r["async/age_max"] <= age and r["async/dropped_stale"] == 0
            assert r["async/age_mean"] == pytest.approx(sum(a) / len(a), rel=1e-12) and r["async/age_max"] == max(a)
            assert r["async/waiting"] == waiting and r["async/carried_tokens"] == carried
    (session,) = engine.sessions
    zero_std = sum(r["async/dropped_zero_std"] for r in rows)
    assert zero_std == sum(bool(ties) and session.tie(k) for k, _ in session.returned)
    drawn = P * (steps + sum(r["async/topup_batches"] + r["async/refill_batches"] for r in rows))
    assert drawn - rows[-1]["async/parked"] == session.added
    assert session.added == P * steps + zero_std + rows[-1]["async/in_flight"] + rows[-1]["async/waiting"]
    assert rows[-1]["async/in_flight"] == session.in_flight
    assert_buffer_kept(rows, age)


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
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["async/age_max"] <= 1 for r in rows)
    for step in (1, 2, 3):
        for rank in (0, 1):
            logged = (tmp_path / "rollouts" / f"step_{step:08d}.rank{rank}.jsonl").read_text().splitlines()
            assert len(logged) == P // 2 * G


def torchrun(run_dir, *overrides, nproc=2, wait=True):
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), env.get("PYTHONPATH", "")])  # parity_reward
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(root / "fastgrpo" / "train.py"), *SMALL, *overrides, f"logging.output_dir={run_dir}"]
    if not wait:
        return subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def kill_9(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (torchrun starts each worker in a session of its own, so its
    process group would not reach them): the tree is read from /proc first, then each is killed by its id."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow  # 3 torchrun runs of 2 processes
@pytest.mark.parametrize("recompute", [True, False])
def test_kill_9_after_a_checkpoint_resumes_with_the_same_rows(tmp_path, recompute):
    """torchrun with 2 ranks, killed with SIGKILL (every process) once its step-2 checkpoint is complete, resumed
    from its latest checkpoint: each rank takes back its own sequences in flight (``state_rank{r}.pt``). With the
    K/V recomputed after each update the resumed run logs every row as the uninterrupted run does; without, the rows
    up to the checkpoint are the same and every group is still accounted for (the resumed samples continue on K/V of
    the loaded weights: fastgrpo.algorithms.async_rollout)."""
    steps = 5
    run = [*RESUMABLE, f"grpo.async_grpo.recompute_kv_cache_after_weight_updates={str(recompute).lower()}"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    torchrun(full, *run, f"train.max_steps={steps}")
    proc = torchrun(killed, *run, "train.max_steps=1000", wait=False)
    marker = killed / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_9(proc.pid)
    _, err = proc.communicate(timeout=60)
    assert marker.exists(), err[-3000:]
    out = torchrun(killed, *run, f"train.max_steps={steps}", "checkpoint.resume=auto")
    at = int(out.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert 2 <= at < steps  # its latest complete checkpoint
    a, b = rows_of(full), rows_of(killed)
    if recompute:
        assert_same_rows(a, b)
    else:
        assert_same_rows(a[:at], b[:at])
        assert [r["step"] for r in b] == list(range(1, steps + 1))
        assert_groups_conserved(b, 1)
        assert all(r["async/age_max"] <= 1 for r in b)


@pytest.mark.slow  # 2 torchrun runs of 2 processes
def test_fsdp2_trains_as_ddp_does(tmp_path):
    """train.strategy=fsdp2 with async: the session decodes inside one full_weights block per step and its gathered
    weights may move between steps (moving_weights). Its rows equal DDP's run of the same steps up to the rounding
    of the sharded update (the same tokens and rewards; the losses and norms to 1e-4): had the session read freed
    or stale storage, the tokens and their behaviour log-probs would differ."""
    run = [*RESUMABLE, "checkpoint.every_steps=0", "train.max_steps=4", "grpo.async_grpo.max_trajectory_age_steps=1"]
    torchrun(tmp_path / "ddp", *run)
    torchrun(tmp_path / "fsdp2", *run, "train.strategy=fsdp2")
    a, b = rows_of(tmp_path / "ddp"), rows_of(tmp_path / "fsdp2")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6, nan_ok=True), (ra["step"], k)
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            name = f"step_{step:08d}.rank{rank}.jsonl"
            assert (tmp_path / "ddp" / "rollouts" / name).read_text() == (tmp_path / "fsdp2" / "rollouts" /
                                                                          name).read_text()


@pytest.mark.parametrize("override, message", [
    ("grpo.rollout_is=none", "grpo.rollout_is must correct"),
    ("grpo.async_grpo.in_flight_weight_updates=false", "in_flight_weight_updates must be true"),
    ("grpo.async_grpo.max_trajectory_age_steps=0", "max_trajectory_age_steps"),
])
def test_config_refuses_what_async_does_not_support(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=[*SMALL, override])


def test_config_refuses_model_rewards_with_dynamic_sampling(tmp_path):
    with pytest.raises(ValueError, match="not supported with async GRPO and grpo.use_dynamic_sampling"):
        load_config(overrides=[*SMALL, "grpo.use_dynamic_sampling=true", f"reward.models=[{{path: {tmp_path}}}]"])
