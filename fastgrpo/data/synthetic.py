"""The built-in tasks (``data.path: synthetic``), as prompt rows, preference rows and SFT rows.

The task ``add``: ``"3+7+2="`` → ``\\boxed{12}``, every combination of ``data.synthetic_num_terms`` numbers in
``[0, data.synthetic_max_value]``, split once with a fixed seed into a held-out set of ``data.synthetic_eval_size``
questions and a disjoint training set. The task ``sliding_puzzle`` (GRPO with ``env.environment_factory:
sliding_puzzle``): rows of reset arguments for the game, drawn as NeMo-RL's ``examples/run_grpo_sliding_puzzle.py``
draws its boards (a side in ``2..data.puzzle_size``, an odd number of shuffle moves up to
``data.puzzle_shuffle_moves``, a walk that may undo a move, any board but the solved one), with one seed per row
(``data.synthetic_train_size`` training rows, then ``synthetic_eval_size`` held-out seeds; a small board can repeat
across them: a 2×2 board has 12 states). ``prompt`` is :data:`PUZZLE_PROMPT` (the environment's reset appends the
rules and the board), ``answer`` the solved board.

For DPO and SFT the ``add`` task becomes preference rows (chosen: the answer in ``\\boxed{}``, rejected: a near
miss) or prompt/completion rows, on the same split.
"""

from __future__ import annotations

import itertools
import random

from fastgrpo.config import DataConfig
from fastgrpo.data.puzzle_boards import render, solved
from fastgrpo.data.vision_tasks import squares_rows

SYNTHETIC = "synthetic"
SYNTHETIC_SPLIT_SEED = 1234  # fixed: the held-out split never changes with train.seed
PUZZLE_PROMPT = "Think carefully step by step before each move.\n"  # NeMo-RL's prompt ends its rules with this


def puzzle_rows(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows of the ``sliding_puzzle`` task: each one the reset arguments of one board of
    :class:`fastgrpo.environments.sliding_puzzle.SlidingPuzzle` (fixed by SYNTHETIC_SPLIT_SEED and the row's seed)."""
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
    if cfg.synthetic_task == "squares":  # images: the vision task (fastgrpo.data.vision_tasks)
        return squares_rows(cfg, SYNTHETIC_SPLIT_SEED)
    values = range(cfg.synthetic_max_value + 1)
    combos = list(itertools.product(values, repeat=cfg.synthetic_num_terms))
    if len(combos) < 2 * cfg.synthetic_eval_size:
        raise ValueError(f"data.synthetic_eval_size={cfg.synthetic_eval_size} leaves too few training questions: "
                         f"the task has only {len(combos)} (raise data.synthetic_num_terms or synthetic_max_value)")
    random.Random(SYNTHETIC_SPLIT_SEED).shuffle(combos)
    rows = [{"prompt": "+".join(map(str, c)) + "=", "answer": str(sum(c))} for c in combos]
    return rows[cfg.synthetic_eval_size :], rows[: cfg.synthetic_eval_size]


def sft_completion(answer: str) -> str:
    """The reference completion of the supervised warm-up: the answer in ``\\boxed{}``."""
    return f"\\boxed{{{answer}}}"


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
