"""Multi-turn GRPO (issue 19): the ``env`` config, the rollout's trajectories, rewards, loss masks and metrics with
the environments in real reward workers (scripted policy turns: every count is known), hostile tools that the run
counts and survives, and a short ``tool-tiny`` run through the real engine under torchrun."""

import json
from pathlib import Path

import pytest
from checks import ScriptedEngine
from test_train import SMALL, train

from fastgrpo.config import load_config
from fastgrpo.metrics import read_jsonl

MT = [*SMALL, "grpo.num_prompts_per_step=2", "grpo.num_generations=2", "data.shuffle=false", "sft.warmup_steps=0",
      "reward.num_workers=1", "rollout.max_turns=3", "rollout.max_new_tokens=64", "rollout.max_sequence_tokens=0",
      "reward.timeout_s=1"]


def call(name: str, **arguments) -> str:
    """A Qwen-format tool call, as the tiny tokenizer writes it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_env_config_fails_at_start_up_naming_the_field():
    with pytest.raises(ValueError, match="rollout.max_turns must be 1 without an environment"):
        load_config(overrides=["rollout.max_turns=3"])
    with pytest.raises(ValueError, match=r"env.tools\[0\] must be a built-in"):
        load_config(overrides=["env.tools=[nothing]"])
    with pytest.raises(ValueError, match="env.environments must be empty when env.environment_factory is set"):
        load_config(overrides=["env.environment_factory=adder", "env.environments={a: adder}"])
    with pytest.raises(ValueError, match="env.environments.b must be a built-in"):
        load_config(overrides=["env.environments={a: adder, b: nope}"])
    with pytest.raises(ValueError, match="reward.num_workers must not be 0 with an env"):
        load_config(overrides=["env.tools=[add]", "reward.num_workers=0"])
    with pytest.raises(ValueError, match="env.tools is for algorithm grpo"):
        load_config("dpo-tiny", overrides=["env.tools=[add]"])
    with pytest.raises(ValueError, match="sft.warmup_format tool_calls demonstrates the 'add' tool"):
        load_config(overrides=["sft.warmup_format=tool_calls"])
    cfg = load_config("tool-tiny")
    assert cfg.env.enabled and cfg.rollout.max_turns == 3


def scripted_trainer(tmp_path, script, *overrides):
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*MT, f"logging.output_dir={tmp_path}", *overrides])
    trainer = Trainer(cfg)
    trainer.ctx.engine = ScriptedEngine(trainer.tokenizer, script, logprob=-0.5)
    return trainer


def rendered_ids(trainer, row, messages):
    """The whole conversation rendered by the tokenizer's own chat template (with the tools) and tokenized once:
    what prompt + completion must be, token for token (the tiny tokenizer has one token per character)."""
    from fastgrpo.data.prompts import prompt_messages

    tok = trainer.tokenizer
    text = tok.apply_chat_template([*prompt_messages(row["prompt"], trainer.cfg.data), *messages],
                                   tools=trainer.algorithm.envs.schemas() or None, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_rollout_trajectories_rewards_masks_and_metrics(tmp_path):
    """Prompt 0: sample 0 calls add with the question's terms and boxes the tool's result (math reward 1); sample 1
    answers at once, wrongly (0). Prompt 1: a malformed call, then an unknown tool, then the answer (3 turns: max);
    and a tool call every turn until max_turns. Expected: each sequence equals the tokenizer's own rendering of
    the whole conversation; the loss mask is 1 on exactly the scripted turns' tokens; rewards, advantages and the
    env/ counts as scripted."""
    trainer = scripted_trainer(tmp_path, [], "env.tools=[add]")
    rows = [trainer.algorithm.train_data.rows[i] for i in (0, 1)]
    terms = [[int(x) for x in r["prompt"].removesuffix("=").split("+")] for r in rows]
    total = sum(terms[0][:2])
    final0 = f"\\boxed{{{rows[0]['answer']}}}" if len(terms[0]) == 2 else "\\boxed{0}"
    trainer.engine.script = [
        [[call("add", a=terms[0][0], b=terms[0][1]), final0], ["\\boxed{1000}"]],
        [['<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>', call("mul", a=2, b=3), "\\boxed{7}"],
         [call("add", a=1, b=2)] * 4],
    ]
    samples, m = trainer.algorithm.rollout(trainer.sampler.next(2), {"max_new_tokens": 64, "max_sequence_tokens": 0})

    eos = trainer.tokenizer.decode([trainer.tokenizer.eos_token_id])
    error = "{'error': 'Tool mul not found.'}"
    convs = [
        [{"role": "assistant", "content": call("add", a=terms[0][0], b=terms[0][1])},
         {"role": "tool", "name": "add", "content": str(total)}, {"role": "assistant", "content": final0}],
        [{"role": "assistant", "content": "\\boxed{1000}"}],
        None,  # the malformed call's error text is the parser's: checked through the mask below
        None,
    ]
    for s, conv, row in zip(samples, convs, [rows[0], rows[0], rows[1], rows[1]]):
        if conv is not None:
            assert s.tokens == rendered_ids(trainer, row, conv)
        assert all(lp == (-0.5 if k else 0.0) for lp, k in zip(s.sample_logprobs, s.loss_mask))
    script_turns = [[call("add", a=terms[0][0], b=terms[0][1]), final0], ["\\boxed{1000}"],
                    ['<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>', call("mul", a=2, b=3),
                     "\\boxed{7}"], [call("add", a=1, b=2)] * 3]
    for s, turns in zip(samples, script_turns):  # the mask picks out exactly the scripted turns, each with its EOS
        sampled = [t for t, k in zip(s.completion_ids, s.loss_mask) if k]
        assert trainer.tokenizer.decode(sampled) == "".join(t + eos for t in turns)
    assert error in trainer.tokenizer.decode(samples[2].completion_ids)

    correct = [float(len(terms[0]) == 2), 0.0, float(rows[1]["answer"] == "7"), 0.0]
    assert m["accuracy"] == sum(correct) / 4
    assert m["env/turns_mean"] == (2 + 1 + 3 + 3) / 4 and m["env/turns/max"] == 3
    assert m["env/tool_calls"] == (1 + 0 + 2 + 3) / 4
    assert m["env/tool_failures/malformed/sum"] == 1 and m["env/tool_failures/unknown_tool/sum"] == 1
    assert m["env/finish/stop"] == 3 / 4 and m["env/finish/max_turns"] == 1 / 4
    assert sum(v for k, v in m.items() if k.startswith("env/failures/")) == 0
    trainer.algorithm.close()


def test_environment_reward_adds_to_the_reward_functions(tmp_path):
    """env.environment_factory=adder (TRL's contract: get_reward is 1 when an add call returned the row's answer)
    with env.reward_weight 0.5, on two-term questions: calling add right and boxing the answer scores 1 + 0.5;
    adding wrongly with the tool and boxing the truth 1 + 0; boxing the truth without the tool 1; calling add right
    and boxing nonsense 0 + 0.5."""
    trainer = scripted_trainer(tmp_path, [], "env.environment_factory=adder", "env.reward_weight=0.5",
                               "grpo.num_generations=4", "grpo.scale=none", "data.synthetic_num_terms=2",
                               "data.synthetic_max_value=99")
    row = trainer.algorithm.train_data.rows[0]
    a, b = (int(x) for x in row["prompt"].removesuffix("=").split("+"))
    boxed = f"\\boxed{{{row['answer']}}}"
    trainer.engine.script = [[[call("add", a=a, b=b), boxed], [call("add", a=a, b=b + 1), boxed], [boxed],
                              [call("add", a=a, b=b), "\\boxed{x}"]], [["\\boxed{x}"]] * 4]
    samples, m = trainer.algorithm.rollout(trainer.sampler.next(2), {"max_new_tokens": 64, "max_sequence_tokens": 0})
    rewards = [1.5, 1.0, 1.0, 0.5]
    assert [s.advantage for s in samples[:4]] == pytest.approx([r - sum(rewards) / 4 for r in rewards])
    assert m["accuracy"] == 3 / 8 and m["env/reward_mean"] == 2 / 8
    assert m["env/tool_calls"] == 3 / 8
    trainer.algorithm.close()


def test_validation_is_multi_turn_and_scored_by_the_environment_without_math(tmp_path):
    """Held-out validation through the environments: with reward.functions [format] (no math verifier) a
    trajectory's correctness is the environment's reward (the adder's: an add call returned the answer). Per
    prompt, sample 0 calls add right, sample 1 answers without the tool: avg@2 0.5, pass@2 1, tool-call rate 0.5."""
    trainer = scripted_trainer(tmp_path, [], "env.environment_factory=adder", "reward.functions=[format]",
                               "data.synthetic_num_terms=2", "data.synthetic_max_value=99", "eval.k=2",
                               "eval.num_prompts=2")
    rows = trainer.algorithm.held_out.rows[:2]
    terms = [[int(x) for x in r["prompt"].removesuffix("=").split("+")] for r in rows]
    trainer.engine.script = [[[call("add", a=a, b=b), "\\boxed{1}"], ["\\boxed{1}"]] for a, b in terms]
    m = trainer.accuracy_eval(trainer.algorithm.held_out)
    assert m["eval/accuracy"] == 0.5 and m["eval/pass@2"] == 1.0 and m["eval/tool_call_rate"] == 0.5
    trainer.algorithm.close()


def test_hostile_tools_are_counted_and_the_rollout_finishes(tmp_path):
    """Tools that raise, hang past the limit, kill their worker and return a 400K-character observation: each turn
    gets an error observation (or a cut one) and goes on; the counts are exact; the flood is cut to
    env.max_observation_chars before it reaches the tokenizer."""
    tools = "env.tools=[multiturn_tools:explode, multiturn_tools:hang, multiturn_tools:die, multiturn_tools:flood]"
    trainer = scripted_trainer(tmp_path, [], tools, "env.max_observation_chars=200", "env.timeout_s=0.5",
                               "rollout.max_turns=5")
    trainer.engine.script = [
        [[call("explode", x=1), call("hang", x=1), "\\boxed{1}"], [call("die", x=1), call("flood", x=1), "\\boxed{2}"]],
        [['<tool_call>\n{"name": "explode"\n</tool_call>', "\\boxed{3}"], [call("flood", x=2), "\\boxed{4}"]],
    ]
    samples, m = trainer.algorithm.rollout(trainer.sampler.next(2), {"max_new_tokens": 64, "max_sequence_tokens": 0})
    assert m["env/tool_failures/raised/sum"] == 1 and m["env/tool_failures/timeout/sum"] == 1
    assert m["env/tool_failures/worker_died/sum"] == 1 and m["env/tool_failures/malformed/sum"] == 1
    assert m["env/truncated/sum"] == 2 and m["env/finish/stop"] == 1.0
    assert all(len(s.completion_ids) - sum(s.loss_mask) < 3 * 400 for s in samples)  # cut observations only
    assert m["reward/workers_respawned"] >= 1
    trainer.algorithm.close()


def test_tool_tiny_runs_through_the_engine(tmp_path):
    """The tool-tiny recipe, a few steps through the real engine, the chat template and the workers: the run
    finishes, logs the env/ metrics and the held-out tool-call rate, and its trajectories had more than one turn
    (the warm-up taught the tool call). The recipe's 64-token turns (SMALL's 6 cut nearly every call short), on
    numbers up to 29 instead of 99: the warm-up renders a demonstration for every training row, 700 rows instead of
    9800 (its 60 steps draw 480); on train.seed 0-3 every run had 3-turn trajectories and a tool-call rate > 0.4."""
    run_dir = tmp_path / "run"
    train(tmp_path, run_dir, "--recipe", "tool-tiny", "train.max_steps=2", "sft.warmup_steps=60",
          "grpo.num_prompts_per_step=4", "eval.every_steps=0", "eval.num_prompts=8", "eval.at_start=false",
          "rollout.max_new_tokens=64", "data.synthetic_max_value=29")
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    steps = [r for r in rows if "env/turns_mean" in r]
    assert len(steps) == 2
    assert max(r["env/turns/max"] for r in steps) >= 2
    assert any(r["env/tool_calls"] > 0 for r in steps)
    assert any("eval/tool_call_rate" in r for r in rows)
