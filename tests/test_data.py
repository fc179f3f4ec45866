"""Data: JSONL / Parquet sources, field and file errors, long prompts, the synthetic task, the sampler position,
the tool-tiny demonstrations."""

import importlib.util
import json

import pytest
from chat_tokenizers import TOOLS, ids, tokenizer
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastgrpo.config import DataConfig
from fastgrpo.data.prompts import PromptSampler, build_dataset, format_prompt, load_datasets, prompt_messages, read_rows
from fastgrpo.data.synthetic import synthetic_rows
from fastgrpo.data.tool_tiny import conversation_example, tool_tiny_conversation, tool_tiny_warmup
from fastgrpo.environments.chat import ChatTemplate
from fastgrpo.models.loading import TINY_MAX_POSITIONS, build_tiny_tokenizer

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_with_custom_fields_template_and_extra_columns(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+2=", "sol": 3, "level": "easy"},
                                              {"q": "4+4=", "sol": 8, "level": "hard"}])
    cfg = DataConfig(path=path, prompt_field="q", answer_field="sol", prompt_template="{prompt}?",
                     system_prompt="add")
    train, held_out = load_datasets(cfg, tok)
    assert held_out is None and len(train) == 2
    assert train.rows[0] == {"level": "easy", "prompt": "1+2=", "answer": "3"}
    assert tok.decode(train.prompt_ids[0]) == "<|system|>add<|user|>1+2=?<|assistant|>"
    assert train.columns([1, 0]) == {"level": ["hard", "easy"], "answer": ["8", "3"]}


def test_plain_prompt_without_chat_template(tok):
    cfg = DataConfig(use_chat_template=False, system_prompt="sys", prompt_template="Q: {prompt}")
    assert format_prompt("1+1=", tok, cfg) == "sys\nQ: 1+1="


def test_missing_file_and_field_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path: data file .*missing.jsonl.* does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"), "train", DataConfig())
    with pytest.raises(ValueError, match="data.eval_path: data file .*missing.jsonl.* does not exist"):
        load_datasets(DataConfig(synthetic_num_terms=3, eval_path=str(tmp_path / "missing.jsonl")),
                      build_tiny_tokenizer())
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(ValueError, match=r"row 0 has no field 'prompt' \(data.prompt_field\)"):
        read_rows(path, "train", DataConfig())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        read_rows(str(bad), "train", DataConfig())


@pytest.mark.skipif(HAS_PYARROW, reason="pyarrow is installed: the error path cannot be reached")
def test_parquet_without_pyarrow_says_what_to_install(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="needs pyarrow, which is not installed: pip install pyarrow"):
        read_rows(str(tmp_path / "d.parquet"), "train", DataConfig())


@pytest.mark.skipif(not HAS_PYARROW, reason="needs pyarrow")
def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), tmp_path / "d.parquet")
    rows = read_rows(str(tmp_path / "d.parquet"), "train", DataConfig())
    assert rows == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_long_prompts_dropped_and_counted_or_an_error(tok):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1+1+1+1+1+1+1=", "answer": "8"}]
    ds = build_dataset(rows, tok, DataConfig(max_prompt_tokens=10), "src")
    assert len(ds) == 1 and ds.num_dropped == 1 and ds.rows[0]["answer"] == "2"
    with pytest.raises(ValueError, match="prompt 1 has 18 tokens, more than data.max_prompt_tokens=10"):
        build_dataset(rows, tok, DataConfig(max_prompt_tokens=10, drop_long_prompts=False), "src")


def test_synthetic_split_is_fixed_disjoint_and_verifiable():
    cfg = DataConfig(synthetic_num_terms=3, synthetic_max_value=9, synthetic_eval_size=200)
    train, held_out = synthetic_rows(cfg)
    assert len(held_out) == 200 and len(train) == 800
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for r in held_out[:20]:
        assert str(sum(int(x) for x in r["prompt"][:-1].split("+"))) == r["answer"]
    assert synthetic_rows(DataConfig(synthetic_num_terms=3, synthetic_eval_size=200))[1] == held_out
    with pytest.raises(ValueError, match="synthetic_eval_size=60 leaves too few"):
        synthetic_rows(DataConfig(synthetic_num_terms=2, synthetic_eval_size=60))


def test_sampler_is_deterministic_per_epoch_and_resumes():
    a = PromptSampler(10, seed=3)
    first = a.next(7) + a.next(7)  # crosses into epoch 1
    assert sorted(first[:10]) == list(range(10)) and a.epoch == 1
    b = PromptSampler(10, seed=3)
    b.next(7)
    state = b.state_dict()
    c = PromptSampler(10, seed=3)
    c.load_state_dict(state)
    assert c.next(7) == first[7:]
    assert PromptSampler(10, seed=4).next(10) != first[:10]
    assert PromptSampler(5, shuffle=False).next(7) == [0, 1, 2, 3, 4, 0, 1]


@example(n=10, seed=3, shuffle=True, before=14, after=6)  # the case: resumed inside epoch 1
@settings(max_examples=40)
@given(n=st.integers(1, 12), seed=st.integers(0, 2**31), shuffle=st.booleans(), before=st.integers(0, 60),
       after=st.integers(1, 40))
def test_a_resumed_sampler_continues_the_uninterrupted_stream(n, seed, shuffle, before, after):
    """A sampler restored from another's state (through JSON, as a checkpoint stores it), at any point of any epoch,
    gives what the uninterrupted one gives next, across later epochs; each epoch is a permutation of the items."""
    a = PromptSampler(n, seed=seed, shuffle=shuffle)
    a.next(before)
    c = PromptSampler(n, seed=seed, shuffle=shuffle)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert c.next(after) == a.next(after)
    stream = PromptSampler(n, seed=seed, shuffle=shuffle).next(n * (1 + (before + after) // n))
    assert all(sorted(stream[e : e + n]) == list(range(n)) for e in range(0, len(stream), n))


PROMPT_MSG = r"field 'prompt' \(data.prompt_field\) must be a non-empty string"
ANSWER_MSG = r"field 'answer' \(data.answer_field\) must be a string or a number"


@pytest.mark.parametrize("row, message", [
    ({"prompt": None, "answer": "2"}, "row 0 " + PROMPT_MSG + ", got None"),
    ({"prompt": "  ", "answer": "2"}, PROMPT_MSG),
    ({"prompt": 12, "answer": "2"}, PROMPT_MSG + ", got 12"),
    ({"prompt": "1+1=", "answer": True}, ANSWER_MSG + ", got True"),
    ({"prompt": "1+1=", "answer": ["2"]}, ANSWER_MSG),
])
def test_field_values_are_checked(tmp_path, row, message):
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(ValueError, match=message):
        read_rows(path, "train", DataConfig())


def test_rows_without_an_answer_are_dropped_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": None},
                                              {"prompt": "3+3=", "answer": " "}, {"prompt": "4+4=", "answer": "8"}])
    train, _ = load_datasets(DataConfig(path=path), tok)
    assert [r["answer"] for r in train.rows] == ["2", "8"] and train.num_no_answer == 2 and train.num_dropped == 0


def test_json_array_file(tmp_path):
    """A .json file may hold one array of objects (how some dataset repositories ship their file) or JSON lines."""
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": "4", "level": 1}]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=1))
    assert read_rows(str(tmp_path / "a.json"), "train", DataConfig()) == [
        {"prompt": "1+1=", "answer": "2"}, {"level": 1, "prompt": "2+2=", "answer": "4"}]
    (tmp_path / "l.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_rows(str(tmp_path / "l.json"), "train", DataConfig())) == 2
    (tmp_path / "b.json").write_text(json.dumps([{"prompt": "1", "answer": "1"}, 3]))
    with pytest.raises(ValueError, match="b.json: array item 1 must be a JSON object, got int"):
        read_rows(str(tmp_path / "b.json"), "train", DataConfig())


# ---------------------------------------------------------------------------------------------- tool-tiny


def tool_tiny_rows():
    return synthetic_rows(DataConfig(synthetic_num_terms=2, synthetic_max_value=99, synthetic_eval_size=200))


@pytest.mark.parametrize("num_terms", [2, 3])
def test_tool_tiny_demonstration_calls_the_adder_once_per_plus(num_terms):
    train, held_out = synthetic_rows(DataConfig(synthetic_num_terms=num_terms, synthetic_max_value=99))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    cfg = DataConfig(system_prompt="Use the add tool.")
    for row in train[:20]:
        messages = tool_tiny_conversation(row, cfg)
        terms = [int(t) for t in row["prompt"][:-1].split("+")]
        assert messages[:2] == [{"role": "system", "content": "Use the add tool."},
                                {"role": "user", "content": row["prompt"]}]
        calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
        results = [int(m["content"]) for m in messages if m["role"] == "tool"]
        assert len(calls) == len(results) == num_terms - 1
        running = terms[0]
        for call, term, result in zip(calls, terms[1:], results):
            assert call == {"name": "add", "arguments": {"a": running, "b": term}} and result == running + term
            running = result
        assert messages[-1] == {"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"}
        assert int(row["answer"]) == sum(terms)
    with pytest.raises(ValueError, match="not to its answer"):
        tool_tiny_conversation({"prompt": "1+2=", "answer": "4"}, cfg)


@pytest.mark.parametrize("name", ["tiny", "qwen2.5", "llama3.1"])
def test_demonstration_is_the_rollout_sequence_with_the_assistant_mask(name):
    """conversation_example: the ids are the tokenisation of the whole conversation (rendered with the assistant
    turns as the texts the policy writes), the trained tokens are exactly each assistant turn's text and its EOS
    (the tool call in the model's own format, the boxed answer), the untrained ones exactly the prompt, the template
    suffixes and the tool results; and the mask is what the rollout path gives: prompt_ids, the sampled turn,
    suffix_ids."""
    tok = tokenizer(name)
    template = ChatTemplate(tok, TOOLS)
    cfg = DataConfig()
    eos = tok.eos_token
    for row in tool_tiny_rows()[0][:5]:
        messages = tool_tiny_conversation(row, cfg)
        ex = conversation_example(template, messages)
        assert len(ex.input_ids) == len(ex.loss_mask)
        a, b = (int(t) for t in row["prompt"][:-1].split("+"))
        call = f'{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}'
        call = f"<tool_call>\n{call}\n</tool_call>" if name != "llama3.1" else call.replace("arguments", "parameters")
        answer = f"\\boxed{{{row['answer']}}}"
        texts = [call, answer]
        sampled = [*messages[:1], {"role": "assistant", "content": call}, messages[2],
                   {"role": "assistant", "content": answer}]
        whole = template.render(sampled, False)  # the sequence ends at the last turn's EOS (Qwen renders "\n" after)
        assert ex.input_ids == ids(tok, whole[: len(whole) - len(template.end_of_turn)] + eos)
        trained = [i for i, m in zip(ex.input_ids, ex.loss_mask) if m]
        assert trained == ids(tok, texts[0] + eos) + ids(tok, texts[1] + eos)
        prompt = template.prompt_ids(messages[:1])
        turn = ids(tok, call) + [tok.eos_token_id]
        suffix = template.suffix_ids(sampled[:2], [messages[2]], end_token=tok.eos_token_id)
        assert ex.input_ids[: len(prompt) + len(turn) + len(suffix)] == prompt + turn + suffix
        assert ex.loss_mask == [False] * len(prompt) + [True] * len(turn) + [False] * len(suffix) + \
            [True] * (len(ids(tok, answer)) + 1)
        assert row["answer"] in tok.decode(suffix)  # the tool result is in the untrained suffix


def test_tool_tiny_warmup_feeds_sft_warmups_answer_swap():
    """The warm-up's examples and swap responses: sft_warmup swaps a response in after the first trained token
    (ex.loss_mask.index(True)), which is where the demonstration's assistant part starts; a response is the boxed
    answer and EOS."""
    tok = build_tiny_tokenizer()
    template = ChatTemplate(tok, TOOLS)
    rows = tool_tiny_rows()[0][:8]
    examples, responses = tool_tiny_warmup(rows, template, DataConfig())
    assert len(examples) == len(responses) == len(rows)
    for row, ex, response in zip(rows, examples, responses):
        n_prompt = ex.loss_mask.index(True)
        assert ex.input_ids[:n_prompt] == template.prompt_ids(prompt_messages(row["prompt"], DataConfig()))
        assert tok.decode(ex.input_ids[n_prompt:]).startswith("<tool_call>")
        assert response == ids(tok, f"\\boxed{{{row['answer']}}}") + [tok.eos_token_id]
    assert max(len(ex.input_ids) for ex in examples) < TINY_MAX_POSITIONS


def test_a_demonstration_must_end_with_an_assistant_turn():
    template = ChatTemplate(build_tiny_tokenizer(), TOOLS)
    with pytest.raises(ValueError, match="must end with one"):
        conversation_example(template, [{"role": "user", "content": "1+2="}])
    with pytest.raises(ValueError, match="must end with one"):
        conversation_example(template, [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "x"},
                                        {"role": "user", "content": "more"}])
