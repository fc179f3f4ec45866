"""Datasets whose rows carry the response: preference pairs (algorithm dpo) and supervised examples (algorithm sft).

Preference rows, one of::

    TRL, explicit prompt:  {"prompt": P, "chosen": R, "rejected": R}      P: a string or a list of messages
    TRL, implicit prompt:  {"chosen": C, "rejected": C}                   C: whole conversations (message lists) or
                           strings; the prompt is their longest common prefix (strings: cut back to a whitespace)
    NeMo-RL:               {"context": P, "completions": [{"rank": 0, "completion": R}, {"rank": 1, ...}, ...]}
                           the lowest rank is chosen, the highest rejected (a tie between them is a bad row)

A preference row may also hold ``margin``, a number (TRL's RewardTrainer column: how far the chosen reward must
lead the rejected one in algorithm rm's loss; 0 without it). R: a string, or a list of messages (the assistant turns
that answer the prompt). SFT rows: ``{"messages": [...]}``
(the loss covers the assistant turns only) or ``{"prompt": P, "completion": R}`` (the loss covers the completion).
A message is ``{"role": str, "content": str}``. String prompts become prompt text exactly as GRPO's do
(``data.prompt_template``, then the chat template with ``data.system_prompt``:
:func:`fastgrpo.data.prompts.format_prompt`); conversations go through the chat template. A response (or the
conversation's last assistant turn) ends with the EOS token: appended when its tokens hold none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastgrpo.config import DataConfig
from fastgrpo.data.prompts import PromptDataset, build_dataset, format_prompt, read_source
from fastgrpo.data.synthetic import SYNTHETIC, synthetic_response_rows, synthetic_rows


class BadRow(ValueError):
    """A row that cannot be used; ``field`` names the offending field, ``reason`` the kind (for the counts)."""

    def __init__(self, field: str, message: str, reason: str):
        super().__init__(message)
        self.field = field
        self.reason = reason


@dataclass
class PreferencePair:
    """One tokenised preference pair: the prompt and the two responses (without the prompt)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0
    """The row's optional ``margin`` column (TRL's RewardTrainer: how far the chosen reward must lead; algorithm rm)."""


@dataclass
class SFTExample:
    """One tokenised SFT sequence and the per-token loss mask (True: the token is trained on)."""

    input_ids: list[int]
    loss_mask: list[bool]


@dataclass
class RowDataset:
    """Tokenised preference pairs or SFT examples, and the rows skipped, counted per reason."""

    items: list
    source: str
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    def describe(self) -> str:
        """``"N <kind>"`` plus the skipped rows by reason, for the start-up line."""
        if not self.skipped:
            return ""
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return f" ({sum(self.skipped.values())} rows skipped: {reasons})"


def _messages(value, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow(name, f"field {name!r} must be a non-empty list of messages", "malformed")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRow(name, f"field {name!r}: message {i} must be {{'role': str, 'content': str}}", "malformed")
    return value


def _text_or_messages(row: dict, name: str):
    if name not in row or row[name] is None:
        raise BadRow(name, f"field {name!r} is missing", f"missing {name}")
    value = row[name]
    if isinstance(value, str):
        if not value:
            raise BadRow(name, f"field {name!r} is empty", f"empty {name}")
        return value
    return _messages(value, name)


def _common_prompt(chosen, rejected):
    """TRL's implicit prompt: the longest shared prefix of the two conversations (or strings, cut back to the
    last whitespace so that no word is split); returns ``(prompt, chosen rest, rejected rest)``."""
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise BadRow("rejected", "fields 'chosen' and 'rejected' must both be strings or both message lists",
                     "malformed")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str):
        while n > 0 and not chosen[n - 1].isspace():
            n -= 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise BadRow("prompt", "no field 'prompt', and 'chosen' / 'rejected' share no prompt followed by two "
                     "responses (an implicit prompt is their common beginning)", "no shared prompt")
    return chosen[:n], chosen[n:], rejected[n:]


def preference_fields(row: dict):
    """``(prompt, chosen, rejected)`` of a preference row in any supported format (strings or message lists)."""
    if "context" in row or "completions" in row:  # NeMo-RL
        prompt = _text_or_messages(row, "context")
        comps = row.get("completions")
        if not isinstance(comps, list) or len(comps) < 2:
            raise BadRow("completions", "field 'completions' must list at least two {rank, completion}",
                         "missing completions")
        for i, c in enumerate(comps):
            if not (isinstance(c, dict) and isinstance(c.get("rank"), (int, float)) and "completion" in c):
                raise BadRow("completions", f"completions[{i}] must be {{'rank': number, 'completion': ...}}",
                             "malformed")
        ranked = sorted(comps, key=lambda c: c["rank"])
        if ranked[0]["rank"] == ranked[1]["rank"]:
            raise BadRow("completions", "the two best completions have the same rank", "tied ranks")
        best, worst = ranked[0], ranked[-1]
        return (prompt, _text_or_messages(best, "completion"), _text_or_messages(worst, "completion"))
    chosen, rejected = _text_or_messages(row, "chosen"), _text_or_messages(row, "rejected")
    if "prompt" in row:
        return _text_or_messages(row, "prompt"), chosen, rejected
    return _common_prompt(chosen, rejected)


class Renderer:
    """Prompt and response texts → token ids, with the chat template where there are messages."""

    def __init__(self, tokenizer, cfg: DataConfig):
        self.tok = tokenizer
        self.cfg = cfg
        self.eos = tokenizer.eos_token_id
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _template(self, messages: list[dict], generation_prompt: bool, name: str) -> str:
        if not self.has_template:
            raise BadRow(name, f"field {name!r} holds messages, but the tokenizer has no chat template",
                         "messages without a chat template")
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _turn_start(self, messages: list[dict], k: int) -> int:
        """Where assistant turn ``k``'s content starts in the rendering: after the rendering of the messages before
        it with the generation prompt; for a first message (nothing before it to render), where a placeholder
        content lands in the rendering of that turn alone."""
        if k:
            return len(self._template(messages[:k], True, "messages"))
        probe = self._template([{"role": "assistant", "content": "\x00"}], False, "messages")
        return max(probe.find("\x00"), 0)

    def with_eos(self, ids: list[int]) -> list[int]:
        return ids if self.eos in ids else ids + [self.eos]

    def prompt(self, prompt, name: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self.ids(format_prompt(prompt, self.tok, self.cfg))
        return self.ids(self._template(prompt, True, name))

    def response(self, prompt, response, name: str) -> list[int]:
        """The response's ids after ``prompt``: a string as is; messages as the chat template renders them after
        the prompt's (which must be a prefix of the whole conversation's rendering)."""
        if isinstance(response, str) or isinstance(prompt, str):
            if not isinstance(response, str):
                if len(response) != 1 or response[0]["role"] != "assistant":
                    raise BadRow(name, f"field {name!r}: after a string prompt the response must be a string or "
                                 "one assistant message", "malformed")
                response = response[0]["content"]
            return self.with_eos(self.ids(response))
        head = self._template(prompt, True, name)
        whole = self._template(prompt + response, False, name)
        if not whole.startswith(head):
            raise BadRow(name, f"field {name!r}: the chat template does not render the prompt as a prefix of the "
                         "conversation", "template mismatch")
        return self.with_eos(self.ids(whole[len(head) :]))

    def conversation(self, messages: list[dict]) -> SFTExample:
        """A whole conversation's ids and a mask over the assistant turns: the text is cut where each assistant
        turn starts (the rendering of the messages before it, with the generation prompt) and ends (the
        rendering up to it), and each piece is tokenised on its own."""
        whole = self._template(messages, False, "messages")
        pieces, cursor = [], 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._turn_start(messages, k)
            end_text = self._template(messages[: k + 1], False, "messages")
            if start < cursor or not whole.startswith(end_text) or len(end_text) < start:
                raise BadRow("messages", f"field 'messages': the chat template renders assistant turn {k} "
                             "differently inside the conversation", "template mismatch")
            pieces += [(whole[cursor:start], False), (whole[start : len(end_text)], True)]
            cursor = len(end_text)
        if not pieces:
            raise BadRow("messages", "field 'messages' has no assistant turn to train on", "no assistant turn")
        pieces.append((whole[cursor:], False))
        ids, mask, last = [], [], (0, 0)
        for text, trained in pieces:
            piece = self.ids(text)
            if trained:
                last = (len(ids), len(ids) + len(piece))  # the last assistant turn's tokens
            ids += piece
            mask += [trained] * len(piece)
        if self.eos not in ids[last[0] : last[1]]:
            ids.insert(last[1], self.eos)
            mask.insert(last[1], True)
        return SFTExample(ids, mask)


def _fit(prompt_ids: list[int], responses: list[list[int]], cfg: DataConfig) -> list[list[int]]:
    """The length rule: a prompt over data.max_prompt_tokens is too long; prompt + response over data.max_length
    is too long ("drop") or the response keeps its first max_length − len(prompt) tokens ("truncate")."""
    if len(prompt_ids) > cfg.max_prompt_tokens:
        raise BadRow("prompt", f"the prompt has {len(prompt_ids)} tokens, more than data.max_prompt_tokens="
                     f"{cfg.max_prompt_tokens}", "too long")
    room = cfg.max_length - len(prompt_ids)
    if any(len(r) > room for r in responses):
        if cfg.truncation == "drop" or room < 1:
            raise BadRow("prompt", f"prompt + response exceed data.max_length={cfg.max_length} tokens "
                         "(data.truncation=drop)", "too long")
        responses = [r[:room] for r in responses]
    return responses


def preference_pair(row: dict, renderer: Renderer, cfg: DataConfig) -> PreferencePair:
    """One row → :class:`PreferencePair` (raises :class:`BadRow`)."""
    prompt, chosen, rejected = preference_fields(row)
    p = renderer.prompt(prompt, "context" if "context" in row else "prompt")
    c, r = renderer.response(prompt, chosen, "chosen"), renderer.response(prompt, rejected, "rejected")
    if c == r:
        raise BadRow("rejected", "'chosen' and 'rejected' are the same response", "chosen == rejected")
    if not p:
        raise BadRow("prompt", "the prompt is empty after tokenisation", "empty prompt")
    c, r = _fit(p, [c, r], cfg)
    if c == r:
        raise BadRow("rejected", f"'chosen' and 'rejected' are the same once truncated to data.max_length="
                     f"{cfg.max_length}", "chosen == rejected")
    margin = row.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise BadRow("margin", f"'margin' must be a finite number, got {margin!r}", "bad margin")
    return PreferencePair(p, c, r, float(margin))


def sft_example(row: dict, renderer: Renderer, cfg: DataConfig) -> SFTExample:
    """One row → :class:`SFTExample` (raises :class:`BadRow`)."""
    if "messages" in row:
        ex = renderer.conversation(_messages(row["messages"], "messages"))
        if len(ex.input_ids) > cfg.max_length:
            if cfg.truncation == "drop" or not any(ex.loss_mask[: cfg.max_length]):
                raise BadRow("messages", f"the conversation has {len(ex.input_ids)} tokens, more than "
                             f"data.max_length={cfg.max_length}", "too long")
            ex = SFTExample(ex.input_ids[: cfg.max_length], ex.loss_mask[: cfg.max_length])
        return ex
    prompt, completion = _text_or_messages(row, "prompt"), _text_or_messages(row, "completion")
    p = renderer.prompt(prompt)
    if not p:
        raise BadRow("prompt", "the prompt is empty after tokenisation", "empty prompt")
    (c,) = _fit(p, [renderer.response(prompt, completion, "completion")], cfg)
    return SFTExample(p + c, [False] * len(p) + [True] * len(c))


def build_rows(rows: list[dict], make, tokenizer, cfg: DataConfig, source: str) -> RowDataset:
    """Tokenise every row with ``make`` (:func:`preference_pair` or :func:`sft_example`). A bad row is skipped and
    counted (``data.skip_bad_rows``), or raises ``ValueError`` naming the source, the row and the field."""
    renderer = Renderer(tokenizer, cfg)
    out = RowDataset([], source)
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise BadRow("", "a row must be a mapping of fields", "malformed")
            out.items.append(make(row, renderer, cfg))
        except BadRow as e:
            if not cfg.skip_bad_rows:
                raise ValueError(f"{source}: row {i}: {e} (data.skip_bad_rows=true skips and counts such rows)"
                                 ) from None
            out.skipped[e.reason] = out.skipped.get(e.reason, 0) + 1
    if not out.items:
        raise ValueError(f"{source}: no usable row{out.describe()}")
    return out


def load_response_datasets(cfg: DataConfig, tokenizer, algorithm: str
                           ) -> tuple[RowDataset, RowDataset | None, PromptDataset | None]:
    """``(train, held-out, held-out prompts)`` for ``algorithm`` dpo (preference pairs) or sft (examples). The
    held-out rows come from the synthetic task's split or ``data.eval_path``; held-out prompts (the synthetic
    task's, for avg@k) only from the synthetic task."""
    make = preference_pair if algorithm == "dpo" else sft_example
    prompts = None
    if cfg.path == SYNTHETIC:
        train_rows, eval_rows = synthetic_response_rows(cfg, algorithm)
        train = build_rows(train_rows, make, tokenizer, cfg, "synthetic train")
        held_out = build_rows(eval_rows, make, tokenizer, cfg, "synthetic held-out")
        prompts = build_dataset(synthetic_rows(cfg)[1], tokenizer, cfg, "synthetic held-out")
    else:
        rows, source = read_source(cfg.path, cfg.split)
        train, held_out = build_rows(rows, make, tokenizer, cfg, source), None
    if cfg.eval_path:
        rows, source = read_source(cfg.eval_path, cfg.eval_split, "data.eval_path")
        held_out = build_rows(rows, make, tokenizer, cfg, source)
    return train, held_out, prompts
