"""The completion log of GRPO's rollouts: per step, one JSON object per completion of the batch (masked ones too), in
``<run dir>/rollouts/step_<N>.jsonl``, and an optional table of a few completions on the console.

``N`` is the step as ``metrics.jsonl`` logs it (the trainer's completed steps + 1), 8 digits. One process writes
``step_<N>.jsonl``; with several, each rank writes its own groups to ``step_<N>.rank<R>.jsonl`` (no collective in
the step, no rank waits on another's file system; ``python -m fastgrpo.rollouts`` reads them back as one step).
A file is written to ``<name>.tmp`` and renamed, so a reader never sees half of one; ``logging.rollouts_keep``
bounds the files a rank keeps (its oldest steps deleted first).

A row's fields: ``step``, ``group`` (the group's position among the step's trained groups, all ranks together:
rank r's groups follow rank r-1's), ``sample`` (its index in the group), ``prompt`` and ``completion`` (decoded
with the special tokens, so stop tokens show), ``prompt_tokens``, ``completion_tokens``, ``finish_reason``,
``turns`` and ``tool_calls`` (multi-turn only), ``rewards`` (each reward function's and reward model's raw score,
under its metric name, and ``env``: the environment's reward, multi-turn), ``reward`` (after ``reward_scaling`` and
``reward_shaping``: what the advantage is computed from), ``advantage`` (GRPO's; distillation rescales it by
``distill.reward_weight`` afterwards) and ``trained`` (false: the completion gets no loss,
``grpo.mask_truncated_completions`` / ``mask_zero_std_groups``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fastgrpo.algorithms.batch import Group, Sample
from fastgrpo.config import LoggingConfig
from fastgrpo.distributed import print0

STEP_FILE = re.compile(r"^step_(\d+)(?:\.rank(\d+))?\.jsonl$")
"""A step file's name: its step and (several processes) its rank."""
TEXT_CHARS = 200  # a completion's characters in a table row, then an ellipsis


@dataclass
class ScoredGroup(Group):
    """A :class:`Group` with what the rollout log shows of each completion beyond it (it travels with the group
    when dynamic sampling moves groups between ranks)."""

    scores: list[dict[str, float]] = field(default_factory=list)
    """[G] reward function or reward model name (and ``env``, multi-turn) -> the completion's raw score."""
    tool_calls: list[int] | None = None
    """[G] tool calls of each trajectory (multi-turn; None: single-turn)."""


def with_scores(groups: list[Group], per_function: dict[str, list[float]], trajectories=None) -> list[ScoredGroup]:
    """``groups`` (prompt-major, G completions each) with each completion's scores: ``per_function`` (name -> one
    score per completion, in the groups' order) and, multi-turn, ``trajectories`` ((group, sample) -> its
    ``Trajectory``: the environment's reward and the tool calls)."""
    out, i = [], 0
    for p, grp in enumerate(groups):
        scores, calls = [], []
        for j in range(len(grp.completions)):
            s = {name: float(v[i]) for name, v in per_function.items()}
            if trajectories is not None:
                s["env"] = float(trajectories[(p, j)].reward)
                calls.append(int(trajectories[(p, j)].tool_calls))
            scores.append(s)
            i += 1
        out.append(ScoredGroup(grp.prompt_ids, grp.completions, grp.rewards, grp.signal, scores,
                               calls if trajectories is not None else None))
    return out


def step_file_name(step: int, rank: int, world_size: int) -> str:
    return f"step_{step:08d}.jsonl" if world_size == 1 else f"step_{step:08d}.rank{rank}.jsonl"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines at ``path``, written to ``path.tmp`` and renamed (a reader sees all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def prune(directory: Path, keep: int, rank: int | None) -> list[Path]:
    """Delete all but the ``keep`` latest steps' files of ``rank`` (None: the single-process files) in
    ``directory``; returns the deleted paths, oldest step first."""
    mine = []
    for path in directory.iterdir():
        m = STEP_FILE.match(path.name)
        if m and (None if m.group(2) is None else int(m.group(2))) == rank:
            mine.append((int(m.group(1)), path))
    mine.sort()
    old = [path for _, path in mine[: max(len(mine) - keep, 0)]] if keep else []
    for path in old:
        path.unlink(missing_ok=True)
    return old


def one_line(text: str, limit: int = TEXT_CHARS) -> str:
    """``text`` on one line (each line break as ``↵``, a tab as a space), cut to ``limit`` characters with an
    ellipsis."""
    text = text.replace("\r\n", "↵").replace("\n", "↵").replace("\r", "↵").replace("\t", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_table(rows: list[dict], limit: int = TEXT_CHARS) -> str:
    """``rows`` (rollout log rows, or the eval's sample rows, which have no advantage: ``-``) as a plain-text table:
    step, group, sample, reward, advantage, finish reason, completion tokens and the completion on one line, cut to
    ``limit`` characters."""
    lines = [f"{'step':>6} {'group':>5} {'sample':>6} {'reward':>8} {'advantage':>9} {'finish':<9} {'tokens':>6}"
             "  completion"]
    for r in rows:
        lines.append(f"{r['step']:>6} {r['group']:>5} {r['sample']:>6} {r['reward']:>8.3f} "
                     f"{'-' if r.get('advantage') is None else format(r['advantage'], '.3f'):>9} "
                     f"{r['finish_reason']:<9} {r['completion_tokens']:>6}  {one_line(r['completion'], limit)}")
    return "\n".join(lines)


class RolloutLog:
    """Writes a GRPO step's rollout rows (``logging.log_rollouts``, ``logging.rollouts_keep``) and prints the first
    ``logging.completions_to_print`` of them on rank 0."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, tokenizer, rank: int, world_size: int):
        self.cfg, self.tokenizer, self.rank, self.world_size = cfg, tokenizer, rank, world_size
        self.directory = Path(run_dir) / "rollouts"

    @property
    def enabled(self) -> bool:
        """Anything to write, print or send to the metrics writers (the rollout then keeps each completion's scores:
        :func:`with_scores`)."""
        return self.cfg.log_rollouts or self.cfg.completions_to_print > 0 or self.to_log > 0

    @property
    def to_log(self) -> int:
        """Rows of each step for TensorBoard / W&B (``logging.completions_to_log`` when either is on, else 0)."""
        return self.cfg.completions_to_log if self.cfg.tensorboard or self.cfg.wandb else 0

    def rows(self, step: int, groups: list[ScoredGroup], samples: list[Sample]) -> list[dict]:
        """One row per completion of this rank's ``groups`` (``samples``: the rollout's, one per completion in the
        same order: their advantages and whether they train)."""
        decode = self.tokenizer.decode
        first, out, i = self.rank * len(groups), [], 0
        for p, grp in enumerate(groups):
            prompt = decode(grp.prompt_ids, skip_special_tokens=False)
            for j, c in enumerate(grp.completions):
                row = {"step": step, "group": first + p, "sample": j, "prompt": prompt,
                       "completion": decode(list(c.token_ids), skip_special_tokens=False),
                       "prompt_tokens": len(grp.prompt_ids), "completion_tokens": len(c.token_ids),
                       "finish_reason": c.finish_reason}
                if grp.tool_calls is not None:
                    row.update(turns=int(c.num_turns), tool_calls=grp.tool_calls[j])
                row.update(rewards=dict(grp.scores[j]), reward=float(grp.rewards[j]),
                           advantage=float(samples[i].advantage), trained=bool(samples[i].train))
                out.append(row)
                i += 1
        return out

    def record(self, step: int, groups: list[ScoredGroup], samples: list[Sample]) -> list[dict]:
        """Write (and print) step ``step``'s rows; returns them."""
        rows = self.rows(step, groups, samples)
        if self.cfg.log_rollouts:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_jsonl(self.directory / step_file_name(step, self.rank, self.world_size), rows)
            prune(self.directory, self.cfg.rollouts_keep, None if self.world_size == 1 else self.rank)
        k = self.cfg.completions_to_print
        if k and rows:
            print0(f"step {step}: {min(k, len(rows))} of {len(rows) * self.world_size} completions\n"
                   + format_table(rows[:k]))
        return rows
