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

The built-in task (``data.path: synthetic``, :mod:`fastgrpo.data.synthetic`) gives its rows and held-out split.

:class:`PromptSampler` walks the training set in a deterministic shuffled order per epoch; its position (epoch,
index) is what a checkpoint saves, so a resumed run sees the same prompts as an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastgrpo.config import DataConfig
from fastgrpo.data.images import IMAGE_COLUMNS, vlm_prompt
from fastgrpo.data.synthetic import SYNTHETIC, synthetic_rows


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
        keys = [k for k in self.rows[indices[0]] if k != "prompt" and k not in IMAGE_COLUMNS] if indices else []
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


def _check_fields(rows: list[dict], cfg: DataConfig, source: str) -> list[dict]:
    if not rows:
        raise ValueError(f"data source {source} holds no rows")
    out = []
    for i, row in enumerate(rows):
        for name, key in (("data.prompt_field", cfg.prompt_field), ("data.answer_field", cfg.answer_field)):
            if key not in row:
                raise ValueError(f"{source}: row {i} has no field {key!r} ({name}); its fields are {sorted(row)}")
        prompt, answer = row[cfg.prompt_field], row[cfg.answer_field]
        conversation = isinstance(prompt, list) and any(k in row for k in IMAGE_COLUMNS)  # TRL's VLM rows
        if not conversation and (not isinstance(prompt, str) or not prompt.strip()):
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
    without an answer are dropped and counted. A vision-language model's tokenizer carries its processor
    (``tokenizer.processor``): each prompt is then rendered with its images (``fastgrpo.data.images``)."""
    kept_rows, kept_ids, dropped, no_answer = [], [], 0, 0
    processor = getattr(tokenizer, "processor", None)
    base = Path(source).parent if Path(source).is_file() else None  # relative image paths: the data file's folder
    for i, row in enumerate(rows):
        if not row["answer"]:
            no_answer += 1
            continue
        if processor is not None:
            ids = vlm_prompt(row, i, processor, cfg, source, base)
        else:
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
