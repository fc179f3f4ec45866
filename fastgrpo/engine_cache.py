"""The per-``generate`` memory of the engine: the KV page pool (``_KVCache``) and, on the eager (CPU) path, the row
cache and reused step buffers (``_Workspace``), with the ``_Run`` steps that size the workspace and refresh its rows
from the pages (``_RowCacheSteps``). Which sequence owns which row and pages is the scheduler's
(``fastgrpo.scheduler``); this file only copies K/V where the block tables say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastgrpo.engine_forward import mkl_packed_gemm


@dataclass
class _KVCache:
    """The per-``generate`` memory (freed when generate returns): the KV page pool, head-major (a page's keys of
    one kv head are contiguous: a row refresh copies whole blocks, and the CUDA kernel reads 64 × D contiguous
    values per page and head), keys and values of all layers in one tensor (a row refresh or flush moves both, for
    every layer, in one indexed copy), and, on the eager (CPU) path, the row cache and the step's reused buffers."""

    kv: torch.Tensor  # [L, 2, Hkv, pages, page_size, D]: [:, 0] keys, [:, 1] values
    work: _Workspace | None = None

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


# The CPU step packs its LM head, MLP and q/k/v weights for MKL when they hold this many bytes in all. Below the
# lower bound a pack (allocated per call and row count) costs more than the products it speeds: the demo's 130K-
# parameter model generated 8% slower packed (the tests lower it to 0 to run the packed path on their tiny models).
PACKED_WEIGHTS_MIN_BYTES = 4 << 20
PACKED_WEIGHTS_MAX_BYTES = 256 << 20


def _packed_projections(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


class _Workspace(NamedTuple):
    """The eager (CPU) decode step's memory besides the pages.

    **Row cache.** Its attention reads each row's keys laid out contiguously, ``kv_rows[layer, row, 0, :, :len]``, not
    a fresh gather of the row's pages at every layer and step (which copies the whole live K/V once more per step and
    was the largest cost of a CPU step). A row whose sequence changed (admitted, moved by compaction, recomputed
    after a preemption, resumed after a turn) is loaded from its pages through the block table; a decode step then
    writes its token's K/V to the row only, and the K/V a row holds past the position it was loaded at
    (``_Run.row_from``) go to the sequence's pages when it leaves the row keeping them (moved by compaction, paused
    at a turn's end: :meth:`_RowCacheSteps._flush_rows`). So the pages hold a sequence's K/V whenever a row is
    loaded from them or a prefill reads them, and a step pays no scattered page write per layer (6% of
    bench_generation's CPU call). Memory: a static cache for the rows (``L · R · Hkv · max_pages · page_size · D``
    keys and as many values), kept only when it holds no more tokens than the KV budget; otherwise every layer
    gathers its rows' pages at every step (``paged_decode_attention_torch``, slower) and writes each token's K/V to
    its page.

    **Products.** fp32 with MKL, when the LM head, MLP and q/k/v weights hold ``PACKED_WEIGHTS_MIN_BYTES`` to
    ``PACKED_WEIGHTS_MAX_BYTES``: those products run on copies of their weights packed for MKL's GEMM at the step's
    row count (``packs``: module -> {rows: packed weight}, filled on first use by
    :func:`~fastgrpo.engine_forward._packed_linear`, at most two row counts kept per weight; an attention module ->
    its q/k/v weights stacked, their bias, their packs), so at most about three times those bytes, freed with the
    workspace: the packs always match the weights of this call.
    Otherwise the step writes its MLP activations and logits into reused buffers instead of fresh tensors, as the
    feature-major products of ``_linear_t``. Neither under autocast (the products are not cast)."""

    kv_rows: torch.Tensor | None  # [L, R, 2, Hkv, max_pages · page_size, D]; None: attention through the pages
    gate: torch.Tensor | None  # [R · intermediate]: the MLP's gate projection, then its activation; None with packs
    up: torch.Tensor | None  # [R · intermediate]
    down: torch.Tensor | None  # [R · H]: the MLP's output
    logits: torch.Tensor | None  # [R · V] fp32
    packs: dict | None = None  # module -> {rows: its weight packed for MKL}; attention -> (q/k/v stacked, bias, packs)


class _RowCacheSteps:
    """The ``_Run`` steps of the CPU row cache (a mixin of ``fastgrpo.generation._Run``)."""

    def _workspace(self, R: int, max_keys: int) -> _Workspace:
        """The eager decode step's row cache and buffers for ``R`` rows of at most ``max_keys`` keys (see
        :class:`_Workspace`): by default the row cache only when it holds no more tokens than the KV budget
        (``R · max_keys ≤ max_total_tokens``: the eager path's K/V stays within twice the budget); no activation
        buffers under autocast."""
        e, dev, dt = self.e, self.device, self.dtype
        shape = (len(e.layers), R, 2, e.num_kv_heads, max_keys, e.head_dim)
        rows = R * max_keys <= self.budget if e._row_cache is None else e._row_cache
        plain = dt == next(e.model.parameters()).dtype
        inter = e.layers[0].mlp.gate_proj.out_features
        weights = [e.model.lm_head.weight] + [m.weight for layer in e.layers for m in _packed_projections(layer)]
        packed = (plain and dt == torch.float32 and mkl_packed_gemm() and all(w.dtype == dt for w in weights)
                  and PACKED_WEIGHTS_MIN_BYTES <= sum(w.numel() * w.element_size() for w in weights)
                  <= PACKED_WEIGHTS_MAX_BYTES)
        buffers = plain and not packed
        return _Workspace(
            # zeroed: never-written keys stay finite (their weight is 0 in P V, and 0 · NaN would be NaN)
            kv_rows=torch.zeros(shape, device=dev, dtype=dt) if rows else None,
            gate=torch.empty(R * inter, device=dev, dtype=dt) if buffers else None,
            up=torch.empty(R * inter, device=dev, dtype=dt) if buffers else None,
            down=torch.empty(R * e.model.config.hidden_size, device=dev, dtype=dt) if buffers else None,
            logits=torch.empty(R * e.vocab_size, device=dev) if buffers else None,
            packs={} if packed else None,
        )

    def _refresh_rows(self, work: _Workspace, cache: _KVCache, n_pages: int) -> None:
        """Copy into the row cache, from the pages, every running row whose sequence is not the one it holds; its
        K/V from its current position on will be the row's alone (``row_from``)."""
        rows = [row for row, seq in enumerate(self.sched.rows) if self.row_owner[row] is not seq]
        self.row_owner[len(self.sched.rows) :] = [None] * (len(self.row_owner) - len(self.sched.rows))
        if not rows:
            return
        idx = torch.tensor(rows, device=self.device)
        for row, pos in zip(rows, self.st.pos[idx].tolist()):
            self.row_owner[row] = self.sched.rows[row]
            self.row_from[row] = pos
        pages_NP = self.st.table[idx, :n_pages].long()
        L, _, Hkv, _, ps, D = cache.kv.shape
        T = n_pages * ps
        kv = cache.kv[:, :, :, pages_NP]  # [L, 2, Hkv, N, P, page_size, D]
        work.kv_rows[:, idx, :, :, :T] = kv.permute(0, 3, 1, 2, 4, 5, 6).reshape(L, len(rows), 2, Hkv, T, D)

    def _flush_rows(self, cache: _KVCache, held: list) -> None:
        """Write to their pages (through the rows' block tables) the K/V that rows hold only in the row cache:
        positions ``[row_from, pos)`` of each ``(row, sequence)`` in ``held`` whose row was loaded for that sequence
        (one admitted since the last load has decoded nothing there: its K/V are all in its pages), every layer in
        one indexed copy; a no-op without a row cache."""
        work = cache.work
        rows = [row for row, seq in held if self.row_owner[row] is seq]
        if work is None or work.kv_rows is None or not rows:
            return
        row_N, pos_N = [], []
        for row, end in zip(rows, self.st.pos[rows].tolist()):
            row_N += [row] * (end - self.row_from[row])
            pos_N += range(self.row_from[row], end)
            self.row_from[row] = end
        if not row_N:
            return
        L, _, Hkv, _, ps, D = cache.kv.shape
        r, p = torch.tensor(row_N, device=self.device), torch.tensor(pos_N, device=self.device)
        slot_N = self.st.table[r, p // ps].long() * ps + p % ps
        cache.kv.view(L, 2, Hkv, -1, D)[:, :, :, slot_N] = work.kv_rows[:, r, :, :, p].permute(1, 2, 3, 0, 4)
