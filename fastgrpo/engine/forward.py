"""The model runner's arithmetic: the forward pieces of the engine's device step, read from the model's own parameter
tensors (``ModelForward``): the layer's projections (with unmerged LoRA adapters), the packed prefill and the
prefill onto cached K/V, the decode forward (paged kernel, row cache or pages), the MLP, the final norm and the
fp32 LM head. The elementwise ops are ``fastgrpo.engine.ops``; the CPU products' buffers and MKL packs are
``fastgrpo.engine.workspace``.

Tensor names carry their shape: S rows (running samples), P block-table width, N packed tokens, M rows, H hidden,
V vocabulary, Hq/Hkv query/key-value heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from fastgrpo.engine.batch_invariant import BatchInvariantForward
from fastgrpo.engine.cache import KVCache
from fastgrpo.engine.moe import EngineMoE
from fastgrpo.engine.ops import EAGER_OPS, Ops
from fastgrpo.engine.workspace import Workspace, linear_t, packed_linear
from fastgrpo.kernels.decode_attention import masked_attention, paged_decode_attention, paged_decode_attention_torch
from fastgrpo.models.lora import lora_terms
from fastgrpo.models.moe import is_moe
from fastgrpo.models.vlm import text_config, text_decoder

LM_HEAD_CHUNK = 8192  # vocabulary rows per fp32 product of the LM head off CUDA (bounds the upcast weight copy)


class ModelForward:
    """The forward pieces of a supported causal LM (checked by ``GenerationEngine``), read from its own modules.

    ``compile``: fuse the elementwise ops with ``torch.compile`` (None: on CUDA only; compiled once, on first use).
    ``read_adapters`` / ``clear_adapters`` bracket one ``generate`` call (the LoRA adapters do not change within it).
    ``batch_invariant``: prefill, decode and the LM head run the model's own decoder on the batch-invariant ops
    (``invariant``: ``fastgrpo.engine.batch_invariant.BatchInvariantForward``; hidden states after the final norm).
    """

    def __init__(self, model: torch.nn.Module, compile: bool | None, batch_invariant: bool = False):
        inner = text_decoder(model)  # a VLM's language model (fastgrpo.models.vlm)
        config = text_config(model)
        self.model = model
        self.inner = inner
        self.vocab_size = inner.embed_tokens.num_embeddings
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.qk_norm = getattr(attn, "q_norm", None) is not None  # Qwen3
        self.silu = getattr(config, "hidden_act", None) == "silu"
        self.moe = EngineMoE(model) if is_moe(model) else None  # the sparse MoE blocks (fastgrpo.engine.moe)
        self._compile = compile
        self._compiled_ops: Ops | None = None
        self._lora: dict = {}  # projection module -> its live LoRA adapters ((A, B, s), ...), read once per call
        self.invariant = BatchInvariantForward(model, self.moe) if batch_invariant else None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K/V one token takes in the page pool: ``2 · layers · Hkv · D · element size``."""
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def read_adapters(self) -> None:
        """Read every projection's live LoRA adapters (:func:`fastgrpo.models.lora.lora_terms`) for one ``generate``
        call, in which they do not change: the step then looks them up instead of walking PEFT's properties at every
        layer and step; empty for a model without adapters."""
        self._lora = {m: t for layer in self.layers for m in layer.modules() if (t := lora_terms(m))}

    def clear_adapters(self) -> None:
        """Forget the call's adapters: the next call reads them afresh."""
        self._lora = {}

    def autocast(self, device: torch.device, dtype: torch.dtype, param_dtype: torch.dtype):
        if dtype == param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype, cache_enabled=False)

    def rope_tables(self, length: int, device: torch.device, dtype: torch.dtype):
        """cos/sin ``[T, D]`` from the model's own rotary module (its inv_freq and attention scaling)."""
        probe = torch.empty(1, device=device, dtype=dtype)
        positions = torch.arange(length, device=device).unsqueeze(0)  # [1, T]
        cos, sin = self.inner.rotary_emb(probe, positions)
        return cos[0].to(dtype), sin[0].to(dtype)  # [T, D]

    def elementwise_ops(self, device: torch.device) -> Ops:
        """The elementwise helpers: compiled (fused kernels) on CUDA unless ``compile=False``, eager elsewhere and in
        the batch-invariant mode (whose forward does not take them: nothing compiled)."""
        want = device.type == "cuda" if self._compile is None else self._compile
        if not want or self.invariant is not None:
            return EAGER_OPS
        if self._compiled_ops is None:
            self._compiled_ops = Ops(*(torch.compile(f, dynamic=True, fullgraph=True) for f in EAGER_OPS))
        return self._compiled_ops

    def attn_in(self, ops: Ops, layer, h, cos, sin, dtype):
        """Projections + (Qwen3) q/k RMSNorm + rotary for rows ``h [M, H]`` → q [M, Hq, D], k/v [M, Hkv, D]."""
        attn = layer.self_attn
        M = h.shape[0]
        lora = self._lora
        q = _proj(h, attn.q_proj, lora).view(M, self.num_heads, self.head_dim)
        k = _proj(h, attn.k_proj, lora).view(M, self.num_kv_heads, self.head_dim)
        v = _proj(h, attn.v_proj, lora).view(M, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = ops.rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
            k = ops.rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        q, k = ops.rope_qk(q, k, cos, sin)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def attn_in_rows(self, ops: Ops, layer, h, cos, sin_signed, work: Workspace):
        """:meth:`attn_in` for the CPU decode step: the q, k, v projections of ``h [S, H]`` side by side in one
        row-major ``[S, (Hq + 2 Hkv) · D]`` tensor (:meth:`qkv_rows`), (Qwen3) q/k RMSNorm, and the rotary embedding
        of q and k in place there; returns the views q ``[S, Hkv, G, D]`` and k/v ``[S, 2, Hkv, D]`` (unit stride
        on D).

        Rotary in place, bit for bit Hugging Face's ``x·cos + rotate_half(x)·sin``: ``rotate_half(x) = [−x₂, x₁]``,
        so ``rotate_half(x)·sin = [x₂, x₁]·[−sin₁, sin₂]`` (``sin_signed``, the same products up to the sign):
        one swap of halves, two products and one sum for q and k together, instead of those for each, and k, v then go
        to the row cache in one write."""
        attn = layer.self_attn
        S = h.shape[0]
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_rows(attn, h, work).view(S, Hq + 2 * Hkv, D)
        qk = qkv[:, : Hq + Hkv]
        if self.qk_norm:
            qk[:, :Hq] = ops.rms_norm(qk[:, :Hq], attn.q_norm.weight, attn.q_norm.variance_epsilon)
            qk[:, Hq:] = ops.rms_norm(qk[:, Hq:], attn.k_norm.weight, attn.k_norm.variance_epsilon)
        swapped = torch.cat((qk[..., D // 2 :], qk[..., : D // 2]), dim=-1)  # [x₂, x₁]
        qk.mul_(cos).add_(swapped.mul_(sin_signed))
        return qkv[:, :Hq].view(S, Hkv, Hq // Hkv, D), qkv[:, Hq:].unflatten(1, (2, Hkv))

    def qkv_rows(self, attn, h_SH: torch.Tensor, work: Workspace) -> torch.Tensor:
        """``[q | k | v]`` of rows ``h``, row-major ``[S, (Hq + 2 Hkv) · D]``. With q/k/v packed (``work.packed``):
        one product on the three weights stacked (and their biases; a missing one as zeros, which add exactly
        nothing), packed for MKL (``packed_linear``; the stacked copy made on the call's first use, kept in
        ``work.packs[attn]``), then each LoRA adapter's ``s · (h Aᵀ) Bᵀ`` added to its projection's columns;
        otherwise three products and a concatenation (the same values at bench_generation's sizes: its token hash
        unchanged)."""
        lora, mods = self._lora, (attn.q_proj, attn.k_proj, attn.v_proj)
        if "qkv" not in work.packed:
            return torch.cat([_proj(h_SH, m, lora) for m in mods], 1)
        stacked = work.packs.get(attn)
        if stacked is None:
            biases = [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]
            bias = None if all(m.bias is None for m in mods) else torch.cat(biases)
            stacked = work.packs[attn] = (torch.cat([m.weight for m in mods]), bias, {})
        weight, bias, by_rows = stacked
        qkv = packed_linear(h_SH, weight, bias, by_rows)
        n0 = 0
        for m in mods:
            n1 = n0 + m.weight.shape[0]
            _add_lora(qkv[:, n0:n1], h_SH, lora.get(m, ()))
            n0 = n1
        return qkv

    def attn_out_mlp(self, ops: Ops, layer, x, o_MQ, work: Workspace | None = None):
        """``x + o_proj(o)``, then the MLP on its post-attention norm; returns (new residual, MLP output)."""
        attn, ln2 = layer.self_attn, layer.post_attention_layernorm
        o = _proj(o_MQ, attn.o_proj, self._lora)
        x, h = ops.add_rms_norm(x, o, ln2.weight, ln2.variance_epsilon)
        return x, self.mlp(ops, layer.mlp, h, work)

    def mlp(self, ops: Ops, mlp, h_MH: torch.Tensor, work: Workspace | None = None) -> torch.Tensor:
        """``down(act(gate(h)) · up(h))``. With a workspace: the products on the MLP's packed weights
        (``packed_linear``, when ``work.packed`` holds it) or into the workspace's buffers, the activation in place
        (the same values). A sparse MoE block: :meth:`fastgrpo.engine.moe.EngineMoE.block`."""
        if self.moe is not None and self.moe.owns(mlp):
            return self.moe.block(mlp, h_MH, ops, functools.partial(_proj, lora=self._lora))
        lora = self._lora
        if work is not None and "mlp" in work.packed:  # fresh row-major [M, I], then in place
            gate = _proj(h_MH, mlp.gate_proj, lora, packs=work.packs)
            up = _proj(h_MH, mlp.up_proj, lora, packs=work.packs)
            act = (F.silu(gate, inplace=True) if self.silu else mlp.act_fn(gate)).mul_(up)
            return _proj(act, mlp.down_proj, lora, packs=work.packs)
        if work is None or work.gate is None:
            gate = _proj(h_MH, mlp.gate_proj, lora)
            up = _proj(h_MH, mlp.up_proj, lora)
            act = ops.silu_mul(gate, up) if self.silu else mlp.act_fn(gate) * up
            return _proj(act, mlp.down_proj, lora)
        gate = _proj(h_MH, mlp.gate_proj, lora, work.gate)  # [M, I] feature-major views
        up = _proj(h_MH, mlp.up_proj, lora, work.up)
        act = (F.silu(gate, inplace=True) if self.silu else mlp.act_fn(gate)).mul_(up)
        return _proj(act, mlp.down_proj, lora, work.down)

    def norm_in(self, ops: Ops, layer, x, delta):
        """Input norm of a layer, fused with the previous layer's MLP residual add when there is one."""
        ln1 = layer.input_layernorm
        if delta is None:
            return x, ops.rms_norm(x, ln1.weight, ln1.variance_epsilon)
        return ops.add_rms_norm(x, delta, ln1.weight, ln1.variance_epsilon)

    def prefill(self, ops, tokens_N, pos_N, groups, cos_TD, sin_TD, cache, slot_N, dtype, embeds_NH=None):
        """Packed prefill of prompts sorted into equal-length groups; returns the last residual stream ``[N, H]``
        (before the final norm). ``embeds_NH``: the input embeddings instead of the tokens' (images in a VLM's
        prompts, ``fastgrpo.engine.vision``).

        ``groups``: ``(start, count, length)`` = ``count`` prompts of ``length`` tokens at ``start`` in the row.
        Token i's K/V go to flat slot ``slot_N[i]`` of the page pool (page · page_size + offset). Its attention reads
        the same K/V values it writes (the fresh tensors, before the write), so it equals attention through the pages.
        """
        if self.invariant is not None:
            return self.invariant.prefill(tokens_N, pos_N, groups, cache, slot_N)
        G = self.num_heads // self.num_kv_heads

        def attend(li, q, k, v):
            out = torch.empty_like(q)  # [N, Hq, D]
            for start, count, length in groups:
                end = start + count * length
                qg = q[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
                kg = k[start:end].view(count, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
                vg = v[start:end].view(count, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
                if G > 1:  # query head h reads kv head h // G (Hugging Face's repeat_kv)
                    kg, vg = kg.repeat_interleave(G, dim=1), vg.repeat_interleave(G, dim=1)
                og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=self.scale)  # [c, Hq, len, D]
                out[start:end] = og.transpose(1, 2).reshape(count * length, self.num_heads, self.head_dim)
            return out

        x, delta = self.run_layers(ops, tokens_N, pos_N, cos_TD, sin_TD, cache, slot_N, dtype, attend,
                                   embeds_NH=embeds_NH)
        return x + delta

    def prefill_onto(self, ops, tokens_N, pos_N, spans, tables, cos_TD, sin_TD, cache, slot_N, dtype):
        """Packed prefill of new tokens of sequences whose earlier K/V are already in their pages (a resumed turn's
        appended tokens: a chunked prefill, nothing before them recomputed); returns the last residual stream
        ``[N, H]`` (before the final norm).

        ``spans``: ``(start, count, kv)`` per sequence: its ``count`` tokens at ``start`` in the row sit at positions
        ``kv .. kv + count - 1``; ``tables``: its pages (int64) covering positions ``[0, kv + count)``. Each layer
        writes the new K/V to their slots first, then each sequence's queries attend to its keys ``[0, kv + count)``
        read back through its pages, causally (query at position p reads keys ``<= p``): the explicit mask
        ``[count, kv + count]`` goes to SDPA (on CUDA its memory-efficient kernel, no scores stored; on CPU the
        math path holds ``Hq · count · (kv + count)`` fp32 scores per layer, a few MiB for an observation of a few
        hundred tokens in a few thousand).
        """
        if self.invariant is not None:
            return self.invariant.prefill_onto(tokens_N, pos_N, spans, tables, cache, slot_N)
        G, Hkv, D = self.num_heads // self.num_kv_heads, self.num_kv_heads, self.head_dim
        masks = [
            torch.arange(kv + m, device=tokens_N.device) <= torch.arange(kv, kv + m, device=tokens_N.device)[:, None]
            for _, m, kv in spans
        ]  # [count, kv + count] bool: True = attend

        def attend(li, q, k, v):  # after the layer's write: the new K/V are in the pages too
            out = torch.empty_like(q)  # [N, Hq, D]
            for (start, m, kv), pages, mask in zip(spans, tables, masks):
                L = kv + m
                kg = cache.k[li][:, pages].reshape(Hkv, -1, D)[:, :L]  # [Hkv, L, D]
                vg = cache.v[li][:, pages].reshape(Hkv, -1, D)[:, :L]
                if G > 1:  # query head h reads kv head h // G (Hugging Face's repeat_kv)
                    kg, vg = kg.repeat_interleave(G, dim=0), vg.repeat_interleave(G, dim=0)
                qg = q[start : start + m].transpose(0, 1)  # [Hq, m, D]
                og = F.scaled_dot_product_attention(qg[None], kg[None], vg[None], attn_mask=mask, scale=self.scale)
                out[start : start + m] = og[0].transpose(0, 1)  # [m, Hq, D]
            return out

        x, delta = self.run_layers(ops, tokens_N, pos_N, cos_TD, sin_TD, cache, slot_N, dtype, attend)
        return x + delta

    def run_layers(self, ops, tokens_N, pos_N, cos_TD, sin_TD, cache, slot_N, dtype, attend, work=None,
                   embeds_NH=None):
        """The layers on ``N`` tokens at positions ``pos_N`` through the pages: per layer the input norm, q/k/v
        and rotary, the K/V written to flat slots ``slot_N``, ``attend(layer index, q [N, Hq, D], k, v [N, Hkv, D])
        -> [N, Hq, D]``, o_proj and the MLP; returns ``(residual, last MLP output)`` (their sum is the last residual
        stream, before the final norm)."""
        N = tokens_N.shape[0]
        cos, sin = cos_TD[pos_N].unsqueeze(1), sin_TD[pos_N].unsqueeze(1)  # [N, 1, D]
        x = self.inner.embed_tokens(tokens_N) if embeds_NH is None else embeds_NH  # [N, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self.norm_in(ops, layer, x, delta)
            q, k, v = self.attn_in(ops, layer, h, cos, sin, dtype)  # [N, Hq, D], [N, Hkv, D]
            cache.write(li, slot_N, k, v)
            x, delta = self.attn_out_mlp(ops, layer, x, attend(li, q, k, v).reshape(N, -1), work)
        return x, delta

    def logits(self, ops, residual_PH: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:  # its prefill's hidden states are after the final norm
            return self.invariant.logits(residual_PH)
        norm = self.inner.norm
        return self.lm_head(ops.rms_norm(residual_PH, norm.weight, norm.variance_epsilon))  # [P, V] fp32

    def lm_head(self, h_MH: torch.Tensor, work: Workspace | None = None) -> torch.Tensor:
        """``logits = h Wᵀ (+ b)`` ``[M, V]``, accumulated and returned in fp32 like the training kernels' (never
        rounded to bf16 before the softmax). bf16/fp16 on CUDA: cuBLAS with an fp32 output (``torch.mm``'s
        ``out_dtype``), the weights read once in their own dtype; elsewhere fp32 products over vocabulary chunks of
        ``LM_HEAD_CHUNK`` rows (one chunk of the weight upcast at a time). With the decode step's workspace (off
        CUDA, no autocast), fp32: MKL's packed GEMM (``packed_linear``, row-major logits) when the workspace packs
        the LM head (``work.packed``), else the product ``W hᵀ`` into the workspace's buffer, the logits its
        feature-major ``[M, V]`` view (``linear_t``)."""
        weight_VH, bias_V = self.model.lm_head.weight, self.model.lm_head.bias
        out = None if work is None else work.logits
        with torch.autocast(h_MH.device.type, enabled=False):
            if h_MH.dtype == weight_VH.dtype == torch.float32:
                if work is not None and "lm_head" in work.packed:
                    return packed_linear(h_MH, weight_VH, bias_V, work.packs.setdefault(self.model.lm_head, {}))
                return F.linear(h_MH, weight_VH, bias_V) if out is None else linear_t(h_MH, weight_VH, bias_V, out)
            if h_MH.is_cuda:
                logits_MV = torch.mm(h_MH, weight_VH.to(h_MH.dtype).t(), out_dtype=torch.float32)
                return logits_MV if bias_V is None else logits_MV + bias_V.float()
            M, V = h_MH.shape[0], weight_VH.shape[0]
            h32 = h_MH.float()
            logits_VM = torch.empty(V, M, device=h_MH.device) if out is None else out[: V * M].view(V, M)
            for v0 in range(0, V, LM_HEAD_CHUNK):
                w_CH = weight_VH[v0 : v0 + LM_HEAD_CHUNK].float()
                torch.mm(w_CH, h32.t(), out=logits_VM[v0 : v0 + LM_HEAD_CHUNK])
            if bias_V is not None:
                logits_VM += bias_V.float()[:, None]
            return logits_VM.t()

    # ------------------------------------------------------------------ the decode forward

    def decode(self, ops, cache: KVCache, tok_S, pos_S, table_SP, cos_TD, sin_TD, dtype, rope_S=None) -> torch.Tensor:
        """One decode step for rows ``[0, S)``: feed ``tok_S`` at ``pos_S``, write its K/V into the row's page, return
        logits ``[S, V]`` (fp32; with a workspace whose LM head is not packed, a feature-major view of
        ``cache.work.logits``: strides (1, S)).

        Static shapes and no host synchronisation, so it can be captured in a CUDA graph. Attention reads the keys
        ``[0, pos]`` of each row (the query's own key included): without a workspace (``cache.work`` None: the
        paged kernel runs, CUDA) through its block table ``table_SP`` by the Triton kernel; with one (CPU), from the
        row cache (:meth:`decode_rows`) when there is one, its first ``P · page_size`` columns (the engine passes
        only the table columns the longest row uses), else through the pages by the torch path. ``rope_S``: each
        row's rotary position minus its cache position (M-RoPE's ``rope_delta``, ``fastgrpo.engine.vision``; None: 0).
        """
        if self.invariant is not None:
            return self.invariant.decode(cache, tok_S, pos_S, table_SP)
        work = cache.work  # None: the paged kernel (CUDA)
        ps = cache.kv.shape[4]
        if cache.rows is not None:
            return self.decode_rows(ops, cache, tok_S, pos_S, table_SP.shape[1] * ps, cos_TD, sin_TD, dtype, rope_S)
        page_S = table_SP.gather(1, (pos_S // ps)[:, None]).squeeze(1).long()
        slot_S = page_S * ps + pos_S % ps  # flat index of the new token's K/V in the pool
        S = tok_S.shape[0]
        G = self.num_heads // self.num_kv_heads
        length_S = pos_S + 1  # keys [0, pos] are live, the current one included
        # the torch path off CUDA: paged_decode_attention would run the kernel under TRITON_INTERPRET=1
        attention = paged_decode_attention if work is None else paged_decode_attention_torch

        def attend(li, q, k, v):  # the G query heads of one kv head act as G query rows (no K/V repeat)
            k_pages, v_pages = cache.pages(li)  # [pages, page_size, Hkv, D]
            q4 = q.view(S, self.num_kv_heads, G, self.head_dim)
            return attention(q4, k_pages, v_pages, table_SP, length_S, softmax_scale=self.scale)  # [S, Hkv, G, D]

        rot_S = pos_S if rope_S is None else pos_S + rope_S
        x, delta = self.run_layers(ops, tok_S, rot_S, cos_TD, sin_TD, cache, slot_S, dtype, attend, work)
        return self.final_logits(ops, x, delta, work)

    def decode_rows(self, ops, cache: KVCache, tok_S, pos_S, T, cos_TD, sin_TD, dtype, rope_S=None) -> torch.Tensor:
        """The decode step on the CPU row cache: each layer writes the token's K/V to its row
        (``work.kv_rows[layer, row, :, :, pos]``; the pages get them when the sequence leaves the row keeping them,
        ``fastgrpo.engine.cache.RowCache.flush``), then attends over the row's first ``T`` keys, those past ``pos``
        masked (:func:`masked_attention`). Without autocast the projections and the rotary embedding run on q, k, v
        side by side (:meth:`attn_in_rows`)."""
        work = cache.work
        S = tok_S.shape[0]
        Hkv, G, D = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        rows_S = torch.arange(S, device=tok_S.device)
        # additive mask, 0 where live, -inf past pos: SDPA turns a boolean one into this at every call (6 ops)
        dead_S11T = torch.arange(T, device=tok_S.device) > pos_S[:, None]
        mask_S11T = torch.zeros(S, 1, 1, T, device=tok_S.device).masked_fill_(dead_S11T.view(S, 1, 1, T), -math.inf)
        rot_S = pos_S if rope_S is None else pos_S + rope_S
        cos, sin = cos_TD[rot_S].unsqueeze(1), sin_TD[rot_S].unsqueeze(1)  # [S, 1, D]
        joint = dtype == self.layers[0].self_attn.q_proj.weight.dtype  # no autocast: q, k, v side by side
        if joint:
            sin_signed = torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), dim=-1)
        x = self.inner.embed_tokens(tok_S)  # [S, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self.norm_in(ops, layer, x, delta)
            if joint:
                q4, kv = self.attn_in_rows(ops, layer, h, cos, sin_signed, work)  # [S, Hkv, G, D], [S, 2, Hkv, D]
            else:
                q, k, v = self.attn_in(ops, layer, h, cos, sin, dtype)
                q4, kv = q.view(S, Hkv, G, D), torch.stack((k, v), 1)
            kv_rows = work.kv_rows[li]  # [R, 2, Hkv, T_max, D]
            kv_rows[rows_S, :, :, pos_S] = kv
            o = masked_attention(q4, kv_rows[:S, 0, :, :T], kv_rows[:S, 1, :, :T], mask_S11T, self.scale)
            x, delta = self.attn_out_mlp(ops, layer, x, o.reshape(S, -1), work)  # o: [S, Hkv, G, D]
        return self.final_logits(ops, x, delta, work)

    def final_logits(self, ops, x, delta, work) -> torch.Tensor:
        norm = self.inner.norm
        _, h = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        return self.lm_head(h, work)  # [S, V] fp32


def _proj(x_MK: torch.Tensor, module: torch.nn.Module, lora: dict, out: torch.Tensor | None = None,
          packs: dict | None = None) -> torch.Tensor:
    """A projection of the model on rows ``x [M, K]``: ``x Wᵀ + b`` from the module's own tensors, plus, for a PEFT
    LoRA layer, each live adapter's ``s · (x Aᵀ) Bᵀ`` (never merged: ``W`` stays the loaded base; ``lora``: the
    call's adapters, ``ModelForward.read_adapters``). The adapter costs ``x Aᵀ`` ``[M, r]`` then ``· Bᵀ``, batched
    over the rows.

    Without ``out``: PEFT's own order (``y + ((x Aᵀ) Bᵀ) · s``, each product rounded to its operands' dtype), the
    path of CUDA and its graphs. With ``out`` (the CPU workspace): ``W xᵀ`` into the buffer (``linear_t``); with
    ``packs`` (the CPU workspace's, fp32 with MKL): ``packed_linear`` of the base weight; either then
    ``+= s · (x Aᵀ) Bᵀ`` in place (:func:`_add_lora`). All differ by rounding only.

    An adapter in another dtype than the base (PEFT's default ``autocast_adapter_dtype=True`` keeps fp32 adapters on
    a bf16 or fp16 base) runs as PEFT's ``lora.Linear.forward`` runs it: ``x`` cast to the adapter's dtype, the
    products and the sum with the base's output in the wider dtype, the result cast back to the base's dtype."""
    terms = lora.get(module, ())
    if packs is not None or out is not None:
        if packs is not None:
            y_MN = packed_linear(x_MK, module.weight, module.bias, packs.setdefault(module, {}))
        else:
            y_MN = linear_t(x_MK, module.weight, module.bias, out)
        return _add_lora(y_MN, x_MK, terms)
    y = F.linear(x_MK, module.weight, module.bias)
    base_dtype = y.dtype
    for A_RK, B_NR, s in terms:
        y = y + F.linear(F.linear(x_MK.to(A_RK.dtype), A_RK), B_NR) * s
    return y.to(base_dtype)


def _add_lora(y_MN: torch.Tensor, x_MK: torch.Tensor, terms) -> torch.Tensor:
    """``y += s · (x Aᵀ) Bᵀ`` in place for each adapter ``(A [r, K], B [N, r], s)`` of ``terms``, ``y [M, N]`` of any
    strides (a feature-major buffer, a column slice: ``addmm_`` writes through them). An adapter in ``y``'s dtype: one
    ``addmm``; in another (fp32 adapters on a bf16 base): the products in the adapter's dtype on ``x`` cast to it,
    then added to ``y`` in the wider dtype and rounded once to ``y``'s, as PEFT does. Returns ``y``."""
    for A_RK, B_NR, s in terms:
        xA_MR = torch.mm(x_MK.to(A_RK.dtype), A_RK.t())
        if A_RK.dtype == y_MN.dtype:
            y_MN.addmm_(xA_MR, B_NR.t(), alpha=s)
        else:
            y_MN.add_(torch.mm(xA_MR, B_NR.t()), alpha=s)
    return y_MN
