"""What holds a ``generate`` call's K/V: the KV page pool (``KVCache``, with the CPU step's ``Workspace`` when the
paged kernel does not run) and the host bookkeeping of the CPU row cache (``RowCache``: which sequence each row of
``Workspace.kv_rows`` holds, and from which position its K/V are in the row only). Which sequence owns which row and
pages is the scheduler's (``fastgrpo.engine.scheduler``); this file only copies K/V where the block tables say.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.engine.workspace import Workspace


@dataclass
class KVCache:
    """The per-``generate`` memory (freed when generate returns): the KV page pool, head-major (a page's keys of
    one kv head are contiguous: a row refresh copies whole blocks, and the CUDA kernel reads 64 × D contiguous
    values per page and head), keys and values of all layers in one tensor (a row refresh or flush moves both, for
    every layer, in one indexed copy), and, on the eager (CPU) path, the row cache and the step's reused buffers."""

    kv: torch.Tensor  # [L, 2, Hkv, pages, page_size, D]: [:, 0] keys, [:, 1] values
    work: Workspace | None = None
    loads: list[int] | None = None  # per row of the row cache: how many times RowCache loaded it (new contents)

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]  # [L, Hkv, pages, page_size, D]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pools as ``[pages, page_size, Hkv, D]`` views (the decode-attention API's layout)."""
        return self.kv[layer, 0].permute(1, 2, 0, 3), self.kv[layer, 1].permute(1, 2, 0, 3)

    def write(self, layer: int, slot_N: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> None:
        """K/V of N tokens into flat slots ``page · page_size + offset`` of the layer's pool."""
        Hkv, D = self.kv.shape[2], self.kv.shape[-1]
        self.kv[layer, 0].view(Hkv, -1, D)[:, slot_N] = k_NHD.transpose(0, 1)
        self.kv[layer, 1].view(Hkv, -1, D)[:, slot_N] = v_NHD.transpose(0, 1)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of pages ``src`` into pages ``dst``."""
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]

    @property
    def rows(self) -> torch.Tensor | None:
        """The CPU row cache ``[L, R, 2, Hkv, max_pages · page_size, D]``, or None (attention through the pages)."""
        return None if self.work is None else self.work.kv_rows


class RowCache:
    """The host side of the CPU row cache (``KVCache.rows``, see ``fastgrpo.engine.workspace.Workspace``): for each
    of the ``R`` rows, the sequence whose keys it holds (``owner``) and the position from which its K/V are in the
    row only, not yet in the pages (``loaded_at``). Every method is a no-op on what has no row cache."""

    def __init__(self, cache: KVCache, R: int):
        self.cache = cache
        cache.loads = [0] * R
        self.owner: list = [None] * R
        self.loaded_at = [0] * R

    def forget(self, row: int) -> None:
        """The row's K/V are stale (its sample was preempted, or paused and will get appended tokens)."""
        self.owner[row] = None

    def refresh(self, running: list, pos_R: torch.Tensor, table_RP: torch.Tensor, n_pages: int) -> None:
        """Copy into the row cache, from the pages, every running row (``running[row]``, the scheduler's rows) whose
        sequence is not the one it holds; its K/V from its current position on will be the row's alone."""
        cache, work = self.cache, self.cache.work
        rows = [row for row, seq in enumerate(running) if self.owner[row] is not seq]
        self.owner[len(running) :] = [None] * (len(self.owner) - len(running))
        if not rows:
            return
        idx = torch.tensor(rows, device=cache.kv.device)
        for row, pos in zip(rows, pos_R[idx].tolist()):
            self.owner[row] = running[row]
            self.loaded_at[row] = pos
            cache.loads[row] += 1
        pages_NP = table_RP[idx, :n_pages].long()
        L, _, Hkv, _, ps, D = cache.kv.shape
        T = n_pages * ps
        kv = cache.kv[:, :, :, pages_NP]  # [L, 2, Hkv, N, P, page_size, D]
        work.kv_rows[:, idx, :, :, :T] = kv.permute(0, 3, 1, 2, 4, 5, 6).reshape(L, len(rows), 2, Hkv, T, D)

    def flush(self, held: list, pos_R: torch.Tensor, table_RP: torch.Tensor) -> None:
        """Write to their pages (through the rows' block tables) the K/V that rows hold only in the row cache:
        positions ``[loaded_at, pos)`` of each ``(row, sequence)`` in ``held`` whose row was loaded for that sequence
        (one admitted since the last load has decoded nothing there: its K/V are all in its pages), every layer in
        one indexed copy."""
        cache, work = self.cache, self.cache.work
        rows = [row for row, seq in held if self.owner[row] is seq]
        if work is None or work.kv_rows is None or not rows:
            return
        row_N, pos_N = [], []
        for row, end in zip(rows, pos_R[rows].tolist()):
            row_N += [row] * (end - self.loaded_at[row])
            pos_N += range(self.loaded_at[row], end)
            self.loaded_at[row] = end
        if not row_N:
            return
        L, _, Hkv, _, ps, D = cache.kv.shape
        r, p = torch.tensor(row_N, device=cache.kv.device), torch.tensor(pos_N, device=cache.kv.device)
        slot_N = table_RP[r, p // ps].long() * ps + p % ps
        cache.kv.view(L, 2, Hkv, -1, D)[:, :, :, slot_N] = work.kv_rows[:, r, :, :, p].permute(1, 2, 3, 0, 4)
