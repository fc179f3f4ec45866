"""The model runner of one ``generate`` call (``ModelRunner``): it computes, and owns what computing needs for the
call: the KV page pool (``KVCache``), on CPU the row cache and the products' workspace, on CUDA the decode step's
graphs, the rotary tables and the elementwise ops. The host loop (``fastgrpo.engine.loop``) tells it what to
prefill and when to step; it never decides who runs (the scheduler's) and never reads the host's per-sample state.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from fastgrpo.engine.cache import KVCache, RowCache
from fastgrpo.engine.cuda_graphs import DecodeGraphs
from fastgrpo.engine.forward import ModelForward
from fastgrpo.engine.state import RowState
from fastgrpo.engine.workspace import make_workspace
from fastgrpo.kernels.utils import use_triton

PREFILL_CHUNK_TOKENS = 16384  # prompts are prefilled in packed chunks of at most this many tokens (bounds activations)


def use_fused_attention(t: torch.Tensor) -> bool:
    """Decode attention by the Triton kernel through the pages on CUDA; the row cache elsewhere (the CPU path)."""
    return t.is_cuda and use_triton(t)


class ModelRunner:
    """The device side of one call for ``R`` rows of at most ``max_pages`` pages each, over a pool of ``num_pages``
    pages of ``page_size`` tokens.

    Args:
        forward: the model's forward pieces. state: the rows' device state the decode step reads and the loop
            writes. cos_TD, sin_TD: the rotary tables of the call's longest sequence. dtype: activations and K/V.
        budget: the KV budget in tokens (bounds the CPU row cache when ``row_cache`` is None).
        row_cache, cpu_packed: the engine's settings for the CPU step (``GenerationEngine``).
        cuda_graphs: replay the decode step from CUDA graphs (only on CUDA).
        vision: the call's images (a VLM, ``fastgrpo.engine.vision.CallVision``): prefill embeds them, the decode
            step's rotary reads each row's ``state.rope`` offset; None: text only.
        recorder: a mixture-of-experts model's record of the experts chosen (router replay,
            ``fastgrpo.engine.moe.RoutingRecorder``), or None.
    """

    def __init__(self, forward: ModelForward, state: RowState, *, R: int, num_pages: int, page_size: int,
                 max_pages: int, cos_TD: torch.Tensor, sin_TD: torch.Tensor, dtype: torch.dtype, budget: int,
                 row_cache: bool | None, cpu_packed: bool | None, cuda_graphs: bool, vision=None, recorder=None):
        device = state.tok.device
        self.forward = forward
        self.vision = vision
        self.recorder = recorder
        self.state = state
        self.ops = forward.elementwise_ops(device)
        self.cos_TD, self.sin_TD = cos_TD, sin_TD
        self.dtype = dtype
        self.page_size = page_size
        L, Hkv, D = len(forward.layers), forward.num_kv_heads, forward.head_dim
        # zeroed: masked-out keys still enter the CPU attention's P @ V, where 0 * NaN would be NaN
        self.cache = KVCache(kv=torch.zeros(L, 2, Hkv, num_pages, page_size, D, device=device, dtype=dtype))
        self.products = dict(cpu_packed={}, cpu_packed_by=None, cpu_product_ms={})  # last_stats of the CPU step
        if not use_fused_attention(self.cache.kv):
            self.cache.work, self.products = make_workspace(
                forward, R, max_pages * page_size, budget, row_cache, cpu_packed, device, dtype
            )
        self.rows = RowCache(self.cache, R)
        self.graphs = DecodeGraphs(self._graph_forward, R, forward.vocab_size, device) if cuda_graphs else None

    def close(self) -> None:
        """Drop the graphs: they hold the cache's addresses."""
        self.graphs = None

    def weights_changed(self) -> None:
        """The model's weights were updated in place (a generation session, between optimizer steps): drop the CPU
        step's MKL packs and stacked q/k/v copies, made again from the new weights on their next use. The CUDA
        graphs read the parameters' own storage, which an in-place update keeps."""
        work = self.cache.work
        if work is not None and work.packs is not None:
            work.packs.clear()

    def weights_moved(self) -> None:
        """The parameters may live at other addresses now (FSDP2 gathers them afresh for each run of a session): as
        :meth:`weights_changed`, and the CUDA graphs, which read the old addresses, are captured again on use."""
        self.weights_changed()
        if self.graphs is not None:
            g = self.graphs
            self.graphs = DecodeGraphs(g.forward, g.logits_RV.shape[0], g.logits_RV.shape[1], g.logits_RV.device)

    # ------------------------------------------------------------------ prefill

    def _slots(self, pages: list[int], positions) -> list[int]:
        ps = self.page_size
        return [pages[t // ps] * ps + t % ps for t in positions]

    def prefill(self, seqs: list) -> dict:
        """Prefill ``(tokens, pages, key or None, prompt)`` sequences in packed chunks of at most
        ``PREFILL_CHUNK_TOKENS`` (longest first), K/V into their pages; returns the last hidden state ``[H]`` of each
        key (a prompt index or a resumed sample; None: a recompute, whose next token is known). ``prompt``: the
        sequence's prompt (its images, with ``vision``)."""
        dev = self.cache.kv.device
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        last_hidden = {}
        i = 0
        while i < len(order):
            chunk = [order[i]]
            total = len(seqs[order[i]][0])
            i += 1
            while i < len(order) and total + len(seqs[order[i]][0]) <= PREFILL_CHUNK_TOKENS:
                chunk.append(order[i])
                total += len(seqs[order[i]][0])
                i += 1
            tokens, positions, slots, groups, start = [], [], [], [], 0
            for c in chunk:
                toks, pages = seqs[c][:2]
                m = len(toks)
                tokens += toks
                positions += range(m)
                slots += self._slots(pages, range(m))
                if groups and groups[-1][2] == m:
                    groups[-1] = (groups[-1][0], groups[-1][1] + 1, m)
                else:
                    groups.append((start, 1, m))
                start += m
            tokens_N, pos_N, embeds = torch.tensor(tokens, device=dev), positions, None
            cos, sin = self.cos_TD, self.sin_TD
            if self.vision is not None:  # images at their tokens, M-RoPE's cos/sin per token (read at arange(N))
                embeds, cos, sin = self.vision.prefill_inputs([(seqs[c][0], seqs[c][3]) for c in chunk], tokens_N)
                pos_N = range(len(tokens))
            with self._recording(len(tokens)) as ids_NLK:
                x = self.forward.prefill(
                    self.ops, tokens_N, torch.tensor(pos_N, device=dev), groups, cos, sin, self.cache,
                    torch.tensor(slots, device=dev), self.dtype, embeds,
                )  # [N_chunk, H]  # fmt: skip
            if ids_NLK is not None:
                at = [sum(len(seqs[c][0]) for c in chunk[:k]) for k in range(len(chunk))]
                self.recorder.prefilled([(seqs[c][2], a, len(seqs[c][0]), 0) for c, a in zip(chunk, at)], ids_NLK)
            start = 0
            for c in chunk:
                start += len(seqs[c][0])
                if seqs[c][2] is not None:
                    last_hidden[seqs[c][2]] = x[start - 1]
        return last_hidden

    def prefill_appended(self, seqs: list) -> dict:
        """Prefill ``(tokens, start, pages, key)``: each sequence's new tokens at positions ``start, start + 1, ...``
        against the K/V of ``[0, start)`` already in its pages (a chunked prefill: nothing before is recomputed), in
        packed chunks; returns the last hidden state ``[H]`` of each key."""
        dev, ps = self.cache.kv.device, self.page_size
        out = {}
        i = 0
        while i < len(seqs):
            chunk, total = [], 0
            while i < len(seqs) and (not chunk or total + len(seqs[i][0]) <= PREFILL_CHUNK_TOKENS):
                chunk.append(seqs[i])
                total += len(seqs[i][0])
                i += 1
            tokens, positions, slots, spans, tables = [], [], [], [], []
            for toks, start, pages, _ in chunk:
                end = start + len(toks)
                spans.append((len(tokens), len(toks), start))
                tokens += toks
                positions += range(start, end)
                slots += self._slots(pages, range(start, end))
                tables.append(torch.tensor(pages[: -(-end // ps)], device=dev))
            with self._recording(len(tokens)) as ids_NLK:
                x = self.forward.prefill_onto(
                    self.ops, torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), spans, tables,
                    self.cos_TD, self.sin_TD, self.cache, torch.tensor(slots, device=dev), self.dtype,
                )  # [N_chunk, H]  # fmt: skip
            if ids_NLK is not None:
                self.recorder.prefilled([(c[3], at, m, kv) for (at, m, kv), c in zip(spans, chunk)], ids_NLK)
            for (at, m, _), (_, _, _, key) in zip(spans, chunk):
                out[key] = x[at + m - 1]
        return out

    def _recording(self, M: int):
        """With a recorder: the forwards inside write their experts into a fresh ``[M, L_moe, K]`` buffer (yielded);
        else nothing (yields None)."""
        rec = self.recorder
        return nullcontext() if rec is None else rec.recording(rec.moe.buffer(M, self.cache.kv.device))

    def first_logits(self, hidden_AH: torch.Tensor) -> torch.Tensor:
        """Logits ``[A, V]`` (fp32) of the first token after each prefill's last hidden state."""
        return self.forward.logits(self.ops, hidden_AH)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Every layer's K/V of pages ``src`` into pages ``dst`` (a sample's private copy of a partial prompt page)."""
        dev = self.cache.kv.device
        self.cache.copy_pages(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))

    # ------------------------------------------------------------------ decode

    def load_rows(self, running: list, n_pages: int) -> None:
        """Before a round of decode steps: load the CPU row cache of every row whose sequence changed."""
        if self.cache.rows is not None:
            self.rows.refresh(running, self.state.pos, self.state.table, n_pages)

    def flush_rows(self, held: list) -> None:
        """``(row, sequence)`` pairs leaving their rows and keeping their pages: the K/V only their rows hold go to
        the pages."""
        self.rows.flush(held, self.state.pos, self.state.table)

    def decode(self, S_b: int, n_pages: int) -> torch.Tensor:
        """One decode step of rows ``[0, S_b)`` (their block tables' first ``n_pages`` columns; the graphs read the
        full width); returns logits ``[S_b, V]`` fp32."""
        if self.graphs is not None:
            return self.graphs.step(S_b)
        state = self.state
        with self._step_recording(S_b):
            return self.forward.decode(
                self.ops, self.cache, state.tok[:S_b], state.pos[:S_b], state.table[:S_b, :n_pages], self.cos_TD,
                self.sin_TD, self.dtype, None if self.vision is None else state.rope[:S_b],
            )  # fmt: skip

    def _graph_forward(self, S_b: int) -> torch.Tensor:
        state = self.state
        with self._step_recording(S_b):  # captured: every replay writes the recorder's static step buffer
            return self.forward.decode(
                self.ops, self.cache, state.tok[:S_b], state.pos[:S_b], state.table[:S_b], self.cos_TD, self.sin_TD,
                self.dtype, None if self.vision is None else state.rope[:S_b],
            )  # fmt: skip

    def _step_recording(self, S_b: int):
        rec = self.recorder
        return nullcontext() if rec is None else rec.recording(rec.step_RLK[:S_b])
