"""Evaluation: avg@k / pass@k / maj@k / cons@k against the closed form on scripted completions, maj@k / cons@k
against a brute-force reference on random scripts, and the command line."""

import pytest
from checks import ScriptedEngine
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.config import DataConfig
from fastgrpo.data.prompts import build_dataset
from fastgrpo.engine.engine import SamplingParams
from fastgrpo.eval import evaluate, main
from fastgrpo.models.loading import build_tiny_tokenizer
from fastgrpo.rollouts import main as rollouts_main
from fastgrpo.rollouts import read_step, step_files


def test_avg_and_pass_at_k_closed_form():
    tok = build_tiny_tokenizer()
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    ds = build_dataset(rows, tok, DataConfig(), "test")
    texts = [["\\boxed{2}", "\\boxed{3}", "\\boxed{2}", "x"],  # 2 of 4 correct
             ["\\boxed{5}", "\\boxed{5}", "\\boxed{5}", "\\boxed{4}"],  # 1 of 4
             ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "\\boxed{1}"]]  # 0 of 4
    rows = []
    res = evaluate(None, tok, ds, SamplingParams(n=4), engine=ScriptedEngine(tok, texts), model_device="cpu",
                   rows=rows)
    assert res["avg@4"] == pytest.approx(3 / 12) and res["pass@4"] == pytest.approx(2 / 3)
    assert [(r["group"], r["sample"]) for r in rows] == [(p, j) for p in range(3) for j in range(4)]
    assert [r["reward"] for r in rows] == [1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert [r["extracted"] for r in rows[:4]] == ["2", "3", "2", None] and rows[4]["answer"] == "4"
    assert all(texts[r["group"]][r["sample"]] in r["completion"] and r["completion_tokens"] > 0 for r in rows)
    res2 = evaluate(None, tok, ds, SamplingParams(n=2), engine=ScriptedEngine(tok, texts), num_prompts=2,
                    model_device="cpu")
    assert res2["avg@2"] == pytest.approx(1 / 4) and res2["pass@2"] == pytest.approx(1 / 2)
    assert res2["num_prompts"] == 2


def test_command_line_on_a_saved_model(tmp_path, capsys):
    from fastgrpo.config import ModelConfig
    from fastgrpo.models.loading import load_model

    model, tok = load_model(ModelConfig(), "cpu")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    res = main([str(tmp_path), "--k", "2", "eval.num_prompts=6", "rollout.max_new_tokens=4", "train.num_threads=1",
                "--samples", str(tmp_path / "samples")])
    rows = read_step(step_files(tmp_path / "samples")[0])
    assert len(rows) == 12 and sum(r["reward"] for r in rows) / 12 == pytest.approx(res["avg@2"], abs=1e-12)
    printed = capsys.readouterr().out  # the eval's own lines (checked below)
    assert rollouts_main([str(tmp_path / "samples"), "--sort", "length", "--full"]) == 0  # the browser reads them
    shown = capsys.readouterr().out
    assert shown.startswith("step 0: 12 of 12 completions") and shown.count("--- step 0 group") == 12
    assert all(f"extracted {r['extracted']!r}" in shown for r in rows)
    assert rollouts_main([str(tmp_path / "samples"), "--sort", "advantage"]) == 1
    assert set(res) == {"avg@2", "pass@2", "maj@2", "cons@2", "response_length/mean", "num_prompts"}
    assert res["num_prompts"] == 6
    assert 0 <= res["avg@2"] <= res["pass@2"] <= 1 and 1 <= res["response_length/mean"] <= 4
    assert 0 <= res["maj@2"] <= res["pass@2"] and 0 <= res["cons@2"] <= res["pass@2"]
    assert all(f"{key}=" in printed for key in res)  # every key of the result is printed


def _dataset(tok, golds):
    return build_dataset([{"prompt": f"q{i}=", "answer": g} for i, g in enumerate(golds)], tok, DataConfig(), "test")


def test_majority_and_consensus_closed_form():
    """maj@k merges the spellings the verifier equates (1/2 = 0.5 = \\frac{1}{2}, " 7" = "7") and ignores
    completions without an answer (none, or an empty box); cons@k (NeMo-RL's) votes on the exact strings with "no
    answer" a candidate; both break ties for what appeared first."""
    tok = build_tiny_tokenizer()
    ds = _dataset(tok, ["0.5", "4", "6", "6", "2", "7"])
    texts = [["\\boxed{3}", "\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"],  # maj: the half, 3 votes
             ["x", "y", "\\boxed{4}", "z"],  # maj: 4 (the only vote); cons: no answer (3 of 4)
             ["\\boxed{5}", "\\boxed{6}", "\\boxed{6}", "\\boxed{5}"],  # 2-2 tie: 5 came first, both wrong
             ["\\boxed{6}", "\\boxed{5}", "\\boxed{5}", "\\boxed{6}"],  # 2-2 tie: 6 came first, both right
             ["none", "\\boxed{}", "nothing", "\\boxed{ }"],  # nobody answers: maj 0, cons 0
             ["\\boxed{7}", "a", "b", "\\boxed{ 7}"]]  # maj: 7 (2 votes); cons: no answer (2) beats "7" and " 7"
    res = evaluate(None, tok, ds, SamplingParams(n=4), engine=ScriptedEngine(tok, texts), model_device="cpu")
    assert res["avg@4"] == pytest.approx(10 / 24) and res["pass@4"] == pytest.approx(5 / 6)
    assert res["maj@4"] == pytest.approx(4 / 6) and res["cons@4"] == pytest.approx(1 / 6)
    # the first 2 samples of the first 3 prompts: (3, 1/2) tie -> 3; (x, y) nobody; (5, 6) tie -> 5
    res2 = evaluate(None, tok, ds, SamplingParams(n=2), engine=ScriptedEngine(tok, texts), num_prompts=3,
                    model_device="cpu")
    assert res2["maj@2"] == 0 and res2["cons@2"] == 0 and res2["pass@2"] == pytest.approx(2 / 3)
    # k = 1: the single answer is the vote (right on prompts 4 and 6)
    res1 = evaluate(None, tok, ds, SamplingParams(n=1), engine=ScriptedEngine(tok, texts), model_device="cpu")
    assert res1["maj@1"] == res1["cons@1"] == res1["avg@1"] == pytest.approx(2 / 6)


def test_majority_and_consensus_only_with_the_math_verifier():
    """A ``sample`` with environment scores has no answers to vote on: no maj@k / cons@k; with scores None (the
    math verifier on multi-turn completions) they are there."""
    tok = build_tiny_tokenizer()
    ds = _dataset(tok, ["2", "3"])
    texts = [["\\boxed{2}", "\\boxed{2}"], ["\\boxed{1}", "\\boxed{3}"]]
    engine = ScriptedEngine(tok, texts)

    def sample(scores):
        return lambda indices, params: (engine.generate([ds.prompt_ids[i] for i in indices], params), 1, scores)

    env = evaluate(None, tok, ds, SamplingParams(n=2), engine=engine, model_device="cpu",
                   sample=sample([[0.5, 1.0], [0.0, 0.0]]))
    assert "maj@2" not in env and "cons@2" not in env and env["avg@2"] == pytest.approx(1.5 / 4)
    math = evaluate(None, tok, ds, SamplingParams(n=2), engine=engine, model_device="cpu", sample=sample(None))
    assert math["maj@2"] == math["cons@2"] == pytest.approx(1 / 2) and math["tool_call_rate"] == pytest.approx(1 / 4)


# answers drawn from a small set: spellings the verifier equates, integers, no answer (none, or an empty box)
_SPELLINGS = {"\\boxed{1/2}": "half", "\\boxed{0.5}": "half", "\\boxed{\\frac{1}{2}}": "half",
              "\\boxed{2}": "two", "\\boxed{2.0}": "two", "\\boxed{3}": "three", "no answer": None,
              "\\boxed{}": None}
_GOLDS = {"0.5": "half", "2": "two", "3": "three"}


def _reference(script, golds):
    """Brute force, from the definitions: maj (value classes from the table above, no answer no vote, ties to the
    class seen first) and NeMo-RL's cons (every size-k subset of the k samples, i.e. all of them, voted on the exact
    boxed strings, no answer a candidate, ties to the string seen first, correct when its first completion is)."""
    from itertools import combinations

    maj = cons = 0.0
    for texts, gold in zip(script, golds):
        classes = [_SPELLINGS[t] for t in texts]
        voted = [c for c in classes if c is not None]
        if voted:
            best = max(voted.count(c) for c in voted)
            winner = next(c for c in voted if voted.count(c) == best)
            maj += winner == _GOLDS[gold]
        k = len(texts)
        subsets = list(combinations(range(k), k))
        for subset in subsets:
            strings = [None if _SPELLINGS[texts[j]] is None else texts[j] for j in subset]
            best = max(strings.count(x) for x in strings)
            winner = next(x for x in strings if strings.count(x) == best)
            cons += (winner is not None and _SPELLINGS[winner] == _GOLDS[gold]) / len(subsets)
    return maj / len(script), cons / len(script)


@settings(max_examples=60)
@given(st.integers(1, 5).flatmap(lambda k: st.lists(
    st.tuples(st.sampled_from(sorted(_GOLDS)), st.lists(st.sampled_from(sorted(_SPELLINGS)), min_size=k, max_size=k)),
    min_size=1, max_size=4)))
def test_majority_and_consensus_match_a_brute_force_reference(prompts):
    tok = build_tiny_tokenizer()
    golds = [g for g, _ in prompts]
    script = [texts for _, texts in prompts]
    k = len(script[0])
    res = evaluate(None, tok, _dataset(tok, golds), SamplingParams(n=k), engine=ScriptedEngine(tok, script),
                   model_device="cpu")
    maj, cons = _reference(script, golds)
    assert res[f"maj@{k}"] == pytest.approx(maj) and res[f"cons@{k}"] == pytest.approx(cons)
    correct = [[_SPELLINGS[t] == _GOLDS[g] for t in texts] for g, texts in prompts]
    assert res[f"avg@{k}"] == pytest.approx(sum(map(sum, correct)) / (k * len(prompts)))
    assert res[f"pass@{k}"] == pytest.approx(sum(map(any, correct)) / len(prompts))
