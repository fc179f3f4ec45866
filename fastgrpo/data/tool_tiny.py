"""The tool-tiny demo's data: the built-in task's questions and answers, answered by calling the adder tool.

The questions are :func:`fastgrpo.data.synthetic.synthetic_rows`' (``"37+85="`` -> 122 with
``data.synthetic_num_terms`` 2 and ``data.synthetic_max_value`` 99, too hard for the tiny model to add alone). A
demonstration calls ``add(a, b)`` once per "+" (``a``: the running sum, ``b``: the next term), then gives the last
result in ``\\boxed{}``. The supervised warm-up trains on whole demonstrations built exactly as a rollout builds the
trajectory (:mod:`fastgrpo.environments.chat`: the prompt's ids, the assistant's tokens, the template suffixes), so
it trains the very token sequences GRPO then samples and scores.
"""

from __future__ import annotations

from fastgrpo.config import DataConfig
from fastgrpo.data.prompts import prompt_messages
from fastgrpo.data.responses import SFTExample
from fastgrpo.data.synthetic import sft_completion

ADD_TOOL = "add"


def tool_tiny_conversation(row: dict, cfg: DataConfig) -> list[dict]:
    """The demonstration for a built-in task row: the prompt (:func:`prompt_messages`), one assistant turn per
    addition calling ``add(a, b)`` with its tool result, and the answer in ``\\boxed{}``."""
    terms = [int(t) for t in row["prompt"].removesuffix("=").split("+")]
    messages, total = prompt_messages(row["prompt"], cfg), terms[0]
    for term in terms[1:]:
        call = {"type": "function", "function": {"name": ADD_TOOL, "arguments": {"a": total, "b": term}}}
        total += term
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": ADD_TOOL, "content": str(total)}]
    if str(total) != row["answer"]:
        raise ValueError(f"row {row!r}: its terms add up to {total}, not to its answer")
    return [*messages, {"role": "assistant", "content": sft_completion(row["answer"])}]


def _assistant_text(template, conversation: list[dict], message: dict) -> str:
    """The text the policy writes for assistant ``message`` after ``conversation``: the template's rendering of it
    between the generation prompt and the end of turn (a ``tool_calls`` field becomes the model's own tool-call
    format: Qwen's ``<tool_call>`` JSON, Llama 3.1's bare JSON)."""
    head = template.render(conversation, True)
    whole = template.render([*conversation, message], False)
    if not (whole.startswith(head) and whole.endswith(template.end_of_turn)):
        raise ValueError(f"{template.name} renders an assistant turn differently after the generation prompt")
    return whole[len(head) : len(whole) - len(template.end_of_turn)]


def conversation_example(template, messages: list[dict]) -> SFTExample:
    """A demonstration as a rollout's token sequence, with its loss mask.

    ``template``: a :class:`fastgrpo.environments.chat.ChatTemplate` (holding the tools). ``messages``: the prompt
    messages, then assistant turns (content and/or ``tool_calls``) each followed by the messages the environment
    answers with (tool results, user messages), ending with an assistant turn. The sequence is
    ``template.prompt_ids`` of the prompt, then per assistant turn its text's tokens and the EOS that ends the turn
    (when the template's end of turn starts with the EOS, as Qwen's and the tiny model's do; always after the last
    turn), then ``template.suffix_ids`` of what follows. The mask is True on the assistant turns' tokens and their
    EOS, False on the prompt, the tool results and every template token between turns: exactly the mask the rollout
    gives the sampled tokens.
    """
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or messages[-1]["role"] != "assistant":
        raise ValueError("a demonstration needs an assistant turn and must end with one")
    tok = template.tok
    eos = tok.eos_token_id
    eos_ends_turn = template.end_of_turn.startswith(tok.decode([eos]))
    ids = template.prompt_ids(messages[:first])
    mask = [False] * len(ids)
    sampled = list(messages[:first])  # the conversation as the policy sees it: assistant turns as their texts
    k = first
    while k < len(messages):
        text = _assistant_text(template, sampled, messages[k])
        nxt = next((j for j in range(k + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        turn = template.ids(text) + ([eos] if eos_ends_turn or nxt == len(messages) else [])
        ids += turn
        mask += [True] * len(turn)
        sampled.append({"role": "assistant", "content": text})
        if nxt < len(messages):
            suffix = template.suffix_ids(sampled, messages[k + 1 : nxt], end_token=eos if eos_ends_turn else None)
            ids += suffix
            mask += [False] * len(suffix)
            sampled += messages[k + 1 : nxt]
        k = nxt
    return SFTExample(ids, mask)


def tool_tiny_warmup(rows: list[dict], template, cfg: DataConfig) -> tuple[list[SFTExample], list[list[int]]]:
    """The tool-tiny supervised warm-up, in the shape ``GRPO.warmup_examples`` returns for
    ``fastgrpo.algorithms.sft.sft_warmup``: each row's demonstration (:func:`conversation_example` of
    :func:`tool_tiny_conversation`), and each row's answer given directly (``\\boxed{}`` and EOS, no tool call),
    the responses that ``sft.answer_noise`` swaps in after the prompt: a warmed-up policy then sometimes answers
    without the tool, mostly wrongly."""
    examples = [conversation_example(template, tool_tiny_conversation(r, cfg)) for r in rows]
    eos = template.tok.eos_token_id
    responses = [template.ids(sft_completion(r["answer"])) + [eos] for r in rows]
    return examples, responses

