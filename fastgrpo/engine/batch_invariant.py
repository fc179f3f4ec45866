"""The engine's forward in ``numerics.batch_invariant`` mode (``GenerationEngine(batch_invariant=True)``): the
model's own decoder, the modules the trainer's packed forward runs, on the batch-invariant ops
(``fastgrpo.kernels.batch_invariant``), with K/V through the engine's cache.

Every forward of a call (a packed prefill, a prefill onto cached K/V, a decode step on pages or on the CPU row
cache) is one call of ``model.model`` on a row of tokens ``[1, N]`` with their positions, as the trainer's packed
forward (``fastgrpo.models.attention.packed_hidden_states``) calls it. The difference is attention only: each
layer's ``fastgrpo_varlen`` attention finds a ``KV context`` in its keyword arguments (the keyword
``fastgrpo.models.batch_invariant.KV_CONTEXT``) that writes the new K/V where the engine keeps them and attends
over each query's sequence read back from there, by ``fastgrpo.kernels.batch_invariant_attention.attention``,
the function the trainer's varlen attention runs. Since every op gives a row the same value whatever else is in the
call, a token's hidden state, logits and log-prob are the trainer's, bit for bit, under every schedule.

The LM head is :func:`fastgrpo.kernels.batch_invariant.linear` in fp32; the sampler's log-prob of the drawn token is
``logits[token] / T − logsumexp_tiles(logits / T)`` (``fastgrpo.engine.sampling.sample_tokens``), the trainer's
``fastgrpo.kernels.batch_invariant.linear_logprobs``. A call keeps the weights' grids (``weight_cache``: 2x the fp32
weights' bytes, freed when the call returns, so a session's next run after a weight update makes them again).

Tensor names carry their shape: S rows, N packed tokens, P block-table width, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import contextlib

import torch

from fastgrpo.kernels.batch_invariant import invariant_forward, invariant_ops, linear, weight_grid
from fastgrpo.kernels.batch_invariant_attention import attention, invariant_varlen, key_grid
from fastgrpo.models.attention import ATTN_IMPLEMENTATION
from fastgrpo.models.batch_invariant import KV_CONTEXT


class PrefillKV:
    """A packed prefill's K/V: written to their flat slots, attention over the fresh packed tokens per sequence
    (``cu_seqlens``): the trainer's varlen attention."""

    def __init__(self, cache, slot_N: torch.Tensor, cu_seqlens: torch.Tensor):
        self.cache, self.slot_N, self.cu_seqlens = cache, slot_N, cu_seqlens

    def attend(self, layer: int, q_1HND, k_1HND, v_1HND, scale: float) -> torch.Tensor:
        q, k, v = (x[0].transpose(0, 1) for x in (q_1HND, k_1HND, v_1HND))  # [N, H, D]
        k = key_grid(k)  # stored on their grid, as the attention reads them
        self.cache.write(layer, self.slot_N, k, v)
        return invariant_varlen(q, k, v, self.cu_seqlens, scale)[None]  # [1, N, Hq, D]


class PagedKV:
    """K/V read back from the pages: the new tokens' K/V written to their slots first, then the queries of
    sequence ``i`` (rows ``rows[i]`` of the call, at positions ``qpos[i]``) attend over its pages ``tables[i]``
    (positions ``[0, keys)``, ``keys`` = the widest table's). Queries of one sequence, padded to the longest."""

    def __init__(self, cache, slot_N: torch.Tensor, rows_BM: torch.Tensor, qpos_BM: torch.Tensor,
                 table_BP: torch.Tensor):
        self.cache, self.slot_N, self.rows_BM, self.qpos_BM, self.table_BP = cache, slot_N, rows_BM, qpos_BM, table_BP

    def attend(self, layer: int, q_1HND, k_1HND, v_1HND, scale: float) -> torch.Tensor:
        self.cache.write(layer, self.slot_N, key_grid(k_1HND[0].transpose(0, 1)), v_1HND[0].transpose(0, 1))
        kv = self.cache.kv[layer][:, :, self.table_BP]  # [2, Hkv, B, P, page_size, D]
        _, Hkv, B, P, ps, D = kv.shape
        k, v = kv.permute(0, 2, 1, 3, 4, 5).reshape(2, B, Hkv, P * ps, D)
        q = q_1HND[0][:, self.rows_BM].transpose(0, 1)  # [B, Hq, M, D]
        o_BHMD = attention(q, k, v, self.qpos_BM, scale)
        out = q_1HND.new_empty(q_1HND.shape[2], q_1HND.shape[1], D)  # [N, Hq, D]
        live = self.rows_BM >= 0
        out[self.rows_BM[live]] = o_BHMD.transpose(1, 2)[live]
        return out[None]


class RowKV:
    """The decode step on the CPU row cache: row ``s``'s token K/V written to ``kv_rows[layer, s, :, :, pos]``, then
    its query attends over the row's first ``T`` keys (those past ``pos`` are never read into its result)."""

    def __init__(self, kv_rows, pos_S: torch.Tensor, T: int):
        self.kv_rows, self.pos_S, self.T = kv_rows, pos_S, T

    def attend(self, layer: int, q_1HSD, k_1HSD, v_1HSD, scale: float) -> torch.Tensor:
        S = q_1HSD.shape[2]
        rows = self.kv_rows[layer]  # [R, 2, Hkv, T_max, D]
        kv = torch.stack((key_grid(k_1HSD[0]), v_1HSD[0]), 0)  # [2, Hkv, S, D], keys on their grid
        rows[torch.arange(S), :, :, self.pos_S] = kv.permute(2, 0, 1, 3)
        k, v = rows[:S, 0, :, : self.T], rows[:S, 1, :, : self.T]  # [S, Hkv, T, D]
        o = attention(q_1HSD[0].transpose(0, 1)[:, :, None], k, v, self.pos_S[:, None], scale)  # [S, Hq, 1, D]
        return o.transpose(1, 2).transpose(0, 1)  # [1, S, Hq, D]


class BatchInvariantForward:
    """The engine's forward pieces in the batch-invariant mode (``ModelForward`` dispatches to it). Hidden states
    it returns are after the model's final norm (the decoder's output), so :meth:`logits` is the LM head alone."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: list[torch.Tensor] = []
        self.grids: dict = {}  # the call's weight grids (invariant_forward's weight_cache)

    @contextlib.contextmanager
    def calling(self):
        """One ``generate`` call (or session): the invariant ops registered, the model on the ``fastgrpo_varlen``
        attention (its previous implementation restored after), the weights' grids kept until the call ends."""
        model = self.model
        previous = model.config._attn_implementation
        self.params = list(model.parameters())
        with invariant_ops():
            if previous != ATTN_IMPLEMENTATION:
                model.set_attn_implementation(ATTN_IMPLEMENTATION)
            try:
                yield
            finally:
                if previous != ATTN_IMPLEMENTATION:
                    model.set_attn_implementation(previous)
                self.grids.clear()  # a session's weights may change before its next call
                self.params = []

    def hidden(self, tokens_N: torch.Tensor, pos_N: torch.Tensor, context, **kwargs) -> torch.Tensor:
        """The decoder on one row of tokens at positions ``pos`` (the trainer's packed forward), attention through
        ``context``: the final hidden states ``[N, H]`` (after the final norm)."""
        with invariant_forward(self.grids, self.params):
            out = self.model.model(input_ids=tokens_N[None], position_ids=pos_N[None], use_cache=False,
                                   **{KV_CONTEXT: context}, **kwargs)
        return out.last_hidden_state[0]

    def logits(self, hidden_MH: torch.Tensor) -> torch.Tensor:
        """The LM head, fp32 ``[M, V]``: :func:`fastgrpo.kernels.batch_invariant.linear` on the kept grid."""
        head = self.model.lm_head
        if "lm_head" not in self.grids:
            self.grids["lm_head"] = weight_grid(head.weight)
        return linear(hidden_MH, head.weight, head.bias, out_dtype=torch.float32, grid=self.grids["lm_head"])

    def prefill(self, tokens_N, pos_N, groups, cache, slot_N) -> torch.Tensor:
        """``ModelForward.prefill``'s packed prompts (``groups``: ``(start, count, length)``): their final hidden
        states ``[N, H]``, their K/V in their slots."""
        lengths = [length for _, count, length in groups for _ in range(count)]
        cu = torch.tensor([0] + lengths, device=tokens_N.device).cumsum(0).to(torch.int32)
        return self.hidden(tokens_N, pos_N, PrefillKV(cache, slot_N, cu))

    def prefill_onto(self, tokens_N, pos_N, spans, tables, cache, slot_N) -> torch.Tensor:
        """``ModelForward.prefill_onto``: new tokens (``spans``: ``(start, count, kv)``) against their sequences'
        cached K/V, read back through their pages ``tables``; the final hidden states ``[N, H]``."""
        dev = tokens_N.device
        width = max(len(t) for t in tables)
        M = max(m for _, m, _ in spans)
        rows_BM = torch.full((len(spans), M), -1, dtype=torch.long, device=dev)
        qpos_BM = torch.zeros(len(spans), M, dtype=torch.long, device=dev)
        table_BP = torch.zeros(len(spans), width, dtype=torch.long, device=dev)
        for i, ((start, m, kv), pages) in enumerate(zip(spans, tables)):
            rows_BM[i, :m] = torch.arange(start, start + m, device=dev)
            qpos_BM[i, :m] = torch.arange(kv, kv + m, device=dev)
            table_BP[i, : len(pages)] = pages
        return self.hidden(tokens_N, pos_N, PagedKV(cache, slot_N, rows_BM, qpos_BM, table_BP))

    def decode(self, cache, tok_S, pos_S, table_SP) -> torch.Tensor:
        """``ModelForward.decode``: one token per row at ``pos_S``, its K/V written to the row cache (when there is
        one) or to its page; attention over the row's keys ``[0, pos]``; returns the logits ``[S, V]`` fp32."""
        ps = cache.kv.shape[4]
        if cache.rows is not None:
            context = RowKV(cache.rows, pos_S, table_SP.shape[1] * ps)
        else:
            page_S = table_SP.gather(1, (pos_S // ps)[:, None]).squeeze(1).long()
            rows = torch.arange(tok_S.shape[0], device=tok_S.device)[:, None]
            context = PagedKV(cache, page_S * ps + pos_S % ps, rows, pos_S[:, None], table_SP.long())
        return self.logits(self.hidden(tok_S, pos_S, context))
