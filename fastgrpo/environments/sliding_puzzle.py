"""The sliding puzzle (after NeMo-RL's ``sliding_puzzle`` game), on the text-step contract.

An ``size × size`` board holds the tiles ``1 … size²-1`` and one empty cell; solved is the tiles in row-major order
with the empty cell last. Each turn the model writes one action inside ``<action>…</action>`` (the last one in the
turn counts; the turn stops at ``</action>``): ``up`` / ``down`` / ``left`` / ``right`` slide the tile below / above
/ right of / left of the empty cell into it, and ``slide r c`` slides the tile at row ``r``, column ``c`` (1-based),
which must touch the empty cell. As in NeMo-RL the reward is 1.0 on the move that solves the board (which ends the
trajectory, "env_done") and 0 otherwise, with no penalty for an invalid move (which, as in NeMo-RL, counts as a
move); unlike NeMo-RL, a turn without a readable action costs a move too (NeMo-RL answers it with the board and counts
none) and there is no ``view`` action; the game ends (reward 0) after ``max_moves`` moves.

The boards and their moves are :mod:`fastgrpo.data.puzzle_boards`: a random walk from the solved board
(``shuffle_moves`` steps, seeded by the row's ``seed``), kept only when no solution of fewer than ``min_moves``
moves exists: with one action per turn, the optimum needs at least ``min_moves`` (default 3) turns. NeMo-RL's boards
(``examples/run_grpo_sliding_puzzle.py``: an odd number of shuffle moves, any board but the solved one) are
``min_moves=1, backtrack=True``; the ``data.synthetic_task: sliding_puzzle`` rows draw their size and shuffle moves
as it does (:mod:`fastgrpo.data.synthetic`).
"""

from __future__ import annotations

import re

from fastgrpo.data.puzzle_boards import DIRECTIONS, generate, move, render, solved
from fastgrpo.environments.core import TextStepEnvironment

_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.S | re.I)
_SLIDE_RE = re.compile(r"slide\s+(\d+)\s+(\d+)")


def parse_action(text: str) -> str | None:
    """The content of the last ``<action>…</action>`` of the turn, stripped and lower-cased; None without one."""
    found = _ACTION_RE.findall(text)
    return found[-1].strip().lower() if found else None


class SlidingPuzzle(TextStepEnvironment):
    """The game on the text-step contract. Row columns (all optional): ``seed`` (0), ``size`` (2),
    ``shuffle_moves`` (8), ``min_moves`` (3), ``max_moves`` (4 × min_moves), ``backtrack`` (false)."""

    stop_strings = ("</action>",)

    def reset(self, seed: int = 0, size: int = 2, shuffle_moves: int = 8, min_moves: int = 3,
              max_moves: int | None = None, backtrack: bool = False, **_) -> tuple[str, dict]:
        grid = generate(size, shuffle_moves, min_moves, seed, backtrack)
        state = {"size": size, "grid": list(grid), "moves": 0, "max_moves": max_moves or 4 * min_moves}
        text = (f"Solve the {size}x{size} sliding puzzle: order the tiles 1 to {size * size - 1} row by row, with "
                f"the empty cell (_) last. Each turn, give one move as <action>up</action>, down, left or right "
                f"(the tile below, above, right of or left of the empty cell slides into it), or <action>slide r "
                f"c</action> for the tile at row r, column c.\n{render(grid, size)}\n")
        return text, state

    def step(self, turn_text: str, state: dict) -> tuple[str, float, bool, None]:
        size, grid = state["size"], tuple(state["grid"])
        action = parse_action(turn_text)
        er, ec = divmod(grid.index(0), size)
        new = None
        if action in DIRECTIONS:
            dr, dc = DIRECTIONS[action]
            new = move(grid, size, er + dr, ec + dc)
            note = f"Cannot move {action}." if new is None else f"Moved {action}."
        elif action is not None and (m := _SLIDE_RE.fullmatch(action)):
            new = move(grid, size, int(m.group(1)) - 1, int(m.group(2)) - 1)
            note = "That tile does not touch the empty cell." if new is None else f"Slid the tile at {m.group(1)} " \
                                                                                    f"{m.group(2)}."
        else:
            note = "No valid action: write one move as <action>up</action> (or down, left, right, slide r c)."
        state["moves"] += 1
        if new is not None:
            state["grid"] = list(new)
            grid = new
        if grid == solved(size):
            return "Solved!", 1.0, True, None
        if state["moves"] >= state["max_moves"]:
            return f"Out of moves ({state['max_moves']}).", 0.0, True, None
        return f"{note}\n{render(grid, size)}\n", 0.0, False, None
