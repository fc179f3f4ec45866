"""Chat templates for multi-turn rollouts (fastgrpo/environments/chat.py): a conversation built turn by turn from
prompt_ids, the sampled ids and suffix_ids equals the tokenisation of its whole rendering (HF's apply_chat_template),
on the tiny tokenizer and on byte-level BPE tokenizers built here carrying the published Qwen2.5, Qwen3 and Llama 3.1
templates (tests/data/chat_templates/); Qwen3 gets the training template; a non-preserving template raises naming it.
"""

import pytest
from chat_tokenizers import QWEN_SPLIT, TOKENIZERS, TOOLS, add, bpe_tokenizer, ids, published, qwen3, tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.environments.chat import KNOWN_TEMPLATES, QWEN3_TRAINING_TEMPLATE, ChatTemplate, template_name
from fastgrpo.models.loading import build_tiny_tokenizer


def test_the_published_templates_are_recognised():
    for name, family in [("qwen2_5", "Qwen2.5"), ("qwen3", "Qwen3"), ("llama3_1", "Llama 3.1"),
                         ("deepseek_r1_distill", "DeepSeek-R1-Distill")]:
        assert family in template_name(None, published(name))
    assert len(KNOWN_TEMPLATES) == 4
    assert "sha256" in template_name(None, published("qwen3") + " ")


# ---------------------------------------------------------------------------------------------- turn by turn

TEXT = st.text(alphabet="abcxyz XYZ019.,:;!?{}[]()\"'-_=+/\n", min_size=1, max_size=24).map(str.strip).filter(bool)


@st.composite
def conversations(draw, with_tools: bool, think: bool):
    """Turns of (sampled content, ended by EOS?, new messages): tool results (with tools) or user messages."""
    turns = []
    for _ in range(draw(st.integers(1, 4))):
        content = draw(TEXT)
        if think and draw(st.booleans()):
            content = f"<think>\n{draw(TEXT)}\n</think>\n\n{content}"
        if with_tools and draw(st.booleans()):
            new = [{"role": "tool", "name": "add", "content": draw(TEXT)} for _ in range(draw(st.integers(1, 2)))]
        else:
            new = [{"role": "user", "content": draw(TEXT)}]
        turns.append((content, draw(st.booleans()), new))
    system = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    return system + [{"role": "user", "content": draw(TEXT)}], turns


@pytest.mark.parametrize("name, kwargs", [(name, {}) for name in TOKENIZERS] + [("qwen3", {"enable_thinking": False})])
@pytest.mark.parametrize("with_tools", [False, True])
@given(data=st.data())
@settings(max_examples=25)
def test_prompt_sampled_and_suffix_ids_are_the_tokenised_conversation(name, kwargs, with_tools, data):
    """prompt_ids + Σ (sampled ids [+ the EOS that ended the turn] + suffix_ids) equals HF's tokenisation of the
    whole conversation rendered by the template in use, for random contents, turn counts, tool and user messages,
    and turns ended by EOS or by a stop string (then the suffix carries the end of turn). The sampled ids here are
    each content tokenised alone; the contents are stripped (Llama 3.1 trims them) and the template's turn
    boundaries are special tokens, so on these BPE tokenizers the equality is exact too. Qwen3 with thinking off
    too: its generation prompt then ends with an empty think block, which the suffix carries."""
    tok = tokenizer(name)
    template = ChatTemplate(tok, TOOLS if with_tools else None, template_kwargs=kwargs)
    messages, turns = data.draw(conversations(with_tools, think=name == "qwen3"))
    seq = template.prompt_ids(messages)
    for content, eos_ended, new in turns:
        seq += ids(tok, content) + ([tok.eos_token_id] if eos_ended else [])
        messages = [*messages, {"role": "assistant", "content": content}]
        seq += template.suffix_ids(messages, new, end_token=tok.eos_token_id if eos_ended else None)
        messages = [*messages, *new]
    whole = tok.apply_chat_template(messages, tools=template.tools, chat_template=template.template,
                                    add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    assert seq == whole


def test_the_suffix_keeps_the_newline_after_a_sampled_im_end():
    """TRL #5317: the naive diff of the two renderings starts at ``<|im_start|>`` and loses the ``\\n`` that
    follows the ``<|im_end|>`` the policy sampled; the suffix starts with it (or with ``<|im_end|>`` itself when a
    stop string ended the turn, or when the policy stopped on another EOS token)."""
    tok = tokenizer("qwen2.5")
    template = ChatTemplate(tok, TOOLS)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": call}]
    new = [{"role": "tool", "name": "add", "content": "3"}]
    naive = template.render(messages + new, True)[len(template.render(messages, False)):]
    assert naive.startswith("<|im_start|>user")
    im_end, newline = tok.convert_tokens_to_ids("<|im_end|>"), ids(tok, "\n")
    after_eos = template.suffix_ids(messages, new, end_token=im_end)
    assert after_eos == newline + ids(tok, naive)
    assert template.suffix_ids(messages, new) == [im_end] + after_eos
    other_eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert template.suffix_ids(messages, new, end_token=other_eos) == [im_end] + after_eos


def test_suffix_ids_argument_errors():
    template = ChatTemplate(tokenizer("tiny"))
    with pytest.raises(ValueError, match="must end with the assistant message"):
        template.suffix_ids([{"role": "user", "content": "1+2="}], [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="new_messages is empty"):
        template.suffix_ids([{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}], [])
    with pytest.raises(ValueError, match="tools must be a list of JSON-schema dicts"):
        ChatTemplate(tokenizer("tiny"), tools=[add])


def test_a_runtime_re_render_raises_instead_of_guessing():
    """A template that passes the construction check can still re-render on content the probe did not hold (here:
    an earlier turn's content is shortened once a later message mentions 'summarise'): suffix_ids raises."""
    tok = build_tiny_tokenizer()
    tok.chat_template = tok.chat_template.replace(
        "{{ '<|assistant|>' + content }}",
        "{{ '<|assistant|>' + (content[:1] if messages[-1]['content'] == 'summarise' else content) }}")
    template = ChatTemplate(tok)
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "three"}]
    with pytest.raises(ValueError, match="not prefix-preserving here"):
        template.suffix_ids(messages, [{"role": "user", "content": "summarise"}])


# ---------------------------------------------------------------------------------------------- template choice


def test_qwen3_gets_the_training_template_and_renders_as_qwen3_elsewhere():
    """Qwen3's own template fails the check (a copy that differs only by a comment, so it is not recognised,
    raises); the recognised one is replaced by the training template, which renders every prompt exactly as Qwen3's
    (system, tools, user and tool turns, the generation prompt with and without thinking), and with thinking on a
    conversation whose assistant turns Qwen3 keeps as they are (a last turn in its think format, a tool call after
    the last question) exactly as Qwen3's too. With thinking off, the training template keeps the generation
    prompt's empty think block in every assistant turn, where Qwen3 drops it from the history."""
    tok = tokenizer("qwen3")
    template = ChatTemplate(tok, TOOLS)
    assert template.template == QWEN3_TRAINING_TEMPLATE and "Qwen3" in template.name
    with pytest.raises(ValueError, match=r"chat template of .* \(sha256 .*\) cannot be used for multi-turn rollouts"):
        ChatTemplate(qwen3(published("qwen3") + "{#- a copy #}"), TOOLS)
    own = published("qwen3")
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    prompts = [[{"role": "user", "content": "hi"}],
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}],
               [{"role": "user", "content": "1+2="}, {"role": "tool", "name": "add", "content": "3"},
                {"role": "tool", "name": "add", "content": "4"}]]
    histories = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="},
                  {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n3"}],
                 [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "name": "add", "content": "3"}, {"role": "tool", "name": "add", "content": "4"}]]
    cases = [(m, True, kw) for m in prompts for kw in ({}, {"enable_thinking": False})]
    cases += [(m, m[-1]["role"] != "assistant", {}) for m in histories]
    for messages, gen, kwargs in cases:
        for tools in (None, TOOLS):
            args = dict(tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)
            mine = tok.apply_chat_template(messages, chat_template=QWEN3_TRAINING_TEMPLATE, **args)
            assert mine == tok.apply_chat_template(messages, chat_template=own, **args)
    off = dict(tools=None, tokenize=False, add_generation_prompt=False, enable_thinking=False)
    history = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(history, chat_template=QWEN3_TRAINING_TEMPLATE, **off).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n3<|im_end|>\n")


def test_a_template_that_is_not_prefix_preserving_raises_naming_it():
    """DeepSeek-R1-Distill's template drops the reasoning of earlier turns on re-render: it is named; an unknown
    template that renders only the last assistant turn is named by the tokenizer and its hash."""
    r1 = bpe_tokenizer(published("deepseek_r1_distill"), ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                                          "<｜User｜>", "<｜Assistant｜>"], ["<think>", "</think>"],
                       "<｜end▁of▁sentence｜>", QWEN_SPLIT, bos="<｜begin▁of▁sentence｜>")
    with pytest.raises(ValueError, match="DeepSeek-R1-Distill .* cannot be used for multi-turn rollouts"):
        ChatTemplate(r1)
    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ '<|' + m['role'] + '|>' + "
        "m['content'] }}{% endif %}{% if m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    tok.name_or_path = "my-model"
    with pytest.raises(ValueError, match=r"the chat template of 'my-model' \(sha256 [0-9a-f]{12}\) cannot be used"):
        ChatTemplate(tok)


def test_tools_need_a_template_that_renders_tool_messages():
    tok = build_tiny_tokenizer()
    tok.chat_template = tok.chat_template.replace("{% elif m['role'] == 'tool' %}", "{% elif m['role'] == 'x' %}")
    tok.chat_template = tok.chat_template.replace("{% elif not (m['role'] == 'system' and loop.first) %}",
                                                  "{% elif m['role'] == 'user' %}")
    ChatTemplate(tok)  # no tools: user observations only
    with pytest.raises(ValueError, match="does not render tool messages"):
        ChatTemplate(tok, TOOLS)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        ChatTemplate(tok)


def test_tool_call_format():
    assert ChatTemplate(tokenizer("tiny"), TOOLS).tool_call_format() == "qwen"
    assert ChatTemplate(tokenizer("qwen2.5"), TOOLS).tool_call_format() == "qwen"
    assert ChatTemplate(tokenizer("qwen3"), TOOLS).tool_call_format() == "qwen"
    assert ChatTemplate(tokenizer("llama3.1"), TOOLS).tool_call_format() == "llama3"
    tok = build_tiny_tokenizer()
    tok.response_template = {"type": "object"}
    assert ChatTemplate(tok).tool_call_format() == "parse_response"
    tok = build_tiny_tokenizer()
    tok.chat_template = tok.chat_template.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    with pytest.raises(ValueError, match="writes tool calls in no format fastgrpo parses"):
        ChatTemplate(tok).tool_call_format()
