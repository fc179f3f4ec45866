"""The sliding puzzle's boards (after NeMo-RL's ``sliding_puzzle`` game): the solved board, moves, the optimum, and
boards drawn by seeded random walks. Pure functions on tuples: the ``sliding_puzzle`` rows of the built-in task
(:mod:`fastgrpo.data.synthetic`) and the game (:mod:`fastgrpo.environments.sliding_puzzle`) share them.

An ``size × size`` board is a row-major tuple of the tiles ``1 … size²-1`` and ``0``, the empty cell; solved is the
tiles in order with the empty cell last. Boards are made by a random walk from the solved board (``shuffle_moves``
steps, seeded by ``seed``; a step never undoes the one before unless ``backtrack``, as NeMo-RL's walk may) and kept
only when no solution of fewer than ``min_moves`` moves exists (a breadth-first search to depth ``min_moves - 1``).
"""

from __future__ import annotations

import random
from collections import deque

# the tile that slides into the empty cell, as an offset from the empty cell
DIRECTIONS = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
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

