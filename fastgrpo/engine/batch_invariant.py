"""The engine's forward in ``numerics.batch_invariant`` mode (``GenerationEngine(batch_invariant=True)``): the
decoder of a dense Llama / Qwen2 / Qwen3 or a Qwen3-MoE / Qwen2-MoE computed here, op for op as its Hugging Face
modules compute it on the batch-invariant ops (``fastgrpo.kernels.batch_invariant``), with K/V through the engine's
cache.

Every forward of a call (a packed prefill, a prefill onto cached K/V, a decode step on pages or on the CPU row
cache) runs the decoder on a row of ``N`` tokens at their positions. The trainer's packed forward runs the Hugging
Face modules on the same ops (``fastgrpo.algorithms.forward.packed_forward``): the overrides of ``aten::addmm`` /
``mm`` / ``silu`` / ``mean`` turn each module's product, activation and RMSNorm mean into the exact ones, and its
``fastgrpo_varlen`` attention into ``fastgrpo.kernels.batch_invariant_attention``. This file makes the same calls in
the same order with the same dtypes, without the modules' Python layers (hooks, keyword plumbing, output capture: on
the demo's model they cost more than the arithmetic), and with what the modules cannot share: the input grid of the
q, k and v projections made once (as the gate's and up's), the weights' grids kept (``keep_weight_grids``: for the
call, or for the trainer's run when it keeps them), the row cache's value grids kept across decode steps
(:class:`KeptValueGrids`). Every op gives a row the same value whatever else is in the call
(exact products and sums, elementwise ops), so a token's hidden state, logits and log-prob are the trainer's, bit
for bit, under every schedule (tests/test_bitwise.py).

The modules' order, as transformers 5 writes it: ``x = embed(tokens)``; ``cos, sin = rotary_emb(x, positions)``;
per layer ``h = norm₁(x)``; ``q, k, v = h Wᵀ + b`` (views ``[N, heads, D]``; Qwen3: RMSNorm over ``D`` of q and k);
``q, k = q cos + rotate_half(q) sin, …``; ``x = x + o_proj(attention)``; ``x = x + down(silu(gate(norm₂(x))) ·
up(norm₂(x)))`` (an MoE layer: ``x = x + block(norm₂(x))``, :meth:`BatchInvariantForward.moe_block`, the router
and the experts ``fastgrpo.kernels.batch_invariant_moe``'s functions, which the trainer's router hook and experts
interface call too); the final norm; the LM head in fp32. RMSNorm: ``w · (x₃₂ · rsqrt(mean(x₃₂²) + eps)).to(dtype)``. A
LoRA projection is PEFT's ``y + B(A(x)) · s``, cast back to the base's dtype (``fastgrpo.models.lora.lora_terms``).

The LM head is :func:`fastgrpo.kernels.batch_invariant.linear` in fp32; the sampler's log-prob of the drawn token is
``logits[token] / T − logsumexp_tiles(logits / T)`` (``fastgrpo.engine.sampling.sample_tokens``), the trainer's
``fastgrpo.kernels.batch_invariant.linear_logprobs``.

Tensor names carry their shape: S rows, N packed tokens, P block-table width, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from fastgrpo.engine.moe import EngineMoE
from fastgrpo.engine.ops import rope
from fastgrpo.kernels import batch_invariant_moe
from fastgrpo.kernels.batch_invariant import (
    input_grid,
    invariant_forward,
    invariant_ops,
    keep_weight_grids,
    last_dim_mean,
    linear,
    sigmoid,
    silu,
    weight_grid,
)
from fastgrpo.kernels.batch_invariant_attention import (
    BIG_BLOCK,
    KEY_BLOCK,
    attention,
    big_value_grid,
    invariant_varlen,
    key_grid,
    small_value_grid,
)
from fastgrpo.models.lora import lora_terms


class PrefillKV:
    """A packed prefill's K/V: written to their flat slots, attention over the fresh packed tokens per sequence
    (``cu_seqlens``): the trainer's varlen attention."""

    def __init__(self, cache, slot_N: torch.Tensor, cu_seqlens: torch.Tensor):
        self.cache, self.slot_N, self.cu_seqlens = cache, slot_N, cu_seqlens

    def attend(self, layer: int, q_NHD, k_NHD, v_NHD, scale: float) -> torch.Tensor:
        k_NHD = key_grid(k_NHD)  # stored on their grid, as the attention reads them
        self.cache.write(layer, self.slot_N, k_NHD, v_NHD)
        return invariant_varlen(q_NHD, k_NHD, v_NHD, self.cu_seqlens, scale)  # [N, Hq, D]


class PagedKV:
    """K/V read back from the pages: the new tokens' K/V written to their slots first, then the queries of
    sequence ``i`` (rows ``rows[i]`` of the call, at positions ``qpos[i]``) attend over its pages ``tables[i]``
    (positions ``[0, keys)``, ``keys`` = the widest table's). Queries of one sequence, padded to the longest."""

    def __init__(self, cache, slot_N: torch.Tensor, rows_BM: torch.Tensor, qpos_BM: torch.Tensor,
                 table_BP: torch.Tensor):
        self.cache, self.slot_N, self.rows_BM, self.qpos_BM, self.table_BP = cache, slot_N, rows_BM, qpos_BM, table_BP

    def attend(self, layer: int, q_NHD, k_NHD, v_NHD, scale: float) -> torch.Tensor:
        self.cache.write(layer, self.slot_N, key_grid(k_NHD), v_NHD)
        kv = self.cache.kv[layer][:, :, self.table_BP]  # [2, Hkv, B, P, page_size, D]
        _, Hkv, B, P, ps, D = kv.shape
        k, v = kv.permute(0, 2, 1, 3, 4, 5).reshape(2, B, Hkv, P * ps, D)
        o_BHMD = attention(q_NHD[self.rows_BM].transpose(1, 2), k, v, self.qpos_BM, scale)
        out = q_NHD.new_empty(q_NHD.shape)  # [N, Hq, D]
        live = self.rows_BM >= 0
        out[self.rows_BM[live]] = o_BHMD.transpose(1, 2)[live]
        return out


class KeptValueGrids:
    """The CPU row cache's values on the grids a decode step reads them on (fp32 ``[layers, R, Hkv, T_max, D]``, half
    the bytes of an fp32 row cache), kept across the decode steps of a call so that a step reads them instead of
    making them again: for a row whose query is at ``p``, its big blocks below ``p_B = 64 ⌊p / 64⌋`` on theirs
    (``big_value_grid``), its small blocks in ``[p_B, 8 ⌊p / 8⌋)`` on theirs (``small_value_grid``). Row ``r`` holds
    them up to ``big[r]`` and ``small[r]`` keys; a step first makes those its query has passed since (a row passes a
    small block every 8 steps, a big block every 64, which then replaces its small blocks' grids), and all of a row's
    again when ``RowCache`` has loaded it anew (``KVCache.loads``: its keys and values were replaced; the decode
    step's own writes only append). Past ``small[r]`` a row may hold another row's or sequence's grids: finite values
    the attention masks. Memory: made (zero-filled) at each ``generate`` call and each session ``run`` that uses the
    row cache, it adds half an fp32 row cache's bytes, a bf16 one's own bytes: the mode's CPU K/V then takes up to
    1.5x (fp32) or 2x (bf16) the row cache (``fastgrpo.engine.workspace.make_workspace`` sizes the row cache alone)."""

    def __init__(self, kv_rows: torch.Tensor, loads: list[int]):
        L, R, _, Hkv, T, D = kv_rows.shape
        self.kv_rows = kv_rows
        self.grid = kv_rows.new_zeros(L, R, Hkv, T, D, dtype=torch.float32)
        self.big, self.small, self.loads = [0] * R, [0] * R, list(loads)

    def step(self, pos_S: torch.Tensor, loads: list[int]) -> tuple[list, list]:
        """Before a decode step of rows ``[0, S)`` at ``pos``: the ``(row, first key)`` of the big blocks and of the
        small blocks whose grids it makes (in that order: a passed big block's grid replaces its small blocks');
        marks them made."""
        big, small = [], []
        for r, p in enumerate(pos_S.tolist()):
            p_big, p_small = p - p % BIG_BLOCK, p - p % KEY_BLOCK
            if loads[r] != self.loads[r] or p_small < self.small[r]:
                self.loads[r], self.big[r], self.small[r] = loads[r], 0, 0
            big += [(r, j) for j in range(self.big[r], p_big, BIG_BLOCK)]
            self.big[r] = max(self.big[r], p_big)
            small += [(r, j) for j in range(max(self.small[r], p_big), p_small, KEY_BLOCK)]
            self.small[r] = max(self.small[r], p_small)
        return big, small

    def make(self, layer: int, rows_RHTD: torch.Tensor, blocks: list, size: int, grid_fn) -> None:
        """The grids (``grid_fn``) of ``blocks`` (``(row, first key)``, ``size`` keys each) of the layer's values
        ``rows [R, Hkv, T, D]``, into the kept ones."""
        if not blocks:
            return
        dev = rows_RHTD.device
        r_n1 = torch.tensor([r for r, _ in blocks], device=dev)[:, None]
        keys_nK = torch.tensor([j for _, j in blocks], device=dev)[:, None] + torch.arange(size, device=dev)
        v_nHKD = rows_RHTD[r_n1, :, keys_nK].transpose(1, 2)  # [n, Hkv, size, D]
        self.grid[layer][r_n1, :, keys_nK] = grid_fn(v_nHKD).transpose(1, 2)


class RowKV:
    """The decode step on the CPU row cache: row ``s``'s token K/V written to ``kv_rows[layer, s, :, :, pos]``, then
    its query attends over the row's first ``T`` keys (those past ``pos`` are never read into its result), the values
    below its small block on their kept grids (:class:`KeptValueGrids`, when given)."""

    def __init__(self, kv_rows, pos_S: torch.Tensor, T: int, kept: KeptValueGrids | None = None,
                 loads: list[int] | None = None):
        self.kv_rows, self.pos_S, self.T, self.kept = kv_rows, pos_S, T, kept
        self.todo = kept.step(pos_S, loads) if kept is not None else ([], [])

    def attend(self, layer: int, q_SHD, k_SHD, v_SHD, scale: float) -> torch.Tensor:
        S = q_SHD.shape[0]
        rows = self.kv_rows[layer]  # [R, 2, Hkv, T_max, D]
        rows[torch.arange(S), :, :, self.pos_S] = torch.stack((key_grid(k_SHD), v_SHD), 1)  # keys on their grid
        k, v = rows[:S, 0, :, : self.T], rows[:S, 1, :, : self.T]  # [S, Hkv, T, D]
        v_kept = None
        if self.kept is not None:
            big, small = self.todo
            self.kept.make(layer, rows[:, 1], big, BIG_BLOCK, big_value_grid)
            self.kept.make(layer, rows[:, 1], small, KEY_BLOCK, small_value_grid)
            v_kept = self.kept.grid[layer, :S, :, : self.T]
        o = attention(q_SHD[:, :, None], k, v, self.pos_S[:, None], scale, v_kept_BHLD=v_kept)  # [S, Hq, 1, D]
        return o[:, :, 0]


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm on the invariant mean: ``w · (x₃₂ · rsqrt(mean(x₃₂²) + eps)).to(x.dtype)``."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(last_dim_mean(x32.pow(2)) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


class BatchInvariantForward:
    """The engine's forward pieces in the batch-invariant mode (``ModelForward`` dispatches to it). Hidden states
    it returns are after the model's final norm (the decoder's output), so :meth:`logits` is the LM head alone."""

    def __init__(self, model: torch.nn.Module, moe: EngineMoE | None = None):
        self.model = model
        self.moe = moe  # an MoE model's blocks and the routing record's buffer
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.qk_norm = getattr(attn, "q_norm", None) is not None  # Qwen3
        self.lora: dict = {}  # projection module -> its live LoRA adapters, read once per call
        self.kept: KeptValueGrids | None = None  # the call's row cache's value grids

    @contextlib.contextmanager
    def calling(self):
        """One ``generate`` call (or session): the invariant ops registered, the weights' grids kept (for the call,
        or longer when the trainer keeps them), the LoRA adapters read."""
        self.lora = {m: t for layer in self.layers for m in layer.modules() if (t := lora_terms(m))}
        try:
            with invariant_ops(), keep_weight_grids(list(self.model.parameters())):
                yield
        finally:
            self.lora, self.kept = {}, None

    def proj(self, x_MK: torch.Tensor, x_grid: torch.Tensor | None, module: torch.nn.Module) -> torch.Tensor:
        """A projection ``x Wᵀ + b`` on the exact product (``x_grid``: ``x``'s grid when shared), then each LoRA
        adapter as PEFT adds it: ``y + B(A(x)) · s`` (its products the overrides' exact ones), cast to ``y``'s dtype."""
        y = linear(x_MK, module.weight, module.bias, grid=weight_grid(module.weight), x_grid=x_grid)
        terms = self.lora.get(module, ())
        for A_RK, B_NR, s in terms:
            y = y + F.linear(F.linear(x_MK.to(A_RK.dtype), A_RK), B_NR) * s
        return y.to(x_MK.dtype) if terms else y

    def layer(self, li: int, layer, x_NH: torch.Tensor, cos_N1D, sin_N1D, context) -> torch.Tensor:
        """One decoder layer on ``x [N, H]`` (module docstring), attention through ``context``."""
        attn, mlp = layer.self_attn, layer.mlp
        N, D = x_NH.shape[0], self.head_dim
        h_NH = rms_norm(layer.input_layernorm, x_NH)
        h_grid = input_grid(h_NH)
        q = self.proj(h_NH, h_grid, attn.q_proj).view(N, self.num_heads, D)
        k = self.proj(h_NH, h_grid, attn.k_proj).view(N, self.num_kv_heads, D)
        v = self.proj(h_NH, h_grid, attn.v_proj).view(N, self.num_kv_heads, D)
        if self.qk_norm:
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q, k = rope(q, cos_N1D, sin_N1D), rope(k, cos_N1D, sin_N1D)
        o_NQ = context.attend(li, q, k, v, self.scale).reshape(N, -1)  # [N, Hq · D]
        x_NH = x_NH + self.proj(o_NQ, None, attn.o_proj)
        h_NH = rms_norm(layer.post_attention_layernorm, x_NH)
        if self.moe is not None and self.moe.owns(mlp):
            return x_NH + self.moe_block(mlp, h_NH)
        h_grid = input_grid(h_NH)
        act = silu(self.proj(h_NH, h_grid, mlp.gate_proj)) * self.proj(h_NH, h_grid, mlp.up_proj)
        return x_NH + self.proj(act, None, mlp.down_proj)

    def moe_block(self, mlp, h_NH: torch.Tensor) -> torch.Tensor:
        """A sparse MoE block on ``h [N, H]`` as the trainer's forward runs it (``fastgrpo.models.moe``'s router hook
        and experts interface): the router's logits by the exact product, its weights and ids by
        ``batch_invariant_moe.route`` (recorded for router replay when the call records), the routed experts by
        ``batch_invariant_moe.experts``; a Qwen2-MoE's shared expert as its modules compute it,
        ``σ(h w_sᵀ) · down(silu(gate(h)) · up(h))`` added to the experts' output."""
        h_grid = input_grid(h_NH)
        gate = mlp.gate
        logits_NE = linear(h_NH, gate.weight, grid=weight_grid(gate.weight), x_grid=h_grid)
        w_NK, ids_NK = batch_invariant_moe.route(logits_NE, gate.top_k, gate.norm_topk_prob)
        self.moe.record(mlp, ids_NK)
        out_NH = batch_invariant_moe.experts(h_NH, mlp.experts.gate_up_proj, mlp.experts.down_proj, ids_NK, w_NK)
        shared = getattr(mlp, "shared_expert", None)
        if shared is None:
            return out_NH
        act = silu(self.proj(h_NH, h_grid, shared.gate_proj)) * self.proj(h_NH, h_grid, shared.up_proj)
        gate_N1 = sigmoid(self.proj(h_NH, h_grid, mlp.shared_expert_gate))
        return out_NH + gate_N1 * self.proj(act, None, shared.down_proj)

    def hidden(self, tokens_N: torch.Tensor, pos_N: torch.Tensor, context) -> torch.Tensor:
        """The decoder on one row of tokens at positions ``pos`` (the trainer's packed forward's values), attention
        through ``context``: the final hidden states ``[N, H]`` (after the final norm)."""
        decoder = self.decoder
        with invariant_forward():
            x_NH = decoder.embed_tokens(tokens_N)
            cos, sin = decoder.rotary_emb(x_NH[None], pos_N[None])  # [1, N, D] each, in x's dtype
            for li, layer in enumerate(self.layers):
                x_NH = self.layer(li, layer, x_NH, cos[0, :, None], sin[0, :, None], context)
            return rms_norm(decoder.norm, x_NH)

    def logits(self, hidden_MH: torch.Tensor) -> torch.Tensor:
        """The LM head, fp32 ``[M, V]``: :func:`fastgrpo.kernels.batch_invariant.linear` on the kept grid."""
        head = self.model.lm_head
        return linear(hidden_MH, head.weight, head.bias, out_dtype=torch.float32, grid=weight_grid(head.weight))

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
            if cache.loads is not None and (self.kept is None or self.kept.kv_rows is not cache.rows):
                self.kept = KeptValueGrids(cache.rows, cache.loads)
            context = RowKV(cache.rows, pos_S, table_SP.shape[1] * ps, self.kept, cache.loads)
        else:
            page_S = table_SP.gather(1, (pos_S // ps)[:, None]).squeeze(1).long()
            rows = torch.arange(tok_S.shape[0], device=tok_S.device)[:, None]
            context = PagedKV(cache, page_S * ps + pos_S % ps, rows, pos_S[:, None], table_SP.long())
        return self.logits(self.hidden(tok_S, pos_S, context))
