"""Rewards: math correctness (fast path and math-verify), format, weights, and faults that score 0 and count (the
faulty completions only: a failed call's completions are scored again alone)."""

import math
import random
import textwrap
import time

import pytest

from fastgrpo.config import RewardConfig
from fastgrpo.rewards import COUNTERS, RewardSet, format_reward, last_boxed, math_reward, resolve, time_limit
from fastgrpo.rewards import functions as rewards


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{12") is None
    assert last_boxed("\\boxed{3} then \\boxed{4") == "3"
    assert last_boxed("no box") is None


def test_math_reward_exact_and_equivalent_answers():
    completions = ["\\boxed{12}", "so \\boxed{ 12 }", "\\boxed{\\frac{24}{2}}", "\\boxed{12.0}", "\\boxed{13}",
                   "12", "\\boxed{"]
    scores = math_reward([""] * len(completions), completions, ["12"] * len(completions))
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert math_reward([""], ["\\boxed{x^2+2x+1}"], ["(x+1)^2"]) == [1.0]
    assert math_reward([""] * 3, ["\\boxed{1,000}", "\\boxed{-2.50}", "\\boxed{7-}"], ["1000", "-2.5", "7"]) == [
        1.0, 1.0, 0.0]


def _math_verify(gold, pred):
    from math_verify import parse, verify

    return float(verify(parse(f"${gold}$", parsing_timeout=None), parse(f"\\boxed{{{pred}}}", parsing_timeout=None),
                        timeout_seconds=None))


TRICKY = ["15", "\\frac{30}{2}", "\\dfrac{30}{2}", "\\frac { 30 }{ 2 }", "\\frac{-30}{-2}", "-\\frac{30}{2}",
          "\\frac{31}{2}", "\\frac{30}{0}", "\\frac30 2", "15.0", "15.", ".15", "1.50", " 15 ", "15\n", "1\n5",
          "015", "+15", "-15", "- 15", "+ 15", "1,000", "1,5", "15,", ",15", "12,345", "x=15", "x = 15", "=15", "e=15",
          "x=-15", "x=15.0", "15=x", "15=", "", "  ", "{15}", "{ 15 }", "{{15}}", "{15", "1+14", "1 + 2 + 12", "20-5",
          "1++14", "1-+16", "+1+14", "15+", "1 5", "3*5", "30/2", "1c", "1w", "0o5", "15\\%", "1.5e1",
          "15.0000001", "\\boxed{15}", "\\frac{1}{2}", "0.50", "+0.5", "x=0.5"]


@pytest.mark.parametrize("gold", ["15", "1000", "-15", "0", "0.5", "1,000", "12345"])
def test_fast_verdict_agrees_with_math_verify(gold):
    """Wherever the fast path decides, math-verify gives the same verdict: tricky answers and random strings over the
    digits, signs, separators and braces."""
    from fastgrpo.rewards import fast_verdict

    rng = random.Random(gold)
    random_preds = ["".join(rng.choice("0123456789+-=,. {}x") for _ in range(rng.randint(1, 6))) for _ in range(40)]
    decided = 0
    for pred in TRICKY + random_preds:
        fast = fast_verdict(gold, pred)
        if fast is not None:
            decided += 1
            assert fast == _math_verify(gold, pred), (gold, pred)
    assert decided >= (25 if "." not in gold else 6)  # most forms (unequal non-integers go to math-verify)


def test_fast_verdict_leaves_uncertain_forms_to_math_verify():
    from fastgrpo.rewards import fast_verdict

    assert fast_verdict("15", "\\frac{30}{2}") == 1.0 and fast_verdict("1000", "1,000") == 1.0
    assert fast_verdict("15", "x=15") == 1.0 and fast_verdict("15", "") == 0.0 and fast_verdict("15", "{15}") == 1.0
    for gold, pred in [("15", "1c"), ("15", "3*5"), ("(x+1)^2", "x^2+2x+1"), ("15", "\\frac{31}{2}"),
                       ("0.5", "0.50001"), ("15", "\\frac{30}{0}")]:
        assert fast_verdict(gold, pred) is None, (gold, pred)


def test_format_reward():
    assert format_reward(["", ""], ["\\boxed{1}", "1"]) == [1.0, 0.0]


def test_weighted_total():
    rs = RewardSet(RewardConfig(functions=["math", "format"], weights=[1.0, 0.5]))
    res = rs.score(["p"] * 3, ["\\boxed{7}", "\\boxed{8}", "7"], {"answer": ["7", "7", "7"]})
    assert res.total == [1.5, 0.5, 0.0]
    assert res.per_function == {"math": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}
    assert res.metrics()["reward/format/mean"] == pytest.approx(2 / 3)


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        import math, time

        def raises(prompts, completions, **kw):
            raise RuntimeError("boom")

        def nan_second(prompts, completions, **kw):
            return [1.0, math.nan, 2.0][: len(completions)]

        def slow(prompts, completions, **kw):
            time.sleep(30)
            return [1.0] * len(completions)

        def wrong_length(prompts, completions, **kw):
            return [1.0]

        def per_completion(prompts, completions, **kw):  # "slow" hangs, "boom" raises, "skip" drops a score
            if "boom" in completions:
                raise RuntimeError("boom")
            if "slow" in completions:
                time.sleep(30)
            return [len(c) / 8 for c in completions if c != "skip"]

        def uses_columns(prompts, completions, answer, level, **kw):
            return [float(len(c) == int(a) and lv == "easy") for c, a, lv in zip(completions, answer, level)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_faults_score_zero_and_are_counted(user_rewards):
    names = ["my_rewards:raises", "my_rewards:nan_second", "my_rewards:slow", "my_rewards:wrong_length", "math"]
    rs = RewardSet(RewardConfig(functions=names, timeout_s=0.1))
    res = rs.score(["p"] * 3, ["\\boxed{1}", "x", "y"], {"answer": ["1", "1", "1"]})
    # raises() and slow() fail on each completion alone too; wrong_length()'s one score is right for one completion
    assert res.per_function["raises"] == [0.0, 0.0, 0.0]
    assert res.faults["raises"] == {"failures": 3, "timeouts": 0, "nonfinite": 0, "isolated": 3}
    assert res.per_function["nan_second"] == [1.0, 0.0, 2.0]
    assert res.faults["nan_second"] == {"failures": 0, "timeouts": 0, "nonfinite": 1, "isolated": 0}
    assert res.per_function["slow"] == [0.0, 0.0, 0.0]
    assert res.faults["slow"] == {"failures": 0, "timeouts": 3, "nonfinite": 0, "isolated": 3}
    assert res.per_function["wrong_length"] == [1.0, 1.0, 1.0]
    assert res.faults["wrong_length"] == {"failures": 0, "timeouts": 0, "nonfinite": 0, "isolated": 3}
    assert res.faults["math"] == dict.fromkeys(COUNTERS, 0)
    assert res.total == [1.0 + 1.0 + 1.0, 0.0 + 1.0, 2.0 + 1.0]
    assert all(math.isfinite(t) for t in res.total)
    m = res.metrics()
    assert (m["reward/slow/timeouts"], m["reward/slow/failures"], m["reward/nan_second/nonfinite"]) == (3.0, 0.0, 1.0)
    assert m["reward/slow/isolated"] == 3.0 and "reward/slow/failures/sum" not in m


def test_in_process_only_the_faulty_completions_score_zero(user_rewards):
    """A call that hangs (SIGALRM), raises or returns too few scores is re-run one completion at a time: the innocent
    completions of its chunk get their own scores; a chunk of one is final; a chunk that answers is kept."""
    rs = RewardSet(RewardConfig(functions=["my_rewards:per_completion"], timeout_s=0.1))
    texts = ["a", "slow", "abc", "ab", "boom", "abcd", "skip", "abcdef", "slow"]  # chunks [0:4] [4:8] [8:9]
    res = rs.score(["p"] * len(texts), texts, {})
    assert res.per_function["per_completion"] == [1 / 8, 0.0, 3 / 8, 2 / 8, 0.0, 4 / 8, 0.0, 6 / 8, 0.0]
    assert res.faults["per_completion"] == {"failures": 2, "timeouts": 2, "nonfinite": 0, "isolated": 8}
    clean = rs.score(["p"] * 4, ["a", "ab", "abc", "abcd"], {})
    assert clean.per_function["per_completion"] == [1 / 8, 2 / 8, 3 / 8, 4 / 8]
    assert clean.faults["per_completion"] == dict.fromkeys(COUNTERS, 0)


def test_math_verify_timeout_counts_for_that_completion(monkeypatch):
    import math_verify

    def stuck(*args, **kwargs):
        time.sleep(30)

    monkeypatch.setattr(math_verify, "verify", stuck)
    monkeypatch.setattr(rewards, "_verdicts", {})  # a verdict cached by an earlier test would skip math-verify
    rs = RewardSet(RewardConfig(functions=["math"], timeout_s=0.1))
    res = rs.score(["p", "p"], ["\\boxed{2}", "\\boxed{2*1}"], {"answer": ["2", "2"]})
    assert res.per_function["math"] == [1.0, 0.0]  # the exact match never reaches math-verify
    assert res.faults["math"] == {"failures": 0, "timeouts": 1, "nonfinite": 0, "isolated": 0}


def test_dataset_columns_reach_user_functions(user_rewards):
    rs = RewardSet(RewardConfig(functions=["my_rewards:uses_columns"]))
    res = rs.score(["p", "p"], ["ab", "abc"], {"answer": ["2", "2"], "level": ["easy", "easy"]})
    assert res.total == [1.0, 0.0] and res.faults["uses_columns"]["failures"] == 0


def test_resolve_errors():
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no callable"):
        resolve("math:not_there")


def test_time_limit_reports_a_swallowed_timeout():
    with time_limit(0.05) as status:
        try:
            time.sleep(5)
        except Exception:
            pass
    assert status["fired"]
