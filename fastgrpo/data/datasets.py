"""Prompt datasets with verifiable answers: JSONL, JSON, Parquet, Hugging Face ``datasets``, and a built-in task.

Files: ``.jsonl`` (one JSON object per line), ``.json`` (the same, or one top-level array of objects), ``.parquet``.
Every row needs ``data.prompt_field`` (a non-empty string) and ``data.answer_field`` (a string or a number); a row
without them is an error naming the row and the field. A row whose answer is empty or null is dropped and counted
(DeepScaleR-Preview has a few: no answer, no reward to learn from). The DeepScaleR recipe reads the public
DeepScaleR-Preview training set (fields ``problem``, ``answer``, ``solution``) and AIME 2024 (``problem``,
``answer``, plus ``id``/``solution``/``url``/``year`` in HuggingFaceH4/aime_2024); samples of both formats are
``tests/data/deepscaler_sample.jsonl`` and ``tests/data/aime24_sample.jsonl``, and the README's "Reproducing
DeepScaleR" gives the download commands.

Every source becomes a :class:`PromptDataset`: rows (dicts holding at least ``prompt``, the question as given,
and ``answer``, the ground truth as a string, plus every other column of the source, handed to reward functions
as keyword arguments) and their tokenised prompts. A question becomes a prompt by
``data.prompt_template.format(prompt=question)``, then the tokenizer's chat template (with ``data.system_prompt``
as a system message when set) when the tokenizer has one and ``data.use_chat_template`` is on.

The built-in task ``add``: ``"3+7+2="`` → ``\\boxed{12}``, every combination of ``data.synthetic_num_terms``
numbers in ``[0, data.synthetic_max_value]``, split once with a fixed seed into a held-out set of
``data.synthetic_eval_size`` questions and a disjoint training set. The built-in task ``sliding_puzzle`` (GRPO with
``env.environment_factory: sliding_puzzle``): rows of reset arguments for the game, drawn as NeMo-RL's
``examples/run_grpo_sliding_puzzle.py`` draws its boards (a side in ``2..data.puzzle_size``, an odd number of
shuffle moves up to ``data.puzzle_shuffle_moves``, a walk that may undo a move, any board but the solved one), with
one seed per row (``data.synthetic_train_size`` training rows, then ``synthetic_eval_size`` held-out seeds; a small
board can repeat across them: a 2×2 board has 12 states). ``prompt`` is :data:`PUZZLE_PROMPT` (the environment's
reset appends the rules and the board), ``answer`` the solved board.

:class:`PromptSampler` walks the training set in a deterministic shuffled order per epoch; its position (epoch,
index) is what a checkpoint saves, so a resumed run sees the same prompts as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastgrpo.config import DataConfig

SYNTHETIC = "synthetic"
SYNTHETIC_SPLIT_SEED = 1234  # fixed: the held-out split never changes with train.seed
PUZZLE_PROMPT = "Think carefully step by step before each move.\n"  # NeMo-RL's prompt ends its rules with this


@dataclass
class PromptDataset:
    """Rows with ``prompt``/``answer`` (+ extra columns) and their prompt token ids."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    num_dropped: int = 0
    """Prompts dropped for being longer than data.max_prompt_tokens."""
    num_no_answer: int = 0
    """Rows dropped for an empty or null answer."""
    source: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    def columns(self, indices: list[int]) -> dict[str, list]:
        """Column-wise view of ``rows[indices]`` (the reward functions' keyword arguments), without ``prompt``."""
        keys = [k for k in self.rows[indices[0]] if k != "prompt"] if indices else []
        return {k: [self.rows[i].get(k) for i in indices] for k in keys}


@dataclass
class PromptSampler:
    """Deterministic epoch-wise shuffled order over ``n`` items; ``state_dict`` is the data position."""

    n: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    index: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError("the training dataset is empty (after dropping long prompts)")
        self._order = self._make_order(self.epoch)

    def _make_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        """The next ``k`` indices, crossing into the next epoch (a new order) when the current one runs out."""
        out = []
        while len(out) < k:
            if self.index >= self.n:
                self.epoch += 1
                self.index = 0
                self._order = self._make_order(self.epoch)
            take = min(k - len(out), self.n - self.index)
            out.extend(self._order[self.index : self.index + take])
            self.index += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._make_order(self.epoch)


# ---------------------------------------------------------------------------------------------- sources


def puzzle_rows(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows of the ``sliding_puzzle`` task: each one the :class:`SlidingPuzzle` reset
    arguments of one board (fixed by SYNTHETIC_SPLIT_SEED and the row's seed)."""
    from fastgrpo.environments.sliding_puzzle import render, solved

    rng = random.Random(SYNTHETIC_SPLIT_SEED)
    rows = []
    for seed in range(cfg.synthetic_eval_size + cfg.synthetic_train_size):
        size, shuffle_moves = rng.randint(2, cfg.puzzle_size), rng.randint(1, cfg.puzzle_shuffle_moves)
        shuffle_moves += shuffle_moves % 2 == 0  # odd: the walk never ends on the solved board
        rows.append({"prompt": PUZZLE_PROMPT, "answer": render(solved(size), size), "seed": seed, "size": size,
                     "shuffle_moves": shuffle_moves, "min_moves": 1, "max_moves": cfg.puzzle_max_moves,
                     "backtrack": True})
    return rows[cfg.synthetic_eval_size :], rows[: cfg.synthetic_eval_size]


def synthetic_rows(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows of the built-in task (disjoint; the split is fixed by SYNTHETIC_SPLIT_SEED)."""
    if cfg.synthetic_task == "sliding_puzzle":
        return puzzle_rows(cfg)
    values = range(cfg.synthetic_max_value + 1)
    combos = list(itertools.product(values, repeat=cfg.synthetic_num_terms))
    if len(combos) < 2 * cfg.synthetic_eval_size:
        raise ValueError(f"data.synthetic_eval_size={cfg.synthetic_eval_size} leaves too few training questions: "
                         f"the task has only {len(combos)} (raise data.synthetic_num_terms or synthetic_max_value)")
    random.Random(SYNTHETIC_SPLIT_SEED).shuffle(combos)
    rows = [{"prompt": "+".join(map(str, c)) + "=", "answer": str(sum(c))} for c in combos]
    return rows[cfg.synthetic_eval_size :], rows[: cfg.synthetic_eval_size]


def _check_fields(rows: list[dict], cfg: DataConfig, source: str) -> list[dict]:
    if not rows:
        raise ValueError(f"data source {source} holds no rows")
    out = []
    for i, row in enumerate(rows):
        for name, key in (("data.prompt_field", cfg.prompt_field), ("data.answer_field", cfg.answer_field)):
            if key not in row:
                raise ValueError(f"{source}: row {i} has no field {key!r} ({name}); its fields are {sorted(row)}")
        prompt, answer = row[cfg.prompt_field], row[cfg.answer_field]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{source}: row {i} field {cfg.prompt_field!r} (data.prompt_field) must be a non-empty "
                             f"string, got {prompt!r}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float, type(None))):
            raise ValueError(f"{source}: row {i} field {cfg.answer_field!r} (data.answer_field) must be a string or a "
                             f"number, got {answer!r}")
        extra = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.answer_field)}
        out.append({**extra, "prompt": prompt, "answer": "" if answer is None else str(answer).strip()})
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file, or of a ``.json`` file holding one array of objects."""
    if path.suffix == ".json":
        with open(path) as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            try:
                rows = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ValueError(f"{path}: array item {bad} must be a JSON object, got {type(rows[bad]).__name__}")
            return rows
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i + 1} must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
                         "(or convert the file to JSONL)") from None
    return pq.read_table(path).to_pylist()


def read_hf_dataset(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data path {name!r} is not a file; loading it as a Hugging Face dataset needs the "
                         "datasets package, which is not installed (pip install datasets)") from None
    return [dict(r) for r in datasets.load_dataset(name, split=split)]


def read_source(path: str, split: str, field: str = "data.path") -> tuple[list[dict], str]:
    """``(rows, source name)`` of a .jsonl / .parquet file or a Hugging Face dataset name, as read.
    ``field``: the config field that named ``path`` (for the error messages)."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json", ".parquet") or p.exists() or "/" in path and p.parent.exists():
        if not p.is_file():
            raise ValueError(f"{field}: data file {path!r} does not exist")
        return (read_parquet(p) if p.suffix == ".parquet" else read_jsonl(p)), str(p)
    return read_hf_dataset(path, split), f"dataset {path!r} ({split})"


def read_rows(path: str, split: str, cfg: DataConfig, field: str = "data.path") -> list[dict]:
    """Rows of a .jsonl / .parquet file or a Hugging Face dataset name, with the prompt/answer fields checked.
    ``field``: the config field that named ``path`` (for the error messages)."""
    rows, source = read_source(path, split, field)
    return _check_fields(rows, cfg, source)


# ---------------------------------------------------------------------------------------------- tokenising


def prompt_messages(question: str, cfg: DataConfig) -> list[dict]:
    """The prompt as messages: ``data.system_prompt`` (when set) and the question in ``data.prompt_template``."""
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": cfg.prompt_template.format(prompt=question)})
    return messages


def format_prompt(question: str, tokenizer, cfg: DataConfig) -> str:
    """The prompt text: the template, then the chat template (with the system prompt) when there is one."""
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt_messages(question, cfg), tokenize=False,
                                             add_generation_prompt=True)
    text = cfg.prompt_template.format(prompt=question)
    if cfg.system_prompt:
        return f"{cfg.system_prompt}\n{text}"
    return text


def build_dataset(rows: list[dict], tokenizer, cfg: DataConfig, source: str) -> PromptDataset:
    """Tokenise every prompt; prompts over ``data.max_prompt_tokens`` are dropped and counted, or raise; rows
    without an answer are dropped and counted."""
    kept_rows, kept_ids, dropped, no_answer = [], [], 0, 0
    for i, row in enumerate(rows):
        if not row["answer"]:
            no_answer += 1
            continue
        ids = tokenizer(format_prompt(row["prompt"], tokenizer, cfg), add_special_tokens=False)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            if not cfg.drop_long_prompts:
                raise ValueError(f"{source}: prompt {i} has {len(ids)} tokens, more than data.max_prompt_tokens="
                                 f"{cfg.max_prompt_tokens} (raise it, or set data.drop_long_prompts=true)")
            dropped += 1
            continue
        if not ids:
            raise ValueError(f"{source}: prompt {i} is empty after tokenisation")
        kept_rows.append(row)
        kept_ids.append(ids)
    return PromptDataset(rows=kept_rows, prompt_ids=kept_ids, num_dropped=dropped, num_no_answer=no_answer,
                         source=source)


def load_datasets(cfg: DataConfig, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    """``(train, validation)``; validation is the synthetic held-out split, ``data.eval_path``, or None."""
    if cfg.path == SYNTHETIC:
        train_rows, eval_rows = synthetic_rows(cfg)
        train = build_dataset(train_rows, tokenizer, cfg, "synthetic train")
        held_out = build_dataset(eval_rows, tokenizer, cfg, "synthetic held-out")
    else:
        train = build_dataset(read_rows(cfg.path, cfg.split, cfg), tokenizer, cfg, cfg.path)
        held_out = None
    if cfg.eval_path:
        eval_rows = read_rows(cfg.eval_path, cfg.eval_split, cfg, "data.eval_path")
        held_out = build_dataset(eval_rows, tokenizer, cfg, cfg.eval_path)
    if len(train) == 0:
        raise ValueError(f"{train.source}: every prompt is longer than data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return train, held_out


def sft_completion(answer: str) -> str:
    """The reference completion of the supervised warm-up: the answer in ``\\boxed{}``."""
    return f"\\boxed{{{answer}}}"


# ---------------------------------------------------------------------------------------------- tool-tiny
#
# The tool-tiny demo's data: the built-in task's questions and answers (synthetic_rows: "37+85=" -> 122 with
# data.synthetic_num_terms 2 and data.synthetic_max_value 99, too hard for the tiny model to add alone), answered by
# calling the adder tool ``add(a, b)`` and reading its result. A demonstration calls ``add`` once per "+" (``a``: the
# running sum, ``b``: the next term), then gives the last result in \boxed{}. The supervised warm-up trains on whole
# demonstrations built exactly as a rollout builds the trajectory (fastgrpo.environments.chat: the prompt's ids, the
# assistant's
# tokens, the template suffixes), so it trains the very token sequences GRPO then samples and scores.

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
    messages, then
    assistant turns (content and/or ``tool_calls``) each followed by the messages the environment answers with
    (tool results, user messages), ending with an assistant turn. The sequence is ``template.prompt_ids`` of the
    prompt, then per assistant turn its text's tokens and the EOS that ends the turn (when the template's end of turn
    starts with the EOS, as Qwen's and the tiny model's do; always after the last turn), then ``template.suffix_ids``
    of what follows. The mask is True on the assistant turns' tokens and their EOS, False on the prompt, the tool
    results and every template token between turns: exactly the mask the rollout gives the sampled tokens.
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
    """The tool-tiny supervised warm-up, in the shape ``GRPO.warmup_examples`` returns for ``fastgrpo.algorithms.sft.
    sft_warmup``: each row's demonstration (:func:`conversation_example` of :func:`tool_tiny_conversation`), and
    each row's answer given directly (``\\boxed{}`` and EOS, no tool call), the responses that ``sft.answer_noise``
    swaps in after the prompt: a warmed-up policy then sometimes answers without the tool, mostly wrongly."""
    examples = [conversation_example(template, tool_tiny_conversation(r, cfg)) for r in rows]
    eos = template.tok.eos_token_id
    responses = [template.ids(sft_completion(r["answer"])) + [eos] for r in rows]
    return examples, responses


# ---------------------------------------------------------------------------------------------- preference / SFT rows
#
# Preference rows (algorithm dpo), one of:
#   TRL, explicit prompt:  {"prompt": P, "chosen": R, "rejected": R}      P: a string or a list of messages
#   TRL, implicit prompt:  {"chosen": C, "rejected": C}                   C: whole conversations (message lists) or
#                          strings; the prompt is their longest common prefix (strings: cut back to a whitespace)
#   NeMo-RL:               {"context": P, "completions": [{"rank": 0, "completion": R}, {"rank": 1, ...}, ...]}
#                          the lowest rank is chosen, the highest rejected (a tie between them is a bad row)
# R: a string, or a list of messages (the assistant turns that answer the prompt).
# SFT rows (algorithm sft): {"messages": [...]} (the loss covers the assistant turns only) or
#   {"prompt": P, "completion": R} (the loss covers the completion).
# A message is {"role": str, "content": str}. String prompts become prompt text exactly as GRPO's do
# (data.prompt_template, then the chat template with data.system_prompt); conversations go through the chat
# template. A response (or the conversation's last assistant turn) ends with the EOS token: appended when its
# tokens hold none.


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
    return PreferencePair(p, c, r)


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


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer``: ±1 or ±2, never negative (the synthetic DPO task's rejected answer)."""
    value = int(answer)
    d = rng.choice((-2, -1, 1, 2))
    return str(value - d if value + d < 0 else value + d)


def synthetic_response_rows(cfg: DataConfig, algorithm: str) -> tuple[list[dict], list[dict]]:
    """The built-in task as preference rows (chosen: the answer in ``\\boxed{}``, rejected: a near miss, fixed by
    SYNTHETIC_SPLIT_SEED) or SFT prompt/completion rows; ``(train, held_out)``, the GRPO task's split."""
    if cfg.synthetic_task != "add":
        raise ValueError(f"data.synthetic_task: {algorithm} has only the 'add' task, got {cfg.synthetic_task!r}")
    out = []
    for rows in synthetic_rows(cfg):
        rng = random.Random(SYNTHETIC_SPLIT_SEED)
        if algorithm == "dpo":
            out.append([{"prompt": r["prompt"], "chosen": sft_completion(r["answer"]),
                         "rejected": sft_completion(near_miss(r["answer"], rng)), "answer": r["answer"]}
                        for r in rows])
        else:
            out.append([{"prompt": r["prompt"], "completion": sft_completion(r["answer"]), "answer": r["answer"]}
                        for r in rows])
    return out[0], out[1]


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
