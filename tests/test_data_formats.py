"""Preference and SFT rows (fastgrpo/data/responses.py): every format, the chat-template masks, the length rule, bad
rows."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.config import DataConfig
from fastgrpo.data.responses import Renderer, build_rows, load_response_datasets, preference_pair, sft_example
from fastgrpo.models.loading import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id
# A template with an end-of-turn mark and a system message added when the conversation has none (as Qwen's): the
# assistant pieces must still be found at their places.
EOT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|system|>be brief\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def cfg(**kw):
    return DataConfig(**{"max_prompt_tokens": 64, "max_length": 64, **kw})


def pair(row, **kw):
    return preference_pair(row, Renderer(TOK, cfg(**kw)), cfg(**kw))


# ---------------------------------------------------------------------------------------------- preference formats


def test_trl_explicit_prompt_strings_and_messages():
    p = pair({"prompt": "1+2=", "chosen": "3", "rejected": "4"})
    assert p.prompt_ids == ids("<|user|>1+2=<|assistant|>")  # a string prompt is formatted as GRPO's prompts
    assert (p.chosen_ids, p.rejected_ids) == (ids("3") + [EOS], ids("4") + [EOS])
    conv = pair({"prompt": msgs(("user", "1+2=")), "chosen": msgs(("assistant", "3")),
                 "rejected": msgs(("assistant", "4"))})
    assert conv == p


def test_trl_implicit_prompt_is_the_shared_beginning():
    c, r = msgs(("user", "1+2="), ("assistant", "3")), msgs(("user", "1+2="), ("assistant", "4"))
    assert pair({"chosen": c, "rejected": r}) == pair({"prompt": c[:1], "chosen": c[1:], "rejected": r[1:]})
    s = pair({"chosen": "what is 1+2? it is 3", "rejected": "what is 1+2? it is 4"}, use_chat_template=False)
    assert s.prompt_ids == ids("what is 1+2? it is ")  # cut back to the last whitespace
    assert (s.chosen_ids, s.rejected_ids) == (ids("3") + [EOS], ids("4") + [EOS])


def test_nemo_rl_context_and_ranked_completions():
    row = {"context": msgs(("user", "1+2=")),
           "completions": [{"rank": 2, "completion": msgs(("assistant", "5"))},
                           {"rank": 0, "completion": msgs(("assistant", "3"))},
                           {"rank": 1, "completion": msgs(("assistant", "4"))}]}
    p = pair(row)  # the lowest rank is chosen, the highest rejected
    assert (p.chosen_ids, p.rejected_ids) == (ids("3") + [EOS], ids("5") + [EOS])


def test_template_end_of_turn_is_part_of_the_response(monkeypatch):
    monkeypatch.setattr(TOK, "chat_template", EOT_TEMPLATE)
    p = pair({"prompt": msgs(("user", "1+2=")), "chosen": msgs(("assistant", "3")),
              "rejected": msgs(("assistant", "4"))})
    assert p.prompt_ids == ids("<|system|>be brief\n<|user|>1+2=\n<|assistant|>")
    assert p.chosen_ids == ids("3\n") + [EOS]


def test_length_rule_drop_or_truncate():
    row = {"prompt": "1+2=", "chosen": "a" * 30, "rejected": "b" * 30}  # prompt: 6 tokens, responses 31
    with pytest.raises(ValueError, match="exceed data.max_length=20"):
        pair(row, max_length=20)
    p = pair(row, max_length=20, truncation="truncate")
    assert len(p.prompt_ids) == 6 and p.chosen_ids == ids("a" * 14) and p.rejected_ids == ids("b" * 14)
    same_start = {"prompt": "1+2=", "chosen": "a" * 30 + "x", "rejected": "a" * 30 + "y"}
    with pytest.raises(ValueError, match="same once truncated"):
        pair(same_start, max_length=20, truncation="truncate")
    with pytest.raises(ValueError, match="data.max_prompt_tokens=4"):
        pair(row, max_prompt_tokens=4)


# ---------------------------------------------------------------------------------------------- SFT formats


def test_sft_prompt_completion_mask():
    ex = sft_example({"prompt": "1+2=", "completion": "3"}, Renderer(TOK, cfg()), cfg())
    assert ex.input_ids == ids("<|user|>1+2=<|assistant|>3") + [EOS]
    assert ex.loss_mask == [False] * 6 + [True, True]


@pytest.mark.parametrize("template", [None, EOT_TEMPLATE])
@given(turns=st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]),
                                st.text(alphabet="abc123+= ", min_size=0, max_size=6)), min_size=1, max_size=6))
def test_sft_mask_covers_the_assistant_turns_only(template, turns):
    """Random conversations: the trained tokens decode to the assistant contents (+ the template's end-of-turn: EOS
    for the tiny template), in order, then EOS; every other token (system, user, role marks) is untrained."""
    if template:
        TOK.chat_template, saved = template, TOK.chat_template
    try:
        messages = msgs(*turns)
        if not any(r == "assistant" for r, _ in turns):
            with pytest.raises(ValueError, match="no assistant turn"):
                sft_example({"messages": messages}, Renderer(TOK, cfg(max_length=256)), cfg(max_length=256))
            return
        ex = sft_example({"messages": messages}, Renderer(TOK, cfg(max_length=256)), cfg(max_length=256))
    finally:
        if template:
            TOK.chat_template = saved
    end = "\n" if template else TOK.eos_token
    want = [t for r, c in turns if r == "assistant" for t in ids(c + end)]
    trained = [i for i, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert trained == (want + [EOS] if template else want) and trained[-1] == EOS
    untrained = "".join(TOK.decode([i]) for i, m in zip(ex.input_ids, ex.loss_mask) if not m)
    for r, c in turns:
        assert f"<|{r}|>" in untrained
        if r != "assistant":
            assert c in untrained


# ---------------------------------------------------------------------------------------------- bad rows

GOOD = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
BAD_PREFERENCE = [
    ({"prompt": "1+2=", "rejected": "4"}, "chosen", "missing chosen"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "3"}, "rejected", "chosen == rejected"),
    ({"prompt": "1+2=", "chosen": "3" * 80, "rejected": "4"}, "prompt", "too long"),
    ({"prompt": "1+2=", "chosen": "", "rejected": "4"}, "chosen", "empty chosen"),
    ({"prompt": "1+2=", "chosen": [{"role": "assistant"}], "rejected": "4"}, "chosen", "malformed"),
    ({"chosen": "abc", "rejected": "xyz"}, "prompt", "no shared prompt"),
    ({"context": "1+2=", "completions": [{"rank": 0, "completion": "3"}, {"rank": 0, "completion": "4"}]},
     "completions", "tied ranks"),
    ({"context": "1+2=", "completions": [{"rank": 0, "completion": "3"}]}, "completions", "missing completions"),
]
BAD_SFT = [
    ({"messages": msgs(("user", "hi"))}, "messages", "no assistant turn"),
    ({"prompt": "1+2="}, "completion", "missing completion"),
    ({"messages": "hi"}, "messages", "malformed"),
    ({"prompt": "1+2=", "completion": "3" * 80}, "prompt", "too long"),
]


@pytest.mark.parametrize("algorithm, row, field, reason",
                         [("dpo", *b) for b in BAD_PREFERENCE] + [("sft", *b) for b in BAD_SFT])
def test_each_bad_row_is_skipped_and_counted_or_stops_the_start(tmp_path, algorithm, row, field, reason):
    good = GOOD if algorithm == "dpo" else {"prompt": "1+2=", "completion": "3"}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, row, good]) + "\n")
    train, held_out, prompts = load_response_datasets(cfg(path=str(path)), TOK, algorithm)
    assert len(train) == 2 and train.skipped == {reason: 1} and held_out is None and prompts is None
    assert f"1 rows skipped: 1 {reason}" in train.describe()
    with pytest.raises(ValueError, match=rf"rows.jsonl: row 1: .*'?{field}'?.*data.skip_bad_rows=true"):
        load_response_datasets(cfg(path=str(path), skip_bad_rows=False), TOK, algorithm)


def test_no_usable_row_and_a_source_error_stop_the_start(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x", "chosen": "a", "rejected": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"no usable row \(1 rows skipped: 1 chosen == rejected\)"):
        build_rows([json.loads(path.read_text())], preference_pair, TOK, cfg(), str(path))
    path.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match="data.eval_path: data file .* does not exist"):
        load_response_datasets(cfg(path=str(path), eval_path=str(tmp_path / "none.jsonl")), TOK, "dpo")


def test_parquet_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {**GOOD, "rejected": "5"}]), path)
    train, _, _ = load_response_datasets(cfg(path=str(path)), TOK, "dpo")
    assert [p.rejected_ids for p in train.items] == [ids("4") + [EOS], ids("5") + [EOS]]


def test_synthetic_pairs_and_sft_rows():
    c = cfg(synthetic_num_terms=3, max_prompt_tokens=32)
    train, held_out, prompts = load_response_datasets(c, TOK, "dpo")
    assert (len(train), len(held_out), len(prompts)) == (800, 200, 200)
    for p, row, prompt_ids in zip(held_out.items, prompts.rows, prompts.prompt_ids):
        assert p.prompt_ids == prompt_ids  # the pairs' prompts are the avg@k validation's, in order
        chosen, rejected = TOK.decode(p.chosen_ids[:-1]), TOK.decode(p.rejected_ids[:-1])
        assert chosen == f"\\boxed{{{row['answer']}}}"
        miss = int(rejected[len("\\boxed{"):-1])
        assert 1 <= abs(miss - int(row["answer"])) <= 2 and miss >= 0
    sft_train, _, _ = load_response_datasets(c, TOK, "sft")
    ex = sft_train.items[0]
    assert TOK.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m]).startswith("\\boxed{")
