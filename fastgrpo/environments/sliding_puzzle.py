"""The sliding puzzle (after NeMo-RL's ``sliding_puzzle`` game), on the text-step contract.

An ``size × size`` board holds the tiles ``1 … size²-1`` and one empty cell; solved is the tiles in row-major order
with the empty cell last. Each turn the model writes one action inside ``<action>…</action>`` (the last one in the
turn counts; the turn stops at ``</action>``): ``up`` / ``down`` / ``left`` / ``right`` slide the tile below / above
/ right of / left of the empty cell into it, and ``slide r c`` slides the tile at row ``r``, column ``c`` (1-based),
which must touch the empty cell. As in NeMo-RL the reward is 1.0 on the move that solves the board (which ends the
trajectory, "env_done") and 0 otherwise, with no penalty for an invalid move (which, as in NeMo-RL, counts as a
move); unlike NeMo-RL, a turn without a readable action costs a move too (NeMo-RL answers it with the board and counts
none) and there is no ``view`` action; the game ends (reward 0) after ``max_moves`` moves.

Boards are made by a random walk from the solved board (``shuffle_moves`` steps, seeded by the row's ``seed``; a step
never undoes the one before unless ``backtrack``, as NeMo-RL's walk may) and kept only when no solution of fewer than
``min_moves`` moves exists (a breadth-first search to depth ``min_moves - 1``): with one action per turn, the optimum
needs at least ``min_moves`` (default 3) turns. NeMo-RL's boards (``examples/run_grpo_sliding_puzzle.py``: an odd
number of shuffle moves, any board but the solved one) are ``min_moves=1, backtrack=True``; the
``data.synthetic_task: sliding_puzzle`` rows draw their size and shuffle moves as it does (``fastgrpo.data.datasets``).
"""

from __future__ import annotations

import random
import re
from collections import deque

from fastgrpo.environments.core import TextStepEnvironment

# the tile that slides into the empty cell, as an offset from the empty cell
DIRECTIONS = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.S | re.I)
_SLIDE_RE = re.compile(r"slide\s+(\d+)\s+(\d+)")
MAX_TRIES = 1000  # random walks tried before a board with the required optimum is declared impossible


def solved(size: int) -> tuple[int, ...]:
    return tuple(range(1, size * size)) + (0,)


def move(grid: tuple[int, ...], size: int, tile_r: int, tile_c: int) -> tuple[int, ...] | None:
    """``grid`` after the tile at (tile_r, tile_c) (0-based) slides into the empty cell; None when it cannot."""
    e = grid.index(0)
    er, ec = divmod(e, size)
    if not (0 <= tile_r < size and 0 <= tile_c < size) or abs(tile_r - er) + abs(tile_c - ec) != 1:
        return None
    g = list(grid)
    g[e], g[tile_r * size + tile_c] = g[tile_r * size + tile_c], 0
    return tuple(g)


def neighbours(grid: tuple[int, ...], size: int) -> list[tuple[str, tuple[int, ...]]]:
    er, ec = divmod(grid.index(0), size)
    out = []
    for name, (dr, dc) in DIRECTIONS.items():
        g = move(grid, size, er + dr, ec + dc)
        if g is not None:
            out.append((name, g))
    return out


def optimal_moves(grid: tuple[int, ...], size: int, cap: int) -> int | None:
    """The fewest moves that solve ``grid`` (breadth-first search), or None when more than ``cap``."""
    goal, seen, frontier = solved(size), {grid}, deque([(grid, 0)])
    while frontier:
        g, d = frontier.popleft()
        if g == goal:
            return d
        if d < cap:
            for _, h in neighbours(g, size):
                if h not in seen:
                    seen.add(h)
                    frontier.append((h, d + 1))
    return None


def generate(size: int, shuffle_moves: int, min_moves: int, seed: int, backtrack: bool = False) -> tuple[int, ...]:
    """A board whose optimum is in [min_moves, shuffle_moves], from random walks seeded by ``seed`` (the walk is a
    solution of shuffle_moves moves, so only the lower bound is searched: depth min_moves - 1, cheap even on 5×5)."""
    if min_moves > shuffle_moves:
        raise ValueError(f"min_moves ({min_moves}) must be <= shuffle_moves ({shuffle_moves})")
    rng = random.Random(seed)
    for _ in range(MAX_TRIES):
        grid, last = solved(size), None
        for _ in range(shuffle_moves):
            options = [g for _, g in neighbours(grid, size) if backtrack or g != last]
            last, grid = grid, rng.choice(options)
        if optimal_moves(grid, size, min_moves - 1) is None:
            return grid
    raise ValueError(f"no {size}x{size} board needing >= {min_moves} moves after {MAX_TRIES} walks of "
                     f"{shuffle_moves} moves")


def render(grid: tuple[int, ...] | list[int], size: int) -> str:
    width = len(str(size * size - 1))
    return "\n".join(" ".join(str(v).rjust(width) if v else "_" * width for v in grid[r * size:(r + 1) * size])
                     for r in range(size))


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
