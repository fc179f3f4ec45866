"""The rollout log (fastgrpo.algorithms.rollout_log) and its browser (python -m fastgrpo.rollouts): a 2-step tiny
GRPO run on scripted completions (so every text, token count, finish reason, score and advantage is known) writes
one row per completion per step; the console table; the cap on kept files; the per-rank files; the browser's
selections."""

import json
import statistics

import pytest
from checks import ScriptedEngine, one_thread  # noqa: F401  (one_thread: a module fixture)

from fastgrpo.algorithms.batch import Sample
from fastgrpo.algorithms.rollout_log import RolloutLog, ScoredGroup, format_table, one_line, prune
from fastgrpo.config import LoggingConfig
from fastgrpo.engine.engine import Completion
from fastgrpo.metrics import read_jsonl
from fastgrpo.rollouts import main, read_step, select, step_files

SMALL = ["grpo.num_prompts_per_step=2", "grpo.num_generations=3", "rollout.max_new_tokens=6", "sft.warmup_steps=0",
         "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0", "checkpoint.every_steps=0",
         "checkpoint.save_final=false", "logging.progress_bar=false", "train.num_threads=1", "data.shuffle=false",
         "reward.functions=[math, format]", "reward.weights=[1.0, 0.5]", "reward.num_workers=0",
         "grpo.mask_truncated_completions=true"]
LONG = "no box " + "a" * 300
ADV_EPS = 1e-4


class StepEngine:
    """One ScriptedEngine per generate call (GRPO step), in order."""

    def __init__(self, tok, scripts):
        self.engines = [ScriptedEngine(tok, s) for s in scripts]
        self.last_stats = None

    def generate(self, prompts, params, **kwargs):
        return self.engines.pop(0).generate(prompts, params, **kwargs)


def script_for(answers):
    """Group 0: right (1.5), wrong (0.5), truncated long text without a box (0: the step's only lowest reward);
    group 1: wrong (0.5), right but truncated (1.5), right with a newline (1.5)."""
    a, b = answers
    return [[(f"\\boxed{{{a}}}", "stop"), (f"\\boxed{{{int(a) + 1}}}", "stop"), (LONG, "length")],
            [(f"\\boxed{{{int(b) + 1}}}", "stop"), (f"\\boxed{{{b}}}", "length"), (f"so\n\\boxed{{{b}}}", "stop")]]


@pytest.fixture
def run(tmp_path, capsys):
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, "train.max_steps=2", "logging.completions_to_print=3",
                                 f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        rows = trainer.algorithm.train_data.rows
        scripts = [script_for([rows[i]["answer"] for i in (2 * s, 2 * s + 1)]) for s in range(2)]
        trainer.ctx.engine = StepEngine(trainer.tokenizer, scripts)
        trainer.fit()
        prompt_ids = [trainer.algorithm.train_data.prompt_ids[i] for i in range(4)]
        return tmp_path, trainer.tokenizer, scripts, prompt_ids, capsys.readouterr().out
    finally:
        trainer.close()


def test_every_row_matches_the_scripted_rollout(run, capsys):
    run_dir, tok, scripts, prompt_ids, out = run
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [1, 2] and not any("rollout" in k for r in read_jsonl(run_dir / "metrics.jsonl") for k in r)
    files = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert files == ["step_00000001.jsonl", "step_00000002.jsonl"]  # no .tmp left behind
    eos = tok.eos_token
    for step, script in zip((1, 2), scripts):
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines()]
        assert len(rows) == 6
        for p, group in enumerate(script):
            answer = script[p][0][0] if p == 0 else script[p][1][0]  # the right completion's text
            rewards = []
            for j, (text, reason) in enumerate(group):
                r = rows[p * 3 + j]
                n = len(tok(text, add_special_tokens=False)["input_ids"]) + (reason == "stop")
                right = float(answer in text)
                boxed = float("\\boxed{" in text)
                assert r["step"] == step and r["group"] == p and r["sample"] == j
                assert r["prompt"] == tok.decode(prompt_ids[2 * (step - 1) + p], skip_special_tokens=False)
                assert r["prompt_tokens"] == len(prompt_ids[2 * (step - 1) + p])
                assert r["completion"] == text + (eos if reason == "stop" else "")  # the stop token shows
                assert r["completion_tokens"] == n and r["finish_reason"] == reason
                assert r["rewards"] == {"math": right, "format": boxed}
                assert r["reward"] == pytest.approx(right + 0.5 * boxed)
                assert r["trained"] == (reason == "stop")  # grpo.mask_truncated_completions
                assert "turns" not in r and "tool_calls" not in r  # single-turn
                rewards.append(r["reward"])
            mean, std = statistics.mean(rewards), statistics.stdev(rewards)
            assert [rows[p * 3 + j]["advantage"] for j in range(3)] == pytest.approx(
                [(x - mean) / (std + ADV_EPS) for x in rewards])  # the closed form of tests/test_train.py
    # the console table: the first 3 completions of each step, the long one cut with an ellipsis
    for step in (1, 2):
        assert f"step {step}: 3 of 6 completions" in out
    lines = [line for line in out.splitlines() if line.rstrip().endswith("…")]
    assert len(lines) == 2 and all("a" * 150 in line and "a" * 200 not in line for line in lines)
    assert out.splitlines().count(format_table([])) == 2 and "\\boxed{" in out  # format_table([]): the header

    # the browser: the latest step by default; --worst 1 is the step's lowest reward (the long truncated one)
    assert main([str(run_dir), "--worst", "1"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "step 2: 1 of 6 completions (2 steps logged, 1 to 2)"
    assert shown[2].split()[:6] == ["2", "0", "2", "0.000", f"{rows[2]['advantage']:.3f}", "length"]
    assert main([str(run_dir), "--step", "1", "--truncated", "--full"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("step 1: 2 of 6 completions") and LONG in shown and "[prompt]" in shown
    assert main([str(run_dir), "--step", "7"]) == 1


def test_selections_and_table():
    rows = [{"step": 3, "group": g, "sample": s, "reward": r, "advantage": a, "finish_reason": f,
             "completion_tokens": n, "completion": c}
            for g, s, r, a, f, n, c in [(0, 0, 1.0, 0.5, "stop", 5, "ok"), (0, 1, -1.0, -0.5, "length", 9, "x\ny"),
                                        (1, 0, 0.0, 0.0, "length", 12, "z" * 500), (1, 1, -1.0, 0.1, "stop", 3, "w")]]
    assert select(rows, worst=1) == [rows[1]]  # the lowest reward; ties keep the file order
    assert select(rows, worst=2, sort="length") == [rows[2], rows[1]]
    assert select(rows, sort="advantage") == [rows[1], rows[2], rows[3], rows[0]]
    assert select(rows, truncated=True) == [rows[1], rows[2]]
    assert select(rows, worst=1, truncated=True) == [rows[1]]
    table = format_table(rows).splitlines()
    assert len(table) == 5 and table[2].endswith("x↵y")  # one line a row
    assert one_line("z" * 500) == "z" * 199 + "…" and len(table[3].split()[-1]) == 200


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids)) + ("" if skip_special_tokens else " <eos>")


def groups(n=2, G=2):
    return [ScoredGroup([1, 2, p], [Completion([p, j, 9], [0.0] * 3, "stop") for j in range(G)],
                        [float(j) for j in range(G)], True, [{"math": float(j)} for j in range(G)]) for p in range(n)]


def samples(advantages, train=None):
    return [Sample([1], [2], [0.0], a, True if train is None else train[i]) for i, a in enumerate(advantages)]


def test_the_cap_deletes_the_oldest_steps_first(tmp_path):
    log = RolloutLog(LoggingConfig(rollouts_keep=3), tmp_path, Tok(), 0, 1)
    for step in (3, 1, 2, 5, 4):
        log.record(step, groups(), samples([0.0] * 4))
    names = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert names == ["step_00000003.jsonl", "step_00000004.jsonl", "step_00000005.jsonl"]  # and no .tmp
    assert prune(tmp_path / "rollouts", 1, None) == [tmp_path / "rollouts" / f"step_0000000{s}.jsonl" for s in (3, 4)]
    RolloutLog(LoggingConfig(rollouts_keep=0), tmp_path, Tok(), 0, 1).record(9, groups(), samples([0.0] * 4))
    assert len(list((tmp_path / "rollouts").iterdir())) == 2  # 0 keeps all
    RolloutLog(LoggingConfig(log_rollouts=False), tmp_path / "off", Tok(), 0, 1).record(1, groups(), samples([0.0] * 4))
    assert not (tmp_path / "off").exists()


def test_several_ranks_write_their_own_files_read_back_as_one_step(tmp_path):
    for rank in (1, 0):
        log = RolloutLog(LoggingConfig(rollouts_keep=1), tmp_path, Tok(), rank, 2)
        for step in (1, 2):
            rows = log.record(step, groups(), samples([0.5, -0.5, 0.25, -0.25], [True, False] * 2))
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_00000002.rank0.jsonl",
                                                                         "step_00000002.rank1.jsonl"]
    assert [r["group"] for r in rows] == [0, 0, 1, 1] and rows[1]["completion"] == "0 1 9 <eos>"
    assert rows[2]["rewards"] == {"math": 0.0} and rows[3]["advantage"] == -0.25 and rows[2]["prompt_tokens"] == 3
    assert [r["trained"] for r in rows] == [True, False] * 2
    merged = read_step(step_files(tmp_path)[2])
    assert [(r["group"], r["sample"]) for r in merged] == [(g, s) for g in range(4) for s in range(2)]
    assert [r["prompt"] for r in merged[4:6]] == ["1 2 0 <eos>"] * 2  # rank 1's first group is the step's third


def test_logging_fields_validate():
    from fastgrpo.config import load_config

    cfg = load_config(overrides=["logging.rollouts_keep=0", "logging.completions_to_print=2",
                                 "logging.log_rollouts=false"])
    assert (cfg.logging.rollouts_keep, cfg.logging.completions_to_print, cfg.logging.log_rollouts) == (0, 2, False)
    with pytest.raises(ValueError, match="logging.rollouts_keep must be >= 0"):
        load_config(overrides=["logging.rollouts_keep=-1"])
    assert LoggingConfig().rollouts_keep == 100 and LoggingConfig().log_rollouts


def test_multi_turn_rows_have_turns_tool_calls_and_the_environment_reward(tmp_path):
    """tests/test_multiturn.py's adder case (env.reward_weight 0.5): the rows add the turns, the tool calls and the
    environment's reward next to the math score; ``reward`` is their weighted sum (grpo.scale none: the advantage is
    reward - the group mean)."""
    from test_multiturn import call, scripted_trainer

    trainer = scripted_trainer(tmp_path, [], "env.environment_factory=adder", "env.reward_weight=0.5",
                               "grpo.num_generations=4", "grpo.scale=none", "data.synthetic_num_terms=2",
                               "data.synthetic_max_value=99")
    try:
        row = trainer.algorithm.train_data.rows[0]
        a, b = (int(x) for x in row["prompt"].removesuffix("=").split("+"))
        boxed = f"\\boxed{{{row['answer']}}}"
        trainer.engine.script = [[[call("add", a=a, b=b), boxed], [call("add", a=a, b=b + 1), boxed], [boxed],
                                  [call("add", a=a, b=b), "\\boxed{x}"]], [["\\boxed{x}"]] * 4]
        trainer.algorithm.rollout(trainer.sampler.next(2), {"max_new_tokens": 64, "max_sequence_tokens": 0})
    finally:
        trainer.close()
    rows = read_jsonl(tmp_path / "rollouts" / "step_00000001.jsonl")
    assert [(r["group"], r["sample"]) for r in rows] == [(g, s) for g in range(2) for s in range(4)]
    assert [(r["turns"], r["tool_calls"]) for r in rows[:4]] == [(2, 1), (2, 1), (1, 0), (2, 1)]
    assert [r["rewards"] for r in rows[:4]] == [{"math": 1.0, "env": 1.0}, {"math": 1.0, "env": 0.0},
                                                {"math": 1.0, "env": 0.0}, {"math": 0.0, "env": 1.0}]
    assert [r["reward"] for r in rows[:4]] == [1.5, 1.0, 1.0, 0.5]
    assert [r["advantage"] for r in rows[:4]] == pytest.approx([0.5, 0.0, 0.0, -0.5])
    eos = trainer.tokenizer.eos_token
    assert "<tool_response>" in rows[0]["completion"] and rows[0]["completion"].endswith(boxed + eos)


def test_the_first_rows_of_each_step_go_to_the_metrics_writers(tmp_path, monkeypatch):
    """logging.tensorboard on: each step's first logging.completions_to_log rollout rows reach
    MetricsLogger.log_table as "rollouts", at that step, equal to the step file's first rows."""
    from fastgrpo.config import load_config
    from fastgrpo.metrics import MetricsLogger
    from fastgrpo.trainer import Trainer

    sent = []
    monkeypatch.setattr(MetricsLogger, "log_table", lambda self, step, name, rows: sent.append((step, name, rows)))
    cfg = load_config(overrides=[*SMALL, "train.max_steps=2", "logging.tensorboard=true",
                                 "logging.completions_to_log=4", f"logging.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        rows = trainer.algorithm.train_data.rows
        trainer.ctx.engine = StepEngine(trainer.tokenizer, [
            script_for([rows[i]["answer"] for i in (2 * s, 2 * s + 1)]) for s in range(2)])
        trainer.fit()
    finally:
        trainer.close()
    assert [(step, name, len(r)) for step, name, r in sent] == [(1, "rollouts", 4), (2, "rollouts", 4)]
    for step, _, r in sent:
        assert r == read_step(step_files(tmp_path)[step])[:4]
