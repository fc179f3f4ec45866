"""Evaluation: avg@k / pass@k against the closed form on scripted completions, and the command line."""

import pytest
from checks import ScriptedEngine

from fastgrpo.config import DataConfig
from fastgrpo.data.prompts import build_dataset
from fastgrpo.engine.engine import SamplingParams
from fastgrpo.eval import evaluate, main
from fastgrpo.models.loading import build_tiny_tokenizer


def test_avg_and_pass_at_k_closed_form():
    tok = build_tiny_tokenizer()
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    ds = build_dataset(rows, tok, DataConfig(), "test")
    texts = [["\\boxed{2}", "\\boxed{3}", "\\boxed{2}", "x"],  # 2 of 4 correct
             ["\\boxed{5}", "\\boxed{5}", "\\boxed{5}", "\\boxed{4}"],  # 1 of 4
             ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "\\boxed{1}"]]  # 0 of 4
    res = evaluate(None, tok, ds, SamplingParams(n=4), engine=ScriptedEngine(tok, texts), model_device="cpu")
    assert res["avg@4"] == pytest.approx(3 / 12) and res["pass@4"] == pytest.approx(2 / 3)
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
    res = main([str(tmp_path), "--k", "2", "eval.num_prompts=6", "rollout.max_new_tokens=4", "train.num_threads=1"])
    assert set(res) == {"avg@2", "pass@2", "response_length/mean", "num_prompts"} and res["num_prompts"] == 6
    assert 0 <= res["avg@2"] <= res["pass@2"] <= 1 and 1 <= res["response_length/mean"] <= 4
    assert "avg@2=" in capsys.readouterr().out
