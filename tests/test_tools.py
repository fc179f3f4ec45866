"""Tool calls: parsing in the three formats (several calls, malformed calls as errors, never exceptions), checked
against transformers' own ``parse_response`` with TRL 1.16's response templates; running them with TRL's wording
and every fault counted by kind; the schemas from ``get_json_schema``; the Python code tool's limits."""

import asyncio
import json
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.chat_template_utils import llama3_template, qwen3_template

from fastgrpo.environments import python_code
from fastgrpo.environments.adder import AdderEnvironment, add
from fastgrpo.environments.core import tool_methods
from fastgrpo.environments.python_code import run_python
from fastgrpo.environments.tools import ToolCall, parse_tool_calls, run_tool_calls, tool_schemas


class TemplateTokenizer:
    """What ``parse_tool_calls`` needs of a tokenizer for "parse_response": transformers' parser with a template."""

    def __init__(self, template):
        self.response_template = template

    def parse_response(self, text, prefix, tools):
        from transformers.tokenization_utils_base import _template_parse_response

        return _template_parse_response(text, self.response_template, prefix=prefix, tools=tools)


def qwen_call(name, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
values = st.one_of(st.integers(-10**6, 10**6), st.text(max_size=12), st.booleans(), st.none(),
                   st.lists(st.integers(), max_size=3))
arguments = st.dictionaries(names, values, max_size=4)
prose = st.text(st.characters(blacklist_characters="<>{}"), max_size=30)


@settings(max_examples=60)
@given(st.lists(st.tuples(names, arguments), max_size=4), st.lists(prose, min_size=5, max_size=5))
def test_qwen_calls_parse_like_transformers_with_trl_qwen3_template(calls, texts):
    """Several calls with prose between them: our parser and transformers' parse_response (TRL's Qwen3 template)
    find the same calls in the same order."""
    text = texts[0] + "".join(qwen_call(n, a) + "\n" + t for (n, a), t in zip(calls, texts[1:])) + "<|im_end|>"
    ours, errors = parse_tool_calls(text, "qwen")
    assert errors == [] and [(c.name, c.arguments) for c in ours] == calls
    theirs, errors = parse_tool_calls(text, "parse_response", TemplateTokenizer(qwen3_template))
    assert errors == [] and theirs == ours


@settings(max_examples=40)
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.sampled_from(["; ", " ", "\n"]),
       st.booleans())
def test_llama3_calls_parse_like_transformers_with_trl_llama3_template(calls, sep, tag):
    text = ("<|python_tag|>" if tag else "") + sep.join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls)
    ours, errors = parse_tool_calls(text, "llama3")
    assert errors == [] and [(c.name, c.arguments) for c in ours] == calls
    if len(calls) == 1 and not tag:  # Llama 3.1's template writes one call per turn, without the tag
        theirs, errors = parse_tool_calls(text + "<|eot_id|>", "parse_response", TemplateTokenizer(llama3_template))
        assert errors == [] and theirs == ours


def test_qwen_malformed_calls_are_errors_and_good_ones_still_parse():
    text = (qwen_call("add", {"a": 1, "b": 2}) + '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
            + '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": [1]}</tool_call>'
            + '<tool_call>{"name": "g", "arguments": "{\\"x\\": 3}"}</tool_call><tool_call>{"name": "h"')
    calls, errors = parse_tool_calls(text, "qwen")
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("g", {"x": 3})]
    assert len(errors) == 4 and all(e.startswith("malformed tool call") for e in errors)
    assert "invalid JSON" in errors[0] and "'name'" in errors[1] and "must be an object" in errors[2]
    assert "no closing </tool_call>" in errors[3]
    assert parse_tool_calls("The answer is 3.", "qwen") == ([], [])
    _, errors = parse_tool_calls(text, "parse_response", TemplateTokenizer(qwen3_template))
    assert errors and errors[0].startswith("malformed tool call")  # transformers rejects the whole turn


def test_llama3_calls():
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert parse_tool_calls(one, "llama3") == ([ToolCall("add", {"a": 1, "b": 2})], [])
    ours = parse_tool_calls(one + "<|eot_id|>", "parse_response", TemplateTokenizer(llama3_template))
    assert ours == ([ToolCall("add", {"a": 1, "b": 2})], [])  # transformers with TRL's Llama 3 template agrees
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1]}}'
    assert parse_tool_calls(two, "llama3") == ([ToolCall("a", {}), ToolCall("b", {"x": [1]})], [])
    assert parse_tool_calls("{not a call} and prose", "llama3") == ([], [])
    assert parse_tool_calls("The sum is 3.", "llama3") == ([], [])
    calls, errors = parse_tool_calls('{"name": "a", "parameters": {"x": 1}} {"name": "b", "parameters": ', "llama3")
    assert calls == [ToolCall("a", {"x": 1})] and errors[0].startswith("malformed tool call (invalid JSON")
    calls, errors = parse_tool_calls('{"name": "a", "parameters": 5}', "llama3")
    assert calls == [] and "must be an object" in errors[0]


def test_parse_tool_calls_checks_its_arguments():
    with pytest.raises(ValueError, match="fmt must be one of"):
        parse_tool_calls("", "hermes")
    with pytest.raises(ValueError, match="needs a tokenizer with a response_template"):
        parse_tool_calls("", "parse_response", object())


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


def fails(x: int) -> int:
    """Raise.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"no {x}")


def naps(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"


def swallows() -> str:
    """Sleep past the limit and swallow the interruption."""
    try:
        time.sleep(5)
    except BaseException:  # noqa: BLE001 - the hostile case: the timeout must still count
        pass
    return "fine"


async def later(x: int) -> int:
    """Double after a while.

    Args:
        x: The value.
    """
    await asyncio.sleep(0.2)
    return 2 * x


async def async_fails() -> int:
    """Raise, asynchronously."""
    raise ValueError("async no")


async def async_hangs() -> int:
    """Never finish."""
    await asyncio.sleep(60)
    return 0


def test_run_tool_calls_counts_every_fault_and_keeps_call_order():
    tools = {f.__name__: f for f in (add, shout, fails, naps, swallows, later, async_fails, async_hangs)}
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("missing", {}), ToolCall("add", {"a": 1}),
             ToolCall("add", {"a": 1, "b": 2, "c": 3}), ToolCall("fails", {"x": 7}), ToolCall("naps", {"seconds": 5}),
             ToolCall("swallows", {}), ToolCall("later", {"x": 4}), ToolCall("later", {"x": 5}),
             ToolCall("async_fails", {}), ToolCall("async_hangs", {}), ToolCall("shout", {"text": "ab" * 50})]
    loop = asyncio.new_event_loop()
    start = time.perf_counter()
    out = run_tool_calls(calls, tools, 0.5, 60, loop)
    elapsed = time.perf_counter() - start
    assert [r.name for r in out] == [c.name for c in calls]
    assert [r.fault for r in out] == [None, "unknown_tool", "bad_arguments", "bad_arguments", "raised", "timeout",
                                      "timeout", None, None, "raised", "timeout", None]
    assert out[0].content == "5" and out[7].content == "8" and out[8].content == "10"
    assert out[1].content == str({"error": "Tool missing not found."})  # TRL 1.16's wording
    assert out[4].content == str({"error": "no 7"})  # TRL: str(exception)
    assert "missing a required argument: 'b'" in out[2].content and "'c'" in out[3].content
    assert out[11].truncated and out[11].content.startswith("AB" * 30) and "truncated 40 characters" in out[11].content
    # three soft limits of 0.5 s (the sync hang, the swallowed one, the async calls together): nothing waited 5 s
    assert elapsed < 4.5
    assert run_tool_calls([ToolCall("later", {"x": 1})], tools, 1.0, 60, loop)[0].content == "2"  # loop still fine
    loop.close()


def test_schemas_come_from_get_json_schema_and_environment_methods_are_tools():
    from transformers.utils import get_json_schema

    assert tool_schemas([add]) == [get_json_schema(add)]
    schema = tool_schemas([add])[0]["function"]
    assert schema["name"] == "add" and schema["parameters"]["required"] == ["a", "b"]
    env = AdderEnvironment()
    assert list(tool_methods(env)) == ["add"]  # reset and get_reward are not tools
    assert tool_schemas(list(tool_methods(env).values())) == tool_schemas([add])


def test_python_tool_runs_code_in_its_own_directory_and_limits_it(monkeypatch):
    out = run_python("import os\nprint(sum(range(10)), os.getcwd())")
    status, line = out.split("\n")[:2]
    total, cwd = line.split(" ", 1)
    assert status == "exit status 0" and total == "45"
    assert os.path.basename(cwd).startswith(f"fastgrpo-code-{os.getpid()}-") and not os.path.exists(cwd)
    assert run_python("raise SystemExit(3)").startswith("exit status 3")
    monkeypatch.setattr(python_code, "TIME_LIMIT_S", 0.5)
    start = time.perf_counter()
    assert run_python("while True:\n    pass").startswith("killed: ran longer than 0.5 s")
    assert time.perf_counter() - start < 3
    out = run_python("x = bytearray(2 << 30)\nprint('allocated')")  # 2 GiB against the 512 MiB cap
    assert "MemoryError" in out and "allocated" not in out
    out = run_python("open('big', 'wb').write(b'x' * (4 << 20))")  # past the 1 MiB file limit
    assert not out.startswith("exit status 0")
    out = run_python("print('y' * 100000)")
    assert out.endswith("... [output truncated]") and len(out) < python_code.OUTPUT_CHARS + 100
