"""``python -m fastgrpo.rollouts RUN_DIR``: a GRPO run's completions as its rollout log holds them
(``<run dir>/rollouts/step_<N>.jsonl``, written by :mod:`fastgrpo.algorithms.rollout_log`; the fields are listed
there).

``--step N`` picks a step (default: the latest); ``--truncated`` keeps the completions cut at the length limit
(finish reason ``length``); ``--sort`` orders them (``reward`` and ``advantage``: lowest first, ``length``: longest
first); ``--worst K`` shows the first K of that order (by lowest reward unless ``--sort`` says otherwise);
``--full`` prints each chosen completion's prompt and whole text after the table. A step written by several
processes (``step_<N>.rank<R>.jsonl``) is read as one, its rows in group order. The eval's samples
(``<run dir>/rollouts/eval``, or ``python -m fastgrpo.eval --samples DIR``) read the same way, without advantages.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastgrpo.algorithms.rollout_log import STEP_FILE, format_table

SORT_KEYS = {"reward": lambda r: r["reward"], "advantage": lambda r: r["advantage"],
             "length": lambda r: -r["completion_tokens"]}
"""``--sort`` -> the key that puts the worst first (lowest reward or advantage, longest completion)."""


def step_files(run_dir: str | Path) -> dict[int, list[Path]]:
    """Step -> its files (one per rank) in ``<run_dir>/rollouts`` (or ``run_dir`` itself when it holds them)."""
    d = Path(run_dir)
    if (d / "rollouts").is_dir():
        d = d / "rollouts"
    out: dict[int, list[Path]] = {}
    for path in sorted(d.iterdir()) if d.is_dir() else []:
        m = STEP_FILE.match(path.name)
        if m:
            out.setdefault(int(m.group(1)), []).append(path)
    return out


def read_step(files: list[Path]) -> list[dict]:
    """The rows of one step's files, in (group, sample) order."""
    rows = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: (r["group"], r["sample"]))


def select(rows: list[dict], *, worst: int = 0, sort: str | None = None, truncated: bool = False) -> list[dict]:
    """``rows`` filtered (``truncated``: finish reason "length" only), ordered by ``sort`` (worst first; ``worst``
    without ``sort``: by reward) and cut to the first ``worst`` (0: all). Ties keep the file order."""
    if truncated:
        rows = [r for r in rows if r["finish_reason"] == "length"]
    if worst and sort is None:
        sort = "reward"
    if sort is not None:
        rows = sorted(rows, key=SORT_KEYS[sort])
    return rows[:worst] if worst else rows


def full_text(rows: list[dict]) -> str:
    """Each row's prompt and whole completion, with its scores."""
    parts = []
    for r in rows:
        scores = (f" {r['rewards']}, advantage {r['advantage']:.4f}" if "advantage" in r  # a training step's row
                  else f", answer {r['answer']!r}, extracted {r['extracted']!r}")  # an eval sample's row
        extra = f", turns {r['turns']}, tool calls {r['tool_calls']}" if r.get("turns") is not None else ""
        parts.append(f"--- step {r['step']} group {r['group']} sample {r['sample']}: reward {r['reward']:.4f}"
                     f"{scores}, {r['finish_reason']}, {r['prompt_tokens']} + {r['completion_tokens']} tokens{extra}\n"
                     f"[prompt]\n{r['prompt']}\n[completion]\n{r['completion']}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastgrpo.rollouts", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="the run directory (or its rollouts/ directory)")
    ap.add_argument("--step", type=int, default=None, help="the step to show (default: the latest logged)")
    ap.add_argument("--worst", type=int, default=0, metavar="K", help="only the K worst completions (see --sort)")
    ap.add_argument("--sort", choices=sorted(SORT_KEYS), default=None,
                    help="order: reward / advantage lowest first, length longest first (--worst default: reward)")
    ap.add_argument("--truncated", action="store_true", help="only completions cut at the length limit")
    ap.add_argument("--full", action="store_true", help="also print the chosen completions' prompts and whole texts")
    args = ap.parse_args(argv)
    if args.worst < 0:
        ap.error("--worst must be >= 0")
    steps = step_files(args.run_dir)
    if not steps:
        print(f"no rollout files (rollouts/step_<N>.jsonl) under {args.run_dir}", file=sys.stderr)
        return 1
    step = max(steps) if args.step is None else args.step
    if step not in steps:
        print(f"step {step} has no rollout file; logged steps: {sorted(steps)}", file=sys.stderr)
        return 1
    rows = read_step(steps[step])
    if args.sort == "advantage" and rows and "advantage" not in rows[0]:
        print("--sort advantage: these rows have no advantage (eval samples); sort by reward or length",
              file=sys.stderr)
        return 1
    chosen = select(rows, worst=args.worst, sort=args.sort, truncated=args.truncated)
    print(f"step {step}: {len(chosen)} of {len(rows)} completions"
          + (f" ({len(steps)} steps logged, {min(steps)} to {max(steps)})" if len(steps) > 1 else ""))
    print(format_table(chosen))
    if args.full and chosen:
        print(full_text(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
