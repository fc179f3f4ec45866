"""The trainer end to end: a short tiny run under torchrun (metrics, plot, config, loadable checkpoint), and a
resumed run that continues with the same metrics as an uninterrupted one; the rollout's rewards, advantages, masks,
overlong shaping and dynamic sampling (scripted completions, so every count is known; 2 ranks under torchrun)."""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checks import ScriptedEngine
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fastgrpo.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "fastgrpo" / "train.py"
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6",
         "sft.warmup_steps=2", "sft.batch_size=8", "eval.num_prompts=8", "eval.every_steps=0",
         "checkpoint.every_steps=2", "logging.progress_bar=false", "train.num_threads=1"]
# values that depend on the wall clock or the process, not on the computation
TIMING = ("time", "time/", "tokens_per_second", "peak_memory_gib")


def train(tmp_path, run_dir, *overrides, nproc=1):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(TRAIN),
           *SMALL, f"logging.output_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def training_rows(run_dir):
    rows = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if not any(k.startswith("eval/") for k in r)]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and (
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    out = train(tmp, tmp / "run", "train.max_steps=4")
    return tmp / "run", out


def test_end_to_end_tiny_run(full_run):
    run_dir, out = full_run
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert "resolved config:" in out and f"metrics:    {run_dir / 'metrics.jsonl'}" in out
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.png").stat().st_size > 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4] and all(0 <= r["eval/accuracy"] <= 1 for r in evals)
    for r in evals:  # the votes pick one completion of each prompt: right at most where some completion is
        k = next(key.split("@")[1] for key in r if key.startswith("eval/pass@"))
        assert 0 <= r[f"eval/maj@{k}"] <= r[f"eval/pass@{k}"] and 0 <= r[f"eval/cons@{k}"] <= r[f"eval/pass@{k}"]
        samples = read_jsonl(run_dir / "rollouts" / "eval" / f"step_{r['step']:08d}.jsonl")  # the eval's own samples
        assert len(samples) == r["eval/num_prompts"] * int(k) and {s["step"] for s in samples} == {r["step"]}
        assert sum(s["reward"] for s in samples) / len(samples) == pytest.approx(r["eval/accuracy"], abs=1e-12)
    train_rows = [r for r in rows if "eval/accuracy" not in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    expected = {"reward/mean", "reward/std", "reward/math/mean", "reward/math/failures", "accuracy",
                "response_length/mean", "response_length/max", "truncated_fraction", "entropy",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "grad_norm", "lr", "tokens",
                "time/generation", "time/reward", "time/update", "tokens_per_second", "peak_memory_gib",
                "frac_reward_zero_std", "sampling/sampling_logp_difference/mean",
                "sampling/sampling_logp_difference/max", "bad_steps", "max_new_tokens", "loss"}
    assert expected <= set(train_rows[0]), expected - set(train_rows[0])
    assert all(r["response_length/max"] <= 6 for r in train_rows)
    ckpt = run_dir / "checkpoints" / "step_00000004"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert model.config.model_type == "qwen2" and tok.eos_token == "<|endoftext|>"


def test_resume_continues_with_the_same_metrics(full_run, tmp_path):
    """The uninterrupted run as it stood after its step-2 checkpoint (its directory without the step-4 one; its log
    still holds the later rows, which a resume drops first): resumed, it logs steps 3 and 4 and the final validation
    exactly as the run that kept going did. (One torchrun fewer than a separate 2-step run to resume.)"""
    run_dir, _ = full_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    out = train(tmp_path, resumed, "train.max_steps=4", "checkpoint.resume=auto")
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000002'} at step 2" in out
    a, b = training_rows(run_dir), training_rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        diff = {k: (ra[k], rb[k]) for k in ra if not same(ra[k], rb[k])}
        assert not diff, f"step {ra['step']}: {diff}"
    final_a = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == 4 and "eval/accuracy" in r]
    final_b = [r for r in read_jsonl(resumed / "metrics.jsonl") if r["step"] == 4 and "eval/accuracy" in r]
    assert final_a[0]["eval/accuracy"] == final_b[0]["eval/accuracy"]


def test_bad_config_fails_before_starting():
    from fastgrpo.train import main

    with pytest.raises(ValueError, match="grpo.epsilon_low must be >= 0"):
        main(["grpo.epsilon_low=-1"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['train.nope'\]"):
        main(["train.nope=1"])


def test_batch_sizes_must_split_over_the_processes():
    """What `torchrun --nproc_per_node 2` checks before loading anything (the check alone, on a stand-in)."""
    from fastgrpo.algorithms.grpo import check_world_size
    from fastgrpo.config import load_config

    def check(*overrides, world_size=2):
        check_world_size(load_config(overrides=list(overrides)), world_size)

    check("grpo.num_prompts_per_step=4")
    with pytest.raises(ValueError, match=r"grpo.num_prompts_per_step=3 must be a multiple of the number of processes"):
        check("grpo.num_prompts_per_step=3")
    with pytest.raises(ValueError, match="train.sequences_per_optimizer_step=6 must divide the rollout's 32"):
        check("grpo.num_prompts_per_step=4", "grpo.num_generations=8", "train.sequences_per_optimizer_step=6")
    with pytest.raises(ValueError, match="train.sequences_per_optimizer_step=1 must .* be a multiple of the number"):
        check("grpo.num_prompts_per_step=4", "train.sequences_per_optimizer_step=1")  # divides 32, but not by 2
    check("grpo.num_prompts_per_step=3", "train.sequences_per_optimizer_step=8", world_size=1)


def test_non_finite_steps_abort_with_a_checkpoint(tmp_path, monkeypatch):
    from fastgrpo.algorithms.update import PolicyUpdate
    from fastgrpo.checkpoint import latest_checkpoint
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer, TrainingAborted

    def always_bad(self, samples, **kwargs):  # every optimizer step of every rollout had a non-finite loss
        return {"optimizer_steps": 0.0, "bad_steps": 1.0}

    monkeypatch.setattr(PolicyUpdate, "run", always_bad)
    cfg = load_config(overrides=[*SMALL, "sft.warmup_steps=0", "eval.at_start=false", "train.max_steps=10",
                                 "train.max_bad_steps=2", "checkpoint.every_steps=0", f"logging.output_dir={tmp_path}"])
    with pytest.raises(TrainingAborted, match="2 optimizer steps in a row had a non-finite loss"):
        Trainer(cfg).fit()
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["bad_steps"] for r in rows] == [1, 2] and math.isnan(rows[0]["loss"])


@pytest.mark.parametrize("mask_truncated, mask_zero_std", [(False, False), (True, True)])
def test_rollout_rewards_advantages_and_masks(tmp_path, mask_truncated, mask_zero_std):
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, "grpo.num_prompts_per_step=2", "grpo.num_generations=2",
                                 "data.shuffle=false", f"grpo.mask_truncated_completions={str(mask_truncated).lower()}",
                                 f"grpo.mask_zero_std_groups={str(mask_zero_std).lower()}",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    answers = [trainer.algorithm.train_data.rows[i]["answer"] for i in (0, 1)]
    wrong = str(int(answers[0]) + 1)
    trainer.ctx.engine = ScriptedEngine(trainer.tokenizer, [
        [(f"\\boxed{{{answers[0]}}}", "stop"), (f"\\boxed{{{wrong}}}", "length")],  # rewards 1, 0
        [("x", "stop"), ("yy", "length")],  # rewards 0, 0: zero std
    ], logprob=-0.5)
    samples, m = trainer.algorithm.rollout(trainer.sampler.next(2), {"max_new_tokens": 8, "max_sequence_tokens": 0})
    adv = 0.5 / (2**0.5 / 2 + 1e-4)  # (r - mean) / (unbiased std + ADV_EPS)
    assert [s.advantage for s in samples] == pytest.approx([adv, -adv, 0.0, 0.0])
    assert [s.train for s in samples] == [True, not mask_truncated, not mask_zero_std,
                                          not (mask_zero_std or mask_truncated)]
    assert samples[0].completion_ids[-1] == trainer.tokenizer.eos_token_id and samples[0].sample_logprobs[0] == -0.5
    assert m["accuracy"] == 0.25 and m["frac_reward_zero_std"] == 0.5 and m["truncated_fraction"] == 0.5
    assert m["response_length/max"] == len(samples[0].completion_ids)


def test_rollout_shapes_overlong_rewards_and_filters_on_unshaped_ones(tmp_path):
    """reward_shaping (buffer 4 before the response limit 8): each completion's reward gets -(L - 4) / 4 below 0,
    L its tokens (EOS included); the advantages come from the shaped rewards. Group 2 scores 0 and 0 before shaping
    (-0.25 and -0.75 after): no signal, so mask_zero_std_groups masks it (NeMo-RL's dynamic sampling filters on the
    unshaped rewards too)."""
    import torch

    from fastgrpo.algorithms.advantages import compute_advantages
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, "grpo.num_prompts_per_step=2", "grpo.num_generations=2",
                                 "reward.functions=[format]", "reward.num_workers=0", "grpo.mask_zero_std_groups=true",
                                 "reward_shaping.enabled=true", "reward_shaping.overlong_buffer_length=4",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    script = [[("\\boxed{1}", "stop"), ("abcdefgh", "length")], [("abcd", "stop"), ("abcdefgh", "length")]]
    trainer.ctx.engine = ScriptedEngine(trainer.tokenizer, script)
    samples, m = trainer.algorithm.rollout(trainer.sampler.next(2), {"max_new_tokens": 8, "max_sequence_tokens": 0})
    lengths = [len(s.completion_ids) for s in samples]
    assert lengths == [len(trainer.tokenizer(t)["input_ids"]) + (r == "stop") for g in script for t, r in g]
    penalty = [min(0.0, -(n - 4) / 4) for n in lengths]
    assert any(penalty[:2]) and penalty[2] != penalty[3]  # the lengths reach into the buffer
    shaped = torch.tensor([[1 + penalty[0], penalty[1]], [penalty[2], penalty[3]]], dtype=torch.float64)
    assert [s.advantage for s in samples] == pytest.approx(compute_advantages(shaped)[0].view(-1).tolist())
    assert [s.train for s in samples] == [True, True, False, False]
    assert m["reward_shaping/penalty_mean"] == pytest.approx(sum(penalty) / 4)
    assert m["reward/sum"] == pytest.approx(float(shaped.sum())) and m["frac_reward_zero_std"] == 0.5


def test_reference_model_only_when_some_stage_has_beta(tmp_path):
    """β = 0 at the start and > 0 from a later stage (the DeepScaleR schedule): a frozen reference model exists,
    a separate copy (its parameters are not the policy's), equal to the initial weights; β = 0 throughout: none."""
    import torch

    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    base = [*SMALL, "sft.warmup_steps=0", f"logging.output_dir={tmp_path}"]
    assert Trainer(load_config(overrides=base)).algorithm.ref_model is None
    trainer = Trainer(load_config(overrides=[*base, "stages=[{at_step: 0, max_new_tokens: 6},"
                                                    " {at_step: 2, max_new_tokens: 6, beta: 0.001}]"]))
    ref, policy = trainer.algorithm.ref_model, trainer.model
    assert ref is not None and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not any(p.data_ptr() in policy_ptrs for p in ref.parameters())
    for a, b in zip(ref.parameters(), policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lr_warms_up_per_grpo_step_and_restarts_with_a_stage(tmp_path, monkeypatch):
    """The lr of every optimizer step of a rollout is the stage's lr times the warm-up factor of the GRPO step
    (NeMo-RL steps its LinearLR once per GRPO step): constant across the rollout's optimizer steps, 0.5 → 0.75 → 1
    over 2 steps, then 1e-3 × the warm-up again from the stage that restarts it, which also clears AdamW's state."""
    import torch

    from fastgrpo.algorithms.update import PolicyUpdate
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    seen, fresh = [], []

    def record(self, samples, **kwargs):  # three optimizer steps (zero gradients), each then stepping the scheduler
        fresh.append(len(self.optimizer.state) == 0)
        lrs = []
        for _ in range(3):
            lrs.append(self.optimizer.param_groups[0]["lr"])
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.scheduler.step()
        seen.append(lrs)
        return {"optimizer_steps": 3.0, "bad_steps": 0.0}

    monkeypatch.setattr(PolicyUpdate, "run", record)
    cfg = load_config(overrides=[*SMALL, "sft.warmup_steps=0", "eval.at_start=false", "eval.at_end=false",
                                 "train.max_steps=6", "checkpoint.every_steps=0", "checkpoint.save_final=false",
                                 "train.lr=2e-3", "train.warmup_steps=2", "train.warmup_start_factor=0.5",
                                 "stages=[{at_step: 4, max_new_tokens: 6, lr: 1e-3, restart_warmup: true, "
                                 "reset_optimizer: true}]", f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    trainer.ctx.engine = ScriptedEngine(trainer.tokenizer, [["x"] * 4] * 4)
    trainer.fit()
    expected = [2e-3 * 0.5, 2e-3 * 0.75, 2e-3, 2e-3, 1e-3 * 0.5, 1e-3 * 0.75]
    assert seen == [[pytest.approx(lr)] * 3 for lr in expected]
    assert [r["lr"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == pytest.approx(expected)
    assert fresh == [True, False, False, False, True, False]


def test_sequence_budget_bounds_prompt_plus_completion(tmp_path):
    """rollout.max_sequence_tokens (a stage's, here) reaches the engine: every prompt + completion of the rollout
    fits in it, and validation gets the same budget."""
    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, "sft.warmup_steps=0", "rollout.max_new_tokens=64",
                                 "stages=[{at_step: 0, max_new_tokens: 64, max_sequence_tokens: 40}]",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    samples, _ = trainer.algorithm.rollout(trainer.sampler.next(4), stage_settings(cfg, 0))
    assert all(len(s.prompt_ids) + len(s.completion_ids) <= 40 for s in samples)
    assert any(len(s.prompt_ids) + len(s.completion_ids) == 40 for s in samples)  # the budget, not EOS, ended some
    seen = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda prompts, params: seen.append(params) or generate(prompts, params)
    trainer.accuracy_eval(trainer.algorithm.held_out)
    assert [p.max_sequence_tokens for p in seen] == [40]


def test_stage_resets_the_kl_reference_and_a_resume_loads_it(tmp_path, monkeypatch):
    """A stage with reset_reference: from its step on the reference model is the policy's weights at that step (a
    new NeMo-RL run's reference is its starting weights), also after a resume from a later checkpoint."""
    import torch

    from fastgrpo.algorithms.update import PolicyUpdate
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    holder, seen = {}, []

    def flat(model):
        return torch.cat([p.detach().flatten().clone() for p in model.parameters()])

    def perturb(self, samples, **kwargs):  # records (reference, policy) then moves the policy
        trainer = holder["trainer"]
        seen.append((trainer.step, flat(trainer.algorithm.ref_model), flat(trainer.model)))
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)
        return {"optimizer_steps": 1.0, "bad_steps": 0.0}

    monkeypatch.setattr(PolicyUpdate, "run", perturb)
    base = [*SMALL, "sft.warmup_steps=0", "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=1",
            "stages=[{at_step: 0, max_new_tokens: 6}, {at_step: 2, max_new_tokens: 6, beta: 0.01, "
            "reset_reference: true}]", f"logging.output_dir={tmp_path}"]
    for steps in (3, 4):
        holder["trainer"] = trainer = Trainer(load_config(overrides=[*base, f"train.max_steps={steps}"]))
        trainer.ctx.engine = ScriptedEngine(trainer.tokenizer, [["x"] * 4] * 4)
        trainer.fit()
    assert [s for s, _, _ in seen] == [0, 1, 2, 3]
    initial = seen[0][1]
    torch.testing.assert_close(seen[0][2], initial)
    torch.testing.assert_close(seen[1][1], initial)
    torch.testing.assert_close(seen[2][1], seen[2][2], rtol=0, atol=0)  # the policy at the stage's start
    assert not torch.equal(seen[2][1], initial)
    torch.testing.assert_close(seen[3][1], seen[2][2], rtol=0, atol=0)  # resumed at step 3: loaded back
    assert (tmp_path / "reference" / "step_00000002.pt").is_file()


class CallScriptedEngine(ScriptedEngine):
    """A :class:`ScriptedEngine` whose generation call k follows ``scripts[k]``; records each call's prompts."""

    def __init__(self, tok, scripts):
        super().__init__(tok, None)
        self.scripts, self.calls = scripts, []

    def generate(self, prompts, params, *, on_group_done=None, turns=None):
        self.script = self.scripts[len(self.calls)]
        self.calls.append(list(prompts))
        return super().generate(prompts, params, on_group_done=on_group_done, turns=turns)


def ds_script(signal: list[bool], tag: str) -> list[list[str]]:
    """One generation call's groups of two under the format reward (1 with a complete \\boxed{}, else 0): a group
    with signal scores 1 and 0, one without 0 and 0; ``tag`` makes every group's texts its own."""
    return [[f"\\boxed{{{tag}{p}}}", f"no{tag}{p}"] if s else [f"a{tag}{p}", f"b{tag}{p}"]
            for p, s in enumerate(signal)]


DS = ["grpo.num_generations=2", "reward.functions=[format]", "reward.num_workers=0", "data.shuffle=false",
      "grpo.use_dynamic_sampling=true", "sft.warmup_steps=0"]


def test_dynamic_sampling_generates_until_the_batch_is_full(tmp_path):
    """4 prompts per step, batch_multiplier 1.5: 6 prompts per generation batch. Groups with signal: 2, 1, then 3
    of 6, so the third batch fills the step (6 >= 4): 12 groups dropped, the last 2 groups with signal discarded
    (4 samples), the first 4 with signal trained on, in generation order, with their own prompts."""
    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, *DS, "grpo.num_prompts_per_step=4", "grpo.batch_multiplier=1.5",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    signal = [[True, False, False, True, False, False], [False] * 5 + [True], [True, True, False, False, True, False]]
    engine = trainer.ctx.engine = CallScriptedEngine(trainer.tokenizer, [ds_script(s, b) for b, s in enumerate(signal)])
    assert trainer.algorithm.rows_per_step == 6
    samples, m = trainer.algorithm.rollout(trainer.sampler.next(6), stage_settings(cfg, 0))
    prompt_ids = trainer.algorithm.train_data.prompt_ids
    assert engine.calls == [prompt_ids[0:6], prompt_ids[6:12], prompt_ids[12:18]]  # the sampler's next prompts
    assert trainer.sampler.state_dict()["index"] == 18
    kept = [(0, 0), (0, 3), (1, 5), (2, 0)]  # (batch, prompt) of the first 4 groups with signal
    texts = [trainer.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
    assert texts == [t for b, p in kept for t in (f"\\boxed{{{b}{p}}}", f"no{b}{p}")]
    assert [s.prompt_ids for s in samples] == [prompt_ids[6 * b + p] for b, p in kept for _ in range(2)]
    adv = 0.5 / (2**0.5 / 2 + 1e-4)
    assert [s.advantage for s in samples] == pytest.approx([adv, -adv] * 4) and all(s.train for s in samples)
    assert (m["dynamic_sampling/num_gen_batches"], m["dynamic_sampling/dropped_groups"],
            m["dynamic_sampling/discarded_valid_samples"], m["dynamic_sampling/groups"]) == (3, 12, 4, 4)
    assert m["completions/sum"] == 36 and m["frac_reward_zero_std"] == pytest.approx(12 / 18)  # over all 3 batches


@pytest.fixture(scope="module")
def ds_trainer(tmp_path_factory):
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    return Trainer(load_config(overrides=[*SMALL, *DS, f"logging.output_dir={tmp_path_factory.mktemp('ds')}"]))


@settings(max_examples=25)
@given(st.data())
def test_dynamic_sampling_keeps_the_first_groups_with_signal(ds_trainer, data):
    """Random step sizes, multipliers, batch limits and signal patterns against a plain loop over the batches: the
    batches generated, the groups trained on (the first P with signal, in order), the counts, or the error."""
    from fastgrpo.config import stage_settings

    g = ds_trainer.cfg.grpo
    g.num_prompts_per_step = data.draw(st.integers(1, 4), label="P")
    g.batch_multiplier = data.draw(st.sampled_from([1.0, 1.5, 2.0]), label="multiplier")
    g.dynamic_sampling_max_gen_batches = data.draw(st.integers(1, 4), label="max batches")
    n = g.prompts_per_gen_batch
    signal = data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=4, max_size=4),
                       label="signal")
    ds_trainer.ctx.engine = CallScriptedEngine(ds_trainer.tokenizer, [ds_script(s, b) for b, s in enumerate(signal)])
    P, kept, batches = g.num_prompts_per_step, [], 0
    for b in range(g.dynamic_sampling_max_gen_batches):  # the reference
        batches += 1
        kept += [(b, p) for p, s in enumerate(signal[b]) if s]
        if len(kept) >= P:
            break
    tok = ds_trainer.tokenizer
    event(f"{batches} batch(es), " + ("short" if len(kept) < P else "filled"))
    if len(kept) < P:
        with pytest.raises(RuntimeError, match=f"dynamic sampling .*: {len(kept)} of grpo.num_prompts_per_step={P}"):
            ds_trainer.algorithm.rollout(ds_trainer.sampler.next(n), stage_settings(ds_trainer.cfg, 0))
    else:
        samples, m = ds_trainer.algorithm.rollout(ds_trainer.sampler.next(n), stage_settings(ds_trainer.cfg, 0))
        assert [tok.decode(s.completion_ids, skip_special_tokens=True) for s in samples[::2]] == [
            f"\\boxed{{{b}{p}}}" for b, p in kept[:P]]
        counts = (batches, batches * n - len(kept), 2 * (len(kept) - P))  # batches, dropped, discarded samples
        assert (m["dynamic_sampling/num_gen_batches"], m["dynamic_sampling/dropped_groups"],
                m["dynamic_sampling/discarded_valid_samples"]) == counts
    assert len(ds_trainer.engine.calls) == batches


def test_dynamic_sampling_stops_when_the_data_cannot_fill_a_step(tmp_path):
    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, *DS, "grpo.num_prompts_per_step=4", "grpo.dynamic_sampling_max_gen_batches=2",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    trainer.ctx.engine = CallScriptedEngine(trainer.tokenizer, [ds_script([True, False, True, False], 0),
                                                            ds_script([False, False, False, True], 1)])
    with pytest.raises(RuntimeError, match=r"dynamic sampling \(step 0\): 3 of grpo.num_prompts_per_step=4 groups .* "
                       r"grpo.dynamic_sampling_max_gen_batches=2 generation batches of 4 prompts \(5 groups dropped"):
        trainer.algorithm.rollout(trainer.sampler.next(4), stage_settings(cfg, 0))
    assert len(trainer.engine.calls) == 2


def test_dynamic_sampling_config():
    from fastgrpo.config import load_config

    with pytest.raises(ValueError, match=r"grpo.dynamic_sampling is now grpo.mask_zero_std_groups \(it only masked"):
        load_config(overrides=["grpo.dynamic_sampling=true"])
    with pytest.raises(ValueError, match="grpo.batch_multiplier must be 1 unless grpo.use_dynamic_sampling is true"):
        load_config(overrides=["grpo.batch_multiplier=2"])
    with pytest.raises(ValueError, match="grpo.batch_multiplier must be >= 1"):
        load_config(overrides=["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=0.5"])
    with pytest.raises(ValueError, match="grpo.dynamic_sampling_max_gen_batches must be >= 1"):
        load_config(overrides=["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=0"])
    cfg = load_config(overrides=["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=1.3",
                                 "grpo.num_prompts_per_step=10"])
    assert cfg.grpo.prompts_per_gen_batch == 13 and cfg.grpo.dynamic_sampling_max_gen_batches == 10
    from fastgrpo.algorithms.grpo import check_world_size

    with pytest.raises(ValueError, match=r"= 13 prompts per generation batch must be a multiple of the number"):
        check_world_size(load_config(overrides=["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=1.3",
                                                "grpo.num_prompts_per_step=10"]), 2)


def test_dynamic_sampling_two_processes_balance_the_groups(tmp_path):
    """2 ranks, 4 prompts per step (2 per rank), batch_multiplier 2 (4 prompts per rank per batch). Batch 0: rank 0
    has 3 groups with signal, rank 1 none (3 < 4); batch 1: one each (5 >= 4). In the order (batch, rank, prompt)
    the first 4 are rank 0's three of batch 0 and its one of batch 1: rank 0 trains on the first two, rank 1 on the
    other two, sent by rank 0; rank 1's own group of batch 1 is the surplus. Then the update runs on both."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(Path(__file__)),
           "ds_worker", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    import json

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["texts"] for r in ranks] == [["\\boxed{r0b0p0}", "nor0b0p0", "\\boxed{r0b0p1}", "nor0b0p1"],
                                          ["\\boxed{r0b0p3}", "nor0b0p3", "\\boxed{r0b1p2}", "nor0b1p2"]]
    assert ranks[0]["sent_prompts"] == ranks[1]["prompts"]  # rank 1's groups carry rank 0's prompts
    for r in ranks:
        m = r["metrics"]
        assert (m["dynamic_sampling/num_gen_batches"], m["dynamic_sampling/dropped_groups"],
                m["dynamic_sampling/discarded_valid_samples"], m["dynamic_sampling/groups"]) == (2, 11, 2, 4)
        assert math.isfinite(m["loss"]) and m["optimizer_steps/max"] == 1 and m["grad_norm"] > 0


def _ds_worker(out: str) -> None:
    """torchrun entry of test_dynamic_sampling_two_processes_balance_the_groups."""
    import json

    import torch

    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.distributed import barrier, destroy
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, *DS, "grpo.num_prompts_per_step=4", "grpo.batch_multiplier=2",
                                 "train.lr=1e-2", f"logging.output_dir={out}"])
    trainer = Trainer(cfg)
    torch.set_num_threads(1)
    rank = trainer.state.rank
    signal = {0: [[True, True, False, True], [False, False, True, False]],
              1: [[False] * 4, [False, True, False, False]]}[rank]
    trainer.ctx.engine = CallScriptedEngine(trainer.tokenizer, [ds_script(s, f"r{rank}b{b}p") for b, s in
                                                             enumerate(signal)])
    captured = {}
    rollout = trainer.algorithm.rollout

    def spy(indices, settings):
        samples, m = rollout(indices, settings)
        captured["samples"] = samples
        return samples, m

    trainer.algorithm.rollout = spy
    m = trainer.algorithm.step(trainer.sampler.next(trainer.algorithm.rows_per_step), stage_settings(cfg, 0))
    samples, calls = captured["samples"], trainer.engine.calls
    result = {"texts": [trainer.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples],
              "prompts": [s.prompt_ids for s in samples[::2]], "metrics": m,
              "sent_prompts": [calls[0][3], calls[1][2]]}  # rank 0's groups that rank 1 trains on
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.close()
    del trainer, samples
    rollout = spy = captured = None  # destroy() then frees what still holds the group (gloo's threads)
    barrier()  # no rank tears the group down while another still uses it
    destroy()  # left to the interpreter's exit, gloo's threads can be joined mid-teardown: SIGABRT, 1 run in N


if __name__ == "__main__":
    if sys.argv[1] == "ds_worker":
        _ds_worker(sys.argv[2])
