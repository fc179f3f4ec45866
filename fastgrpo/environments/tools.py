"""Tool calls: parsed from a turn's text, described by JSON schemas, run with every fault turned into an error
observation.

Parsing (:func:`parse_tool_calls`, in the trainer) takes the text of one assistant turn and a format:

- ``"qwen"``: Qwen2.5 / Qwen3 (and the tiny model's template): each call is ``<tool_call>{json}</tool_call>`` with
  ``{"name": str, "arguments": object}``; several per turn, text around them is content.
- ``"llama3"``: Llama 3.1 / 3.2 JSON tool calling: the turn (after an optional ``<|python_tag|>``) is one or more
  ``{"name": str, "parameters": object}`` objects (``"arguments"`` accepted too), separated by ``;`` or white space.
  A turn that does not start with ``{"name"`` is plain content.
- ``"parse_response"``: the tokenizer's own ``response_template`` (``tokenizer.parse_response``, transformers >= 5.13;
  TRL's ``add_response_schema`` sets one for known templates).

A call that cannot be read (bad JSON, no name, arguments that are not an object, an unclosed ``<tool_call>``) is an
error string, never an exception. TRL 1.16 treats such a turn as plain text and ends the rollout; here the model
gets the error as a tool message and may try again (counted as ``malformed``).

Running (:func:`run_tool_calls`, in a worker process) follows TRL 1.16's ``_tool_call_loop``: the tool's result is
sent back as ``str(result)``; a failure as ``str({"error": message})``, where an unknown tool's message is
``Tool <name> not found.`` and an exception's is ``str(exception)``. Unlike TRL, every fault is also counted by kind
(:data:`TOOL_FAULTS`), arguments are checked against the signature before the call (so a ``TypeError`` raised inside
a tool counts as ``raised``, not ``bad_arguments``), each call is time-limited (``timeout``: SIGALRM on the worker's
main thread; code that escapes it is stopped by the pool's hard limit, which kills the worker), async tools of one
turn run concurrently on the worker's event loop, and results keep the order of the calls.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastgrpo.rewards import RewardTimeout, time_limit

TOOL_FORMATS = ("qwen", "llama3", "parse_response")
TOOL_FAULTS = ("malformed", "too_many", "unknown_tool", "bad_arguments", "raised", "timeout", "worker_died")
"""Kinds of failed tool calls: unreadable, past the per-turn limit, no such tool, arguments that do not bind to the
signature, the tool raised, ran past its time limit, or its worker died (the pool's hard limit or a crash)."""
SNIPPET_CHARS = 200  # how much of an unreadable call an error message quotes
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_LLAMA_START_RE = re.compile(r'\{\s*"name"')
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


@dataclass
class ToolResult:
    """What a call sent back: the tool message's content, the fault kind (None: it worked) and whether the content
    was cut to the observation limit."""

    name: str
    content: str
    fault: str | None = None
    truncated: bool = False


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "..."


def _call_from(obj, args_key: str) -> ToolCall:
    """A call from a decoded JSON object ``{"name": ..., args_key: {...}}``; raises ValueError naming what is
    wrong. Arguments that are a JSON string holding an object are decoded (some models emit them so)."""
    if not isinstance(obj, dict):
        raise ValueError("a tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a string 'name'")
    arguments = obj.get(args_key, obj.get("arguments"))
    if arguments is None:
        arguments = {}  # a call without arguments (TRL normalises it the same way)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"the arguments of {name!r} are neither an object nor a JSON string of one") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {name!r} must be an object")
    return ToolCall(name, arguments)


def _parse_qwen(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors = [], []
    for body in _TOOL_CALL_RE.findall(text):
        try:
            calls.append(_call_from(json.loads(body), "arguments"))
        except json.JSONDecodeError as e:
            errors.append(f"malformed tool call (invalid JSON: {e.msg}): {_snippet(body)}")
        except ValueError as e:
            errors.append(f"malformed tool call ({e}): {_snippet(body)}")
    tail = _TOOL_CALL_RE.sub("", text)
    if "<tool_call>" in tail:
        errors.append(f"malformed tool call (no closing </tool_call>): {_snippet(tail[tail.index('<tool_call>'):])}")
    return calls, errors


def _parse_llama3(text: str) -> tuple[list[ToolCall], list[str]]:
    rest = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not _LLAMA_START_RE.match(rest):
        return [], []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
            calls.append(_call_from(obj, "parameters"))
        except json.JSONDecodeError as e:
            return calls, [f"malformed tool call (invalid JSON: {e.msg}): {_snippet(rest)}"]
        except ValueError as e:
            return calls, [f"malformed tool call ({e}): {_snippet(rest[:end])}"]
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
        if rest and not rest.startswith("{"):
            return calls, [f"malformed tool call (text after the calls): {_snippet(rest)}"]
    return calls, []


def _parse_with_template(text: str, tokenizer, prefix: str, tools: list | None) -> tuple[list[ToolCall], list[str]]:
    try:
        parsed = tokenizer.parse_response(text, prefix=prefix, tools=tools)
    except (ValueError, TypeError) as e:  # what transformers raises on an unreadable call (TRL catches the same)
        return [], [f"malformed tool call ({_snippet(str(e))})"]
    calls, errors = [], []
    for item in (parsed or {}).get("tool_calls") or []:
        fn = item.get("function", item) if isinstance(item, dict) else item
        try:
            calls.append(_call_from(fn, "arguments"))
        except ValueError as e:
            errors.append(f"malformed tool call ({e}): {_snippet(str(item))}")
    return calls, errors


def parse_tool_calls(text: str, fmt: str, tokenizer=None, *, prefix: str = "",
                     tools: list | None = None) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in one assistant turn ``text`` and an error string per call that could not be read.

    ``fmt``: one of :data:`TOOL_FORMATS` (see the module docstring). ``"parse_response"`` needs ``tokenizer`` with a
    ``response_template``; ``prefix`` is the text before the turn (what the template pre-wrote, e.g. an opening
    ``<think>``) and ``tools`` the tool schemas (transformers types the arguments from them).
    """
    if fmt == "qwen":
        return _parse_qwen(text)
    if fmt == "llama3":
        return _parse_llama3(text)
    if fmt == "parse_response":
        if getattr(tokenizer, "response_template", None) is None:
            raise ValueError("tool format 'parse_response' needs a tokenizer with a response_template")
        return _parse_with_template(text, tokenizer, prefix, tools)
    raise ValueError(f"fmt must be one of {TOOL_FORMATS}, got {fmt!r}")


def tool_schemas(functions: Sequence[Callable]) -> list[dict]:
    """The JSON schemas of ``functions`` as chat templates render them (``transformers.utils.get_json_schema``:
    type hints and a Google-style docstring with an ``Args:`` section are required)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(f) for f in functions]


def error_content(message: str) -> str:
    """A failed call's tool message, worded as TRL 1.16 words it: ``str({"error": message})``."""
    return str({"error": message})


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` cut to ``max_chars`` characters with a note of how many were cut, and whether it was."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"... [truncated {len(text) - max_chars} characters]", True


def _cut(name: str, content: str, fault: str | None, max_chars: int) -> ToolResult:
    text, cut = truncate(content, max_chars)
    return ToolResult(name, text, fault, cut)


def run_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Callable], timeout_s: float, max_chars: int,
                   loop: asyncio.AbstractEventLoop) -> list[ToolResult]:
    """Run ``calls`` against ``tools`` (name -> function or bound method, sync or async); never raises for a
    tool's fault. Each call gets ``timeout_s``; the async calls of the turn run concurrently on ``loop`` (each
    within ``timeout_s``, all within 2 × ``timeout_s``). Contents longer than ``max_chars`` are cut (with a note
    saying how much)."""
    results: list[ToolResult | None] = [None] * len(calls)
    pending = []  # (index, coroutine function, arguments)
    for i, call in enumerate(calls):
        fn = tools.get(call.name)
        if fn is None:
            results[i] = ToolResult(call.name, error_content(f"Tool {call.name} not found."), "unknown_tool")
            continue
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            results[i] = ToolResult(call.name, error_content(f"{call.name}: {e}"), "bad_arguments")
            continue
        if inspect.iscoroutinefunction(fn):
            pending.append((i, fn, call.arguments))
            continue
        with time_limit(timeout_s) as status:
            try:
                out, fault = str(fn(**call.arguments)), None
            except RewardTimeout:
                out, fault = "", "timeout"
            except Exception as e:  # noqa: BLE001 - a tool's fault is the model's observation, never the run's
                out, fault = error_content(str(e)), "raised"
        if status["fired"]:  # also when the tool swallowed the timeout
            out, fault = error_content(f"Tool {call.name} ran longer than {timeout_s} s"), "timeout"
        results[i] = _cut(call.name, out, fault, max_chars)
    if pending:
        for (i, _, _), r in zip(pending, _run_async(pending, timeout_s, loop)):
            name = calls[i].name
            if isinstance(r, (TimeoutError, asyncio.TimeoutError, RewardTimeout)):
                results[i] = ToolResult(name, error_content(f"Tool {name} ran longer than {timeout_s} s"), "timeout")
            elif isinstance(r, BaseException):
                results[i] = _cut(name, error_content(str(r)), "raised", max_chars)
            else:
                results[i] = _cut(name, str(r), None, max_chars)
    return results


def _run_async(pending: list, timeout_s: float, loop: asyncio.AbstractEventLoop) -> list:
    """The results (or exceptions) of the turn's async calls, run concurrently, each within ``timeout_s``; a
    coroutine that blocks the loop (sync code inside it) is stopped by SIGALRM after 2 × ``timeout_s``, and all of
    them then time out."""

    async def gather():
        return await asyncio.gather(*(asyncio.wait_for(fn(**args), timeout_s) for _, fn, args in pending),
                                    return_exceptions=True)

    with time_limit(2 * timeout_s) as status:
        try:
            out = loop.run_until_complete(gather())
        except RewardTimeout:
            out = None
    if status["fired"] or out is None:
        cancel_pending(loop, timeout_s)
        return [RewardTimeout()] * len(pending)
    return out


def cancel_pending(loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
    """Cancel the tasks an interrupted ``run_until_complete`` left on ``loop`` (so no later call runs them), giving
    them ``timeout_s`` to unwind."""
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    with time_limit(timeout_s):
        try:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        except RewardTimeout:
            pass


__all__ = ["TOOL_FAULTS", "TOOL_FORMATS", "ToolCall", "ToolResult", "cancel_pending", "parse_tool_calls",
           "run_tool_calls", "tool_schemas", "truncate"]
