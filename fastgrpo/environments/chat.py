"""Chat templates for multi-turn rollouts: a conversation's prompt ids, and the ids appended after each turn.

A multi-turn trajectory is one token sequence that is never re-tokenised::

    prompt_ids(messages) + sampled_1 + suffix_ids(..., new_1) + sampled_2 + suffix_ids(..., new_2) + ...

``sampled_k`` are the ids the policy sampled (kept as sampled; nothing is decoded and re-encoded), the suffixes are
rendered by the chat template and tokenised on their own. For a prefix-preserving template, when each sampled text
tokenises to the sampled ids, this sequence is exactly the tokenisation of the rendered conversation.

**The suffix.** ``W`` = the conversation rendered up to the turn just sampled (no generation prompt), ``F`` = the
conversation with the new messages and the generation prompt. The sampled content ends in ``W`` where the template's
end-of-turn text ``E`` begins (``E`` is measured once, at construction, as what the template renders after an
assistant message's content: ``<|im_end|>\\n`` for Qwen, ``<|eot_id|>`` for Llama 3.1). ``F`` must begin with that
prefix of ``W`` (else the template re-rendered the conversation: ``ValueError``, never a re-tokenising fallback), and
the suffix is the rest of ``F``, less the end-of-turn token when the policy sampled it, tokenised alone. Cutting at the
end of the content, not at the end of ``W``, keeps the text between the sampled EOS and the next message: the naive
diff ``F[len(W):]`` drops Qwen's ``<|im_end|>\\n`` and with it the newline after a sampled ``<|im_end|>`` (TRL #5317).

**The construction check** (TRL 1.16's ``is_chat_template_prefix_preserving`` is the reference: it compares the ids
of one ``[user, assistant]`` rendering with ``[user, assistant, tool]``; this check is stricter): a probe conversation
(a system prompt, an assistant turn with a ``<think>`` block and one without, a tool turn when the template renders
tool messages, then a new user question and another turn) is built exactly as a rollout builds it, with
:meth:`ChatTemplate.prompt_ids` and :meth:`ChatTemplate.suffix_ids`, and compared with the rendering of the whole
conversation, as text and as ids. A template that fails is replaced by a known prefix-preserving training template
(Qwen3 -> :data:`QWEN3_TRAINING_TEMPLATE`: Qwen3 drops the ``<think>`` blocks of turns before the last user question
and adds an empty one to a last turn without one) or raises ``ValueError`` naming it.

Cost: two template renders of the conversation so far per suffix (on the host, once per turn and sample); the
construction check renders a probe of ~9 messages ~10 times.
"""

from __future__ import annotations

import hashlib

SENTINEL = "fastgrpo-content-7e1d"  # stands for an assistant turn's content when measuring the end-of-turn text

# Published chat templates by the sha256 of their text, to name them in errors and to pick a training template.
# tests/data/chat_templates/ holds the texts (byte-identical to the model repos' tokenizer_config.json).
KNOWN_TEMPLATES = {
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "Qwen2.5 (Qwen/Qwen2.5-*-Instruct)",
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "Qwen3 (Qwen/Qwen3-*)",
    "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65": "Llama 3.1 (meta-llama/Llama-3.1-*-Instruct)",
    "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f": "DeepSeek-R1-Distill (deepseek-ai/DeepSeek-R1-"
                                                                        "Distill-*)",
}
QWEN3_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"

# Qwen3's template with one change: an assistant message renders as given, its content verbatim after what the
# generation prompt writes (a <think> block it holds stays exactly where the policy sampled it; with enable_thinking
# false the generation prompt's empty think block comes before it; a reasoning_content field renders as a <think>
# block before it), in every turn. Qwen3's own template keeps the think blocks only after the last user question,
# re-formats them, and gives a last turn without one an empty block, so appending a message changes how earlier turns
# render. The system, tools, user and tool parts and the generation prompt render as Qwen3's do, character for
# character (tests/test_chat.py checks it against the published template).
QWEN3_TRAINING_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content is string %}"
    "{%- set content = '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') %}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}"
    "{%- set content = '<think>\\n\\n</think>\\n\\n' + content %}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
TRAINING_TEMPLATES = {QWEN3_SHA256: QWEN3_TRAINING_TEMPLATE}


def template_name(tokenizer, template: str) -> str:
    """A template's name for messages: the published model family when known, else the tokenizer's name and the
    template's sha256 prefix."""
    digest = hashlib.sha256(template.encode()).hexdigest()
    owner = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if digest in KNOWN_TEMPLATES:
        return f"the {KNOWN_TEMPLATES[digest]} chat template of {owner!r}"
    return f"the chat template of {owner!r} (sha256 {digest[:12]})"


def first_difference(a: str, b: str) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ChatTemplate:
    """A tokenizer's chat template, checked prefix-preserving, with the tools it renders (module docstring).

    ``tools``: JSON schemas (``transformers.utils.get_json_schema``), rendered into every prompt as the template does
    (``apply_chat_template(tools=...)``). ``template_kwargs``: the template's own variables, passed to every render
    (Qwen3's ``enable_thinking``). ``template``: the template used (the tokenizer's own, or the training
    template that replaced it), ``name``: how messages name it, ``end_of_turn``: the text it renders after an
    assistant turn's content (measured by the construction check). Host-only, stateless after construction: one
    instance serves every sample of a run.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be a list of JSON-schema dicts (transformers.utils.get_json_schema), got "
                             f"{tools!r}")
        self.tok = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: "
                             "multi-turn rollouts render conversations with one")
        own = tokenizer.get_chat_template(tools=self.tools)
        self.name = template_name(tokenizer, own)
        self.template = own
        problem = self._check()
        digest = hashlib.sha256(own.encode()).hexdigest()
        if problem and digest in TRAINING_TEMPLATES:
            self.template = TRAINING_TEMPLATES[digest]
            self.name = f"{self.name}, replaced by fastgrpo's prefix-preserving training template"
            problem = self._check()
        if problem:
            raise ValueError(f"{self.name} cannot be used for multi-turn rollouts: {problem}. Set a prefix-preserving "
                             "template on the tokenizer (tokenizer.chat_template = ...): appending messages must not "
                             "change how the earlier ones render")

    # ------------------------------------------------------------------------------------------------ rendering

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        """``messages`` rendered as text by :attr:`template` with :attr:`tools`."""
        return self.tok.apply_chat_template(messages, tools=self.tools, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=generation_prompt, **self.template_kwargs)

    def ids(self, text: str) -> list[int]:
        """``text`` tokenised alone, without the tokenizer's BOS/EOS (the templates write those themselves)."""
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` rendered with the tools and the generation prompt."""
        return self.ids(self.render(messages, True))

    def suffix_ids(self, messages: list[dict], new_messages: list[dict], *, end_token: int | None = None
                   ) -> list[int]:
        """The ids that follow the turn the policy just sampled: the rest of the assistant turn, ``new_messages``
        (tool results, a user message, an observation) and the next generation prompt.

        ``messages``: the conversation so far, ending with the assistant message whose content is the sampled text
        (without the text of the token that ended it). ``end_token``: the turn's last sampled id when that token
        ended the turn and is not content (an EOS/stop token; for :class:`fastgrpo.environments.EnvTurns`, any
        special token there, one in whose text a stop string completed too), None otherwise. The suffix starts with
        the template's end of turn (``<|im_end|>\\n``) less ``end_token`` when the end of turn starts with its text,
        so that a sampled ``<|im_end|>`` is followed by ``\\n<|im_start|>...``; when the end of turn starts with other
        text (a model that stopped on ``<|endoftext|>`` where its template writes ``<|im_end|>``), the whole end of
        turn follows the sampled token. ``ValueError`` when appending ``new_messages`` re-renders the conversation,
        or when the template cannot render them (its own error: a role it refuses).
        """
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("suffix_ids: messages must end with the assistant message the policy just sampled")
        if not new_messages:
            raise ValueError("suffix_ids: new_messages is empty (the trajectory ends: there is no suffix)")
        return self.ids(self._suffix_text(messages, new_messages, end_token))

    def _suffix_text(self, messages: list[dict], new_messages: list[dict], end_token: int | None) -> str:
        before = self.render(messages, False)
        if not before.endswith(self.end_of_turn):
            raise ValueError(f"{self.name} rendered the last assistant turn without its end of turn "
                             f"{self.end_of_turn!r}: {before[-80:]!r}")
        cut = len(before) - len(self.end_of_turn)  # where the sampled content ends
        try:
            after = self.render(messages + new_messages, True)
        except Exception as e:  # the template refuses the new messages (raise_exception on a role, a TypeError)
            raise ValueError(f"{self.name} cannot render the new messages: {type(e).__name__}: {e}") from e
        if not after.startswith(before[:cut]):
            at = first_difference(after, before[:cut])
            raise ValueError(f"{self.name} is not prefix-preserving here: appending {len(new_messages)} message(s) "
                             f"re-rendered the conversation at character {at} ({before[at:at + 40]!r} became "
                             f"{after[at:at + 40]!r})")
        suffix = after[cut:]
        if end_token is not None:
            end_text = self.tok.decode([end_token])  # one stop token's text (e.g. "<|im_end|>"), a vocabulary lookup
            if end_text and suffix.startswith(end_text):
                suffix = suffix[len(end_text):]
        return suffix

    def tool_call_format(self) -> str:
        """How this model writes tool calls: ``"parse_response"`` (the tokenizer has a response template for
        ``tokenizer.parse_response``), ``"qwen"`` (``<tool_call>{json}</tool_call>``, Qwen2.5/Qwen3 and the tiny
        model) or ``"llama3"`` (Llama 3.1's bare ``{"name": ..., "parameters": ...}``)."""
        if getattr(self.tok, "response_template", None) is not None:
            return "parse_response"
        if "<tool_call>" in self.template:
            return "qwen"
        if '"parameters": ' in self.template:
            return "llama3"
        raise ValueError(f"{self.name} writes tool calls in no format fastgrpo parses (Qwen's <tool_call>, Llama "
                         "3.1's JSON) and the tokenizer has no response_template for tokenizer.parse_response")

    # ------------------------------------------------------------------------------------------------ the check

    def _renders_tool_messages(self) -> bool:
        """Whether the template shows a tool message's content (some drop the tool role silently or raise)."""
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                 {"role": "tool", "name": "f", "content": SENTINEL}]
        try:
            return SENTINEL in self.render(probe, False)
        except Exception:  # a template that cannot render the tool role raises (TemplateError, TypeError)
            return False

    def _check(self) -> str:
        """Why the template cannot be used (empty: it can): the probe conversation (module docstring) built as a
        rollout builds it must equal its whole rendering, as text and as ids."""
        try:
            head = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": SENTINEL}], False)
        except Exception as e:  # any template failure becomes the reason, reported with the template's name
            return f"rendering a [user, assistant] conversation failed ({type(e).__name__}: {e})"
        if head.count(SENTINEL) != 1:
            return "an assistant message's content does not appear once, verbatim, in the rendering"
        self.end_of_turn = head[head.index(SENTINEL) + len(SENTINEL):]
        if not self.end_of_turn:
            return "an assistant turn renders with no end-of-turn text after its content"
        tools = self._renders_tool_messages()
        if self.tools and not tools:
            return "it does not render tool messages (role 'tool'), and tools were given"
        observation = ([{"role": "tool", "name": "lookup", "content": "result one"}] if tools
                       else [{"role": "user", "content": "observation one"}])
        system = [{"role": "system", "content": "You are a careful assistant."}]
        messages = [*system, {"role": "user", "content": "What is the first question?"}]
        turns = [("<think>\nfirst reasoning\n</think>\n\nfirst answer", observation),
                 ("second answer", [{"role": "user", "content": "What is the third question?"}]),
                 ("<think>\nthird reasoning\n</think>\n\nthird answer", observation)]
        eos = self.tok.eos_token_id
        eos_text = self.tok.decode([eos]) if eos is not None else None
        ends_with_eos = bool(eos_text) and self.end_of_turn.startswith(eos_text)
        try:
            text = self.render(messages, True)
            ids = self.ids(text)
            for content, new in turns:
                messages = [*messages, {"role": "assistant", "content": content}]
                end = eos if ends_with_eos else None
                text += content + (eos_text if ends_with_eos else "")
                ids += self.ids(content) + ([eos] if ends_with_eos else [])
                suffix = self._suffix_text(messages, new, end)
                text += suffix
                ids += self.ids(suffix)
                messages = [*messages, *new]
            whole = self.render(messages, True)
        except ValueError as e:
            return str(e)
        except Exception as e:  # any template failure becomes the reason, reported with the template's name
            return f"rendering the probe conversation failed ({type(e).__name__}: {e})"
        if text != whole:
            at = first_difference(text, whole)
            return (f"the conversation built turn by turn differs from its rendering at character {at} "
                    f"({text[at:at + 40]!r} against {whole[at:at + 40]!r})")
        if ids != self.ids(whole):
            return "the turn boundaries do not fall on token boundaries (the suffix tokenised alone differs)"
        return ""
