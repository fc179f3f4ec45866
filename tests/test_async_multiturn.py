"""Async GRPO with multi-turn environments (fastgrpo.algorithms.async_rollout with ``env``): a paused turn is just
another pause.

- **Session fidelity.** A generation session with a turn handler, prompts added between runs and the weights moved
  in place between them (``update(recompute_kv=True)``): every sampled token's log-prob equals a teacher-forced
  Hugging Face forward of the whole conversation (prompt, turns, appended observations) under the weights of the
  version that sampled it, and trajectories pause at turns across the updates.
- **Through the trainer.** A tiny async run whose environment runs in a reward worker: every step trains
  ``num_prompts_per_step`` groups, in the data stream's order, none older than ``max_trajectory_age_steps``; each
  logged trajectory's reward is the reward function on its transcript plus ``env.reward_weight`` × the
  environment's reward, both recomputed from the log (the environment's in closed form from the engine's turn count
  and finish reason); the env/ metrics are those of the trained trajectories; the loss mask is 1 on exactly the
  sampled tokens (the observations, mask 0, decode to the environment's text and nothing else does); each step's
  generation/ counts add all of its session runs. The same with the K/V recomputed after each update (slow tier).
- **Checkpoints.** The environments' instances cannot be saved: a resumed run starts a new session, says how many
  groups it did not train, and goes on under the same rules.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generation import LOGPROB_ATOL, VOCAB, random_prompts, teacher_forced_logp, tiny_model
from test_generation_session import perturbed
from turn_script import CharTokenizer, ScriptedTurns

from fastgrpo.config import load_config
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.environments.core import TextStepEnvironment
from fastgrpo.metrics import read_jsonl

OBS = "~obs~"
LAST = 3  # CountTurns: the environment ends the trajectory after its LAST-th step
WEIGHT = 0.5  # env.reward_weight


class CountTurns(TextStepEnvironment):
    """A text-step environment whose reward depends on what the policy wrote: each step adds 1 for a turn of odd
    length (its text, without its end token) and answers ``OBS``; the trajectory ends after ``LAST`` steps."""

    def reset(self, **row):
        return None, {"steps": 0}

    def step(self, turn_text, state):
        state["steps"] += 1
        return OBS, float(len(turn_text) % 2), state["steps"] >= LAST, None


def parity(prompts, completions, **_):
    """The reward function: 1 for a transcript of odd length."""
    return [float(len(c) % 2) for c in completions]


def session_with_turns(seed: int, schedule: list[tuple[bool, int]], sync_every: int, rows: int) -> int:
    """Batches added at the steps ``schedule`` says, ``run(k)`` of its sizes, the weights moved after each (K/V
    recomputed), turns answered after random delays: every sampled token's log-prob is the teacher-forced forward's
    over the whole conversation under its version's weights (copies kept only here); observation tokens have
    log-prob 0, mask 0. Returns how many trajectories had turns of more than one version."""
    model = tiny_model("qwen2", seed=9)
    tok = CharTokenizer(VOCAB, seed=4)
    params = SamplingParams(n=2, max_new_tokens=6, max_turns=4, max_sequence_tokens=64, seed=seed,
                            stop_token_ids=tuple(range(0, VOCAB, 5)))
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=rows, page_size=4, sync_every=sync_every,
                              tokenizer=tok)
    batches = [random_prompts([3, 7], seed=seed + b) for b in range(len(schedule) + 1)]
    turns = ScriptedTurns(seed=seed, vocab=VOCAB, max_obs=4, finish_prob=0.15, max_delay=3)
    prompts, got, models = [], {}, [copy.deepcopy(model)]
    with engine.session(params, max_prompt_tokens=12, turns=turns) as s:
        prompts += batches[0]
        s.add(batches[0])
        for step, (add, k) in enumerate(schedule):
            if add:
                prompts += batches[step + 1]
                s.add(batches[step + 1])
            got.update(s.run(k))
            perturbed(model, seed + step)
            s.update(recompute_kv=True)
            models.append(copy.deepcopy(model))
        got.update(s.run(10**6))
    assert sorted(got) == list(range(len(prompts)))
    straddled = 0
    for key, group in got.items():
        for c in group:
            mask = torch.tensor(c.loss_mask, dtype=torch.bool)
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
            for version in set(c.versions):
                at = mask & (torch.tensor(c.versions) == version)
                want = teacher_forced_logp(models[version], prompts[key], c.token_ids)[at]
                torch.testing.assert_close(torch.tensor(c.logprobs)[at], want, atol=LOGPROB_ATOL, rtol=0)
            straddled += c.num_turns > 1 and len(set(c.versions)) > 1
    return straddled


def test_a_multi_turn_session_samples_each_token_from_its_version():
    """One schedule in which conversations go on across weight updates (their turns of two versions or more)."""
    assert session_with_turns(0, [(True, 2), (False, 3), (False, 2), (True, 3)], sync_every=3, rows=2) >= 1


@given(st.integers(0, 2**20), st.lists(st.tuples(st.booleans(), st.integers(1, 3)), min_size=2, max_size=4),
       st.sampled_from([1, 3]), st.integers(2, 6))
@settings(max_examples=6, deadline=None, derandomize=True)
def test_random_multi_turn_session_schedules_sample_each_token_from_its_version(seed, schedule, sync_every, rows):
    session_with_turns(seed, schedule, sync_every, rows)


P, G, AGE = 3, 4, 1
MT = [f"grpo.num_prompts_per_step={P}", f"grpo.num_generations={G}", "sft.warmup_steps=0", "eval.at_start=false",
      "eval.at_end=false", "eval.every_steps=0", "checkpoint.save_final=false", "logging.progress_bar=false",
      "train.num_threads=1", "reward.num_workers=1", "grpo.async_grpo.enabled=true", "grpo.rollout_is=token_truncate",
      f"grpo.async_grpo.max_trajectory_age_steps={AGE}", "data.shuffle=false",
      "env.environment_factory=test_async_multiturn:CountTurns", f"env.reward_weight={WEIGHT}",
      "reward.functions=[test_async_multiturn:parity]", "rollout.max_turns=4", "rollout.max_new_tokens=6",
      "rollout.max_sequence_tokens=0", "rollout.max_batch_size=24", "rollout.stop_strings=[e,a,o,' ',t,i,n]",
      "logging.log_rollouts=true"]


def fit(*overrides, inspect=None):
    """A run of ``MT`` + ``overrides``; ``inspect(trainer)`` before it starts (e.g. to wrap the rollout)."""
    from fastgrpo.trainer import Trainer

    trainer = Trainer(load_config(overrides=[*MT, *overrides]))
    try:
        if inspect is not None:
            inspect(trainer)
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def logged(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recompute", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_async_multi_turn_run_trains_in_order_with_the_synchronous_rewards(tmp_path, recompute):
    steps = 4
    seen = []

    def capture(trainer):
        rollout = trainer.algorithm.rollout

        def recording(indices, settings):
            samples, m = rollout(indices, settings)
            seen.append(samples)
            return samples, m

        trainer.algorithm.rollout = recording

    trainer = fit(f"train.max_steps={steps}", "checkpoint.every_steps=0", f"logging.output_dir={tmp_path}",
                  f"grpo.async_grpo.recompute_kv_cache_after_weight_updates={str(recompute).lower()}", inspect=capture)
    tok, data = trainer.tokenizer, trainer.algorithm.train_data
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trained = []
    for r in rows:
        assert 0 <= r["async/age_mean"] <= r["async/age_max"] <= AGE and r["async/dropped_stale"] == 0
        log = logged(tmp_path, r["step"])
        assert [(x["group"], x["sample"]) for x in log] == [(p, j) for p in range(P) for j in range(G)]
        for x in log:
            env = sum(len(t) % 2 for t in stepped_turns(x, tok))  # CountTurns' reward in closed form
            text = tok.decode(tok(x["completion"], add_special_tokens=False)["input_ids"], skip_special_tokens=True)
            assert x["rewards"] == {"parity": len(text) % 2, "env": env}
            assert x["reward"] == x["rewards"]["parity"] + WEIGHT * env
        trained += [x["prompt"] for x in log[::G]]
        # the env/ metrics are the trained trajectories' (every key a synchronous multi-turn step logs)
        assert r["env/turns_mean"] == sum(x["turns"] for x in log) / (P * G) and r["env/turns/max"] >= 1
        assert r["env/reward_mean"] == sum(x["rewards"]["env"] for x in log) / (P * G)
        for reason in ("stop", "length", "max_turns", "env_done", "error"):
            assert r[f"env/finish/{reason}"] == sum(x["finish_reason"] == reason for x in log) / (P * G)
        assert r["env/failures/step/sum"] == 0 and "time/env" in r and "env/tool_calls" in r
    assert max(r["async/age_max"] for r in rows) == AGE  # some trained groups straddled an update
    assert max(r["env/turns/max"] for r in rows) > 1
    # in order: the i-th group trained is the i-th row of the data stream (no group was dropped)
    assert all(data.rows[i]["prompt"] in prompt for i, prompt in enumerate(trained))
    # the steps' generation/ counts add up to the session's totals (engine.last_stats once it closed): each step
    # counts all of its session runs
    totals = trainer.ctx.engine.last_stats
    assert sum(r["generation/decode_steps/max"] for r in rows) == totals["decode_steps"]
    assert sum(r["generation/resume_prefill_tokens/sum"] for r in rows) == totals["resume_prefill_tokens"] > 0
    for samples in seen:  # the loss mask: 1 on exactly the sampled tokens
        for s in samples:
            runs = mask_runs(s.loss_mask, 0)
            assert all(tok.decode(s.completion_ids[a:b]).count(OBS) == 1 for a, b in runs)
            sampled = [t for t, m in zip(s.completion_ids, s.loss_mask) if m]
            assert OBS not in tok.decode(sampled) and len(runs) == sum(s.loss_mask[b:b + 1] == [1] for _, b in runs)


def test_multi_turn_dynamic_sampling_and_a_stage_change_lose_no_group(tmp_path):
    """Multi-turn async with dynamic sampling (groups of 2: about half tie) and a stage that raises the token limit
    at step 2: each step trains P groups whose rewards differ, each reward by the synchronous rule; the unfinished
    conversations are dropped at the stage change (their instances freed with the old handler) and a new session
    goes on; every group drawn is trained, dropped (tied, or at the stage change) or still live at the end."""
    steps = 4
    fit(f"train.max_steps={steps}", "checkpoint.every_steps=0", f"logging.output_dir={tmp_path}",
        "grpo.num_generations=2", "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=30",
        "stages=[{at_step: 2, max_new_tokens: 10}]", "rollout.max_batch_size=3")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["async/dropped_stage"] > 0 for r in rows] == [False, False, True, False]
    for r in rows:
        log = logged(tmp_path, r["step"])
        rewards = {}
        for x in log:
            assert x["reward"] == x["rewards"]["parity"] + WEIGHT * x["rewards"]["env"]
            rewards.setdefault(x["group"], set()).add(x["reward"])
        assert len(rewards) == P and all(len(r) == 2 for r in rewards.values())  # signal in every trained group
        assert r["frac_reward_zero_std"] == 0 and r["dynamic_sampling/dropped_groups"] == r["async/dropped_zero_std"]
        assert 0 <= r["async/age_mean"] <= r["async/age_max"] <= AGE and r["async/dropped_stale"] == 0
        assert r["loss"] == r["loss"]
    assert sum(r["async/dropped_zero_std"] for r in rows) > 0
    drawn = P * sum(1 + r["async/topup_batches"] + r["async/refill_batches"] for r in rows)
    dropped = sum(r["async/dropped_zero_std"] + r["async/dropped_stage"] for r in rows)
    last = rows[-1]
    assert drawn == P * steps + dropped + last["async/in_flight"] + last["async/waiting"] + last["async/parked"]


def stepped_turns(x: dict, tok) -> list[str]:
    """The turns the environment stepped, read back from a logged trajectory ``x``: its transcript split at the
    observations (the tiny tokenizer's template: the end of turn, the user message ``OBS``, the next assistant
    turn), each turn's text without a special end token (what ``step`` receives); the last turn was stepped unless
    the token limit cut it."""
    pieces = x["completion"].split(f"{tok.eos_token}<|user|>{OBS}<|assistant|>")
    assert len(pieces) == x["turns"]
    texts = [next((t[: -len(e)] for e in tok.all_special_tokens if t.endswith(e)), t) for t in pieces]
    return texts if x["finish_reason"] != "length" else texts[:-1]


def mask_runs(mask: list[int], bit: int) -> list[tuple[int, int]]:
    """The [start, end) runs of ``bit`` in ``mask``."""
    runs, start = [], None
    for i, m in enumerate([*mask, 1 - bit]):
        if m == bit and start is None:
            start = i
        elif m != bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_a_resumed_multi_turn_run_starts_a_new_session_and_says_so(tmp_path, capsys):
    """The step-1 checkpoint holds only how many groups were in flight or waiting (the environments' instances
    cannot be saved); the resumed run says it does not train them, counts them (``async/dropped_resume``), starts
    a new session (topped up to ``(AGE + 1) · P`` groups as a first step is) and trains steps 2 and 3 under the
    same rules."""
    run = ["checkpoint.every_steps=1", "checkpoint.keep_last=10", f"logging.output_dir={tmp_path}"]
    fit(*run, "train.max_steps=2")  # killed after step 2: the run resumes from step 1's checkpoint
    state = torch.load(tmp_path / "checkpoints" / "step_00000001" / "state_rank0.pt", weights_only=True)
    assert "session" not in state["async"] and state["async"]["env_groups"] > 0
    capsys.readouterr()
    fit(*run, "train.max_steps=3", "checkpoint.resume=auto")
    assert f"the {state['async']['env_groups']} groups in flight or waiting" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["async/topup_batches"] == AGE  # a new session, filled as at the start
    lost = [r["async/dropped_resume"] for r in rows]
    assert lost == [0, state["async"]["env_groups"], 0]  # counted once, at the resumed run's first step
    for r in rows[1:]:
        assert r["async/age_max"] <= AGE and r["async/dropped_stale"] == 0 and r["env/turns/max"] >= 1
        assert len(logged(tmp_path, r["step"])) == P * G


@pytest.mark.slow  # 2 torchrun processes
def test_two_processes_each_run_their_own_environments(tmp_path):
    """2 ranks, each with its own session and turn handler (its own reward worker): every step logs each rank's
    share of the groups, the ages within the bound, and each trajectory's reward by the synchronous rule."""
    from test_async_grpo import torchrun

    from fastgrpo.models.loading import build_tiny_tokenizer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torchrun(run_dir, *MT, "grpo.num_prompts_per_step=4", "train.max_steps=3", "checkpoint.every_steps=0")
    tok = build_tiny_tokenizer()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["async/age_max"] <= AGE for r in rows)
    for step in (1, 2, 3):
        for rank in (0, 1):
            log = [json.loads(x) for x in
                   (run_dir / "rollouts" / f"step_{step:08d}.rank{rank}.jsonl").read_text().splitlines()]
            assert len(log) == 2 * G
            for x in log:
                assert x["rewards"]["env"] == sum(len(t) % 2 for t in stepped_turns(x, tok))
                assert x["reward"] == x["rewards"]["parity"] + WEIGHT * x["rewards"]["env"]
