"""The per-call state the host loop and the device step share: the rows' device state (``RowState``) and what the
decode steps hand back to the host at each read (``StepOutput``).

Rows ``[0, running)`` of a ``RowState`` hold the scheduler's running samples, in ``Scheduler.rows`` order; rows up to
the batch bucket are padding (done, position 0, the scratch page). The device writes them at every decode step; the
host reads them only every ``sync_every`` steps (:func:`read_step_output`, one transfer) and when it harvests a
sample's tokens (:func:`read_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class RowState(NamedTuple):
    """Per-row decode state on the device (``R`` rows; ``max_new`` = the longest response limit)."""

    tok: torch.Tensor  # [R] int64: token fed at the next step
    pos: torch.Tensor  # [R] int64: its position (= tokens already cached)
    n_gen: torch.Tensor  # [R] int64: tokens sampled in the current turn
    done: torch.Tensor  # [R] bool: finished or padding
    limit: torch.Tensor  # [R] int64: the sample's response (turn) limit
    stream: torch.Tensor  # [R] int64: the key of the sample's random stream, h(seed, sample) (``sample_streams``)
    t0: torch.Tensor  # [R] int64: tokens it sampled in earlier turns (its draw index is t0 + n_gen)
    # the step writes column n_gen of every row, done or not: the last column (n_gen = max_new) is scratch
    out_tok: torch.Tensor  # [R, max_new + 1] int64
    out_lp: torch.Tensor  # [R, max_new + 1] fp32
    u: torch.Tensor  # [R, max_new + 1] fp64: uniforms of its draws t0 + j (CPU, ``stream_uniforms``); [R, 0] on CUDA
    table: torch.Tensor  # [R, max_pages] int32: block tables (0 = the scratch page)
    rope: torch.Tensor  # [R] int64: rotary position - pos (a VLM prompt's M-RoPE delta, fastgrpo.engine.vision; else 0)


def new_row_state(R: int, max_new: int, max_pages: int, uniforms: bool, device: torch.device) -> RowState:
    """A zeroed state for ``R`` rows, all done; ``uniforms``: keep the table of each row's CPU draws."""
    return RowState(
        tok=torch.zeros(R, dtype=torch.long, device=device),
        pos=torch.zeros(R, dtype=torch.long, device=device),
        n_gen=torch.zeros(R, dtype=torch.long, device=device),
        done=torch.ones(R, dtype=torch.bool, device=device),
        limit=torch.ones(R, dtype=torch.long, device=device),
        stream=torch.zeros(R, dtype=torch.long, device=device),
        t0=torch.zeros(R, dtype=torch.long, device=device),
        out_tok=torch.zeros(R, max_new + 1, dtype=torch.long, device=device),  # + a scratch column
        out_lp=torch.zeros(R, max_new + 1, dtype=torch.float32, device=device),
        u=torch.zeros(R, max_new + 1 if uniforms else 0, device=device, dtype=torch.float64),
        table=torch.zeros(R, max_pages, dtype=torch.int32, device=device),
        rope=torch.zeros(R, dtype=torch.long, device=device),
    )


@dataclass
class StepOutput:
    """What ``sync_every`` decode steps hand to the host loop, for each running row (one device-to-host read, the
    only host synchronisation of the decode loop)."""

    done: list[int]
    """1 where the row's sample finished its turn (a stop token or its limit), else 0."""
    generated: list[int]
    """Tokens it sampled in its current turn."""
    newest: list[list[int]]
    """Its newest ``sync_every`` token ids up to ``generated`` (clamped at the turn's first column): read only while
    some sample has stop strings, else empty lists."""


def read_step_output(state: RowState, running: int, window: torch.Tensor | None) -> StepOutput:
    """The flags and counts of rows ``[0, running)`` and, with ``window`` (the offsets ``-sync_every .. -1``), their
    newest tokens, in one transfer."""
    flags = [state.done[:running, None].long(), state.n_gen[:running, None]]
    if window is not None:
        cols = (state.n_gen[:running, None] + window).clamp(min=0)  # [S, steps]
        flags.append(state.out_tok[:running].gather(1, cols))
    rows = torch.cat(flags, dim=1).tolist()
    return StepOutput([f[0] for f in rows], [f[1] for f in rows], [f[2:] for f in rows])


def read_tokens(state: RowState, seqs) -> None:
    """Copy the generated tokens and log-probs of ``seqs`` (at their rows, ``seq.generated`` of each) to the host."""
    idx = torch.tensor([s.row for s in seqs], device=state.out_tok.device)
    toks, lps = state.out_tok[idx].tolist(), state.out_lp[idx].tolist()
    for s, tk, lp in zip(seqs, toks, lps):
        s.tokens, s.logprobs = tk[: s.generated], lp[: s.generated]
