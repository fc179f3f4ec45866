"""The model pieces of the engine's device step: the layer's projections, attention of a packed prefill, the MLP, the
final norm and the fp32 LM head, read from the model's own parameter tensors (``_ModelPieces``, a base of
``fastgrpo.engine.engine.GenerationEngine``), and the elementwise ops ``torch.compile`` fuses on CUDA (``_Ops``).
The decode forward, which picks the attention path, is ``GenerationEngine._decode_forward``.
Tensor names carry their shape (the letters of ``fastgrpo.engine.engine``: N packed tokens, M rows, H hidden, V vocab).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from fastgrpo.models.lora import lora_terms

if TYPE_CHECKING:
    from fastgrpo.engine.cache import _Workspace

LM_HEAD_CHUNK = 8192  # vocabulary rows per fp32 product of the LM head off CUDA (bounds the upcast weight copy)


class _ModelPieces:
    """The forward pieces of :class:`~fastgrpo.engine.engine.GenerationEngine` (its attributes: model, layers, head
    counts, scale, qk_norm, silu, _compile, _compiled_ops)."""

    _lora: dict = {}  # projection module -> its live LoRA adapters ((A, B, s), ...), read once per generate call

    def _read_adapters(self) -> None:
        """Read every projection's live LoRA adapters (:func:`fastgrpo.models.lora.lora_terms`) for one ``generate``
        call,
        in which they do not change: the step then looks them up instead of walking PEFT's properties (~20 µs a
        projection) at every layer and step; empty for a model without adapters."""
        self._lora = {m: t for layer in self.layers for m in layer.modules() if (t := lora_terms(m))}

    def _autocast(self, device: torch.device, dtype: torch.dtype, param_dtype: torch.dtype):
        if dtype == param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype, cache_enabled=False)

    def _rope_tables(self, length: int, device: torch.device, dtype: torch.dtype):
        """cos/sin ``[T, D]`` from the model's own rotary module (its inv_freq and attention scaling)."""
        probe = torch.empty(1, device=device, dtype=dtype)
        positions = torch.arange(length, device=device).unsqueeze(0)  # [1, T]
        cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0].to(dtype), sin[0].to(dtype)  # [T, D]

    def _ops(self, device: torch.device) -> _Ops:
        """The elementwise helpers: compiled (fused kernels) on CUDA unless ``compile=False``, eager elsewhere."""
        want = device.type == "cuda" if self._compile is None else self._compile
        if not want:
            return _EAGER_OPS
        if self._compiled_ops is None:
            self._compiled_ops = _Ops(*(torch.compile(f, dynamic=True, fullgraph=True) for f in _EAGER_OPS))
        return self._compiled_ops

    def _attn_in(self, ops: _Ops, layer, h, cos, sin, dtype):
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

    def _attn_in_rows(self, ops: _Ops, layer, h, cos, sin_signed, work: _Workspace):
        """:meth:`_attn_in` for the CPU decode step: the q, k, v projections of ``h [S, H]`` side by side in one
        row-major ``[S, (Hq + 2 Hkv) · D]`` tensor (:meth:`_qkv_rows`), (Qwen3) q/k RMSNorm, and the rotary embedding
        of q and k in place there; returns the views q ``[S, Hkv, G, D]`` and k/v ``[S, 2, Hkv, D]`` (unit stride
        on D).

        Rotary in place, bit for bit Hugging Face's ``x·cos + rotate_half(x)·sin``: ``rotate_half(x) = [−x₂, x₁]``,
        so ``rotate_half(x)·sin = [x₂, x₁]·[−sin₁, sin₂]`` (``sin_signed``, the same products up to the sign):
        one swap of halves, two products and one sum for q and k together, instead of those for each (17 against
        26 µs a layer at bench_generation's sizes), and k, v then go to the row cache in one write."""
        attn = layer.self_attn
        S = h.shape[0]
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv_rows(attn, h, work).view(S, Hq + 2 * Hkv, D)
        qk = qkv[:, : Hq + Hkv]
        if self.qk_norm:
            qk[:, :Hq] = ops.rms_norm(qk[:, :Hq], attn.q_norm.weight, attn.q_norm.variance_epsilon)
            qk[:, Hq:] = ops.rms_norm(qk[:, Hq:], attn.k_norm.weight, attn.k_norm.variance_epsilon)
        swapped = torch.cat((qk[..., D // 2 :], qk[..., : D // 2]), dim=-1)  # [x₂, x₁]
        qk.mul_(cos).add_(swapped.mul_(sin_signed))
        return qkv[:, :Hq].view(S, Hkv, Hq // Hkv, D), qkv[:, Hq:].unflatten(1, (2, Hkv))

    def _qkv_rows(self, attn, h_SH: torch.Tensor, work: _Workspace) -> torch.Tensor:
        """``[q | k | v]`` of rows ``h``, row-major ``[S, (Hq + 2 Hkv) · D]``. With q/k/v packed (``work.packed``):
        one product on the three weights stacked (and their biases; a missing one as zeros, which add exactly
        nothing), packed for MKL (``_packed_linear``; the stacked copy made on the call's first use, kept in
        ``work.packs[attn]``), then each LoRA adapter's ``s · (h Aᵀ) Bᵀ`` added to its projection's columns;
        otherwise three products and a concatenation. In the step on an Intel Xeon: 0.95x the call's time of the
        three products (in-process A/B), the same values at bench_generation's sizes (its token hash unchanged)."""
        lora, mods = self._lora, (attn.q_proj, attn.k_proj, attn.v_proj)
        if "qkv" not in work.packed:
            return torch.cat([_proj(h_SH, m, lora) for m in mods], 1)
        stacked = work.packs.get(attn)
        if stacked is None:
            biases = [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]
            bias = None if all(m.bias is None for m in mods) else torch.cat(biases)
            stacked = work.packs[attn] = (torch.cat([m.weight for m in mods]), bias, {})
        weight, bias, by_rows = stacked
        qkv = _packed_linear(h_SH, weight, bias, by_rows)
        n0 = 0
        for m in mods:
            n1 = n0 + m.weight.shape[0]
            _add_lora(qkv[:, n0:n1], h_SH, lora.get(m, ()))
            n0 = n1
        return qkv

    def _attn_out_mlp(self, ops: _Ops, layer, x, o_MQ, work: _Workspace | None = None):
        """``x + o_proj(o)``, then the MLP on its post-attention norm; returns (new residual, MLP output)."""
        attn, ln2 = layer.self_attn, layer.post_attention_layernorm
        o = _proj(o_MQ, attn.o_proj, self._lora)
        x, h = ops.add_rms_norm(x, o, ln2.weight, ln2.variance_epsilon)
        return x, self._mlp(ops, layer.mlp, h, work)

    def _mlp(self, ops: _Ops, mlp, h_MH: torch.Tensor, work: _Workspace | None = None) -> torch.Tensor:
        """``down(act(gate(h)) · up(h))``. With a workspace: the products on the MLP's packed weights
        (``_packed_linear``, when ``work.packed`` holds it) or into the workspace's buffers, the activation in place
        (the same values)."""
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

    def _norm_in(self, ops: _Ops, layer, x, delta):
        """Input norm of a layer, fused with the previous layer's MLP residual add when there is one."""
        ln1 = layer.input_layernorm
        if delta is None:
            return x, ops.rms_norm(x, ln1.weight, ln1.variance_epsilon)
        return ops.add_rms_norm(x, delta, ln1.weight, ln1.variance_epsilon)

    def _prefill(self, ops, tokens_N, pos_N, groups, cos_TD, sin_TD, cache, slot_N, dtype):
        """Packed prefill of prompts sorted into equal-length groups; returns the last residual stream ``[N, H]``
        (before the final norm).

        ``groups``: ``(start, count, length)`` = ``count`` prompts of ``length`` tokens at ``start`` in the row.
        Token i's K/V go to flat slot ``slot_N[i]`` of the page pool (page · page_size + offset). Its attention reads
        the same K/V values it writes (the fresh tensors, before the write), so it equals attention through the pages.
        """
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

        x, delta = self._layers(ops, tokens_N, pos_N, cos_TD, sin_TD, cache, slot_N, dtype, attend)
        return x + delta

    def _prefill_onto(self, ops, tokens_N, pos_N, spans, tables, cos_TD, sin_TD, cache, slot_N, dtype):
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

        x, delta = self._layers(ops, tokens_N, pos_N, cos_TD, sin_TD, cache, slot_N, dtype, attend)
        return x + delta

    def _layers(self, ops, tokens_N, pos_N, cos_TD, sin_TD, cache, slot_N, dtype, attend, work=None):
        """The layers on ``N`` tokens at positions ``pos_N`` through the pages: per layer the input norm, q/k/v
        and rotary, the K/V written to flat slots ``slot_N``, ``attend(layer index, q [N, Hq, D], k, v [N, Hkv, D])
        -> [N, Hq, D]``, o_proj and the MLP; returns ``(residual, last MLP output)`` (their sum is the last residual
        stream, before the final norm)."""
        N = tokens_N.shape[0]
        cos, sin = cos_TD[pos_N].unsqueeze(1), sin_TD[pos_N].unsqueeze(1)  # [N, 1, D]
        x = self.model.model.embed_tokens(tokens_N)  # [N, H]
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = self._norm_in(ops, layer, x, delta)
            q, k, v = self._attn_in(ops, layer, h, cos, sin, dtype)  # [N, Hq, D], [N, Hkv, D]
            cache.write(li, slot_N, k, v)
            x, delta = self._attn_out_mlp(ops, layer, x, attend(li, q, k, v).reshape(N, -1), work)
        return x, delta

    def _logits(self, ops, residual_PH: torch.Tensor) -> torch.Tensor:
        norm = self.model.model.norm
        return self._lm_head(ops.rms_norm(residual_PH, norm.weight, norm.variance_epsilon))  # [P, V] fp32

    def _lm_head(self, h_MH: torch.Tensor, work: _Workspace | None = None) -> torch.Tensor:
        """``logits = h Wᵀ (+ b)`` ``[M, V]``, accumulated and returned in fp32 like the training kernels' (never
        rounded to bf16 before the softmax). bf16/fp16 on CUDA: cuBLAS with an fp32 output (``torch.mm``'s
        ``out_dtype``), the weights read once in their own dtype; elsewhere fp32 products over vocabulary chunks of
        ``LM_HEAD_CHUNK`` rows (one chunk of the weight upcast at a time). With the decode step's workspace (off
        CUDA, no autocast), fp32: MKL's packed GEMM (``_packed_linear``, row-major logits) when the workspace packs
        the LM head (``work.packed``), else the product ``W hᵀ`` into the workspace's buffer, the logits its
        feature-major ``[M, V]`` view (``_linear_t``)."""
        weight_VH, bias_V = self.model.lm_head.weight, self.model.lm_head.bias
        out = None if work is None else work.logits
        with torch.autocast(h_MH.device.type, enabled=False):
            if h_MH.dtype == weight_VH.dtype == torch.float32:
                if work is not None and "lm_head" in work.packed:
                    return _packed_linear(h_MH, weight_VH, bias_V, work.packs.setdefault(self.model.lm_head, {}))
                return F.linear(h_MH, weight_VH, bias_V) if out is None else _linear_t(h_MH, weight_VH, bias_V, out)
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


def _proj(x_MK: torch.Tensor, module: torch.nn.Module, lora: dict, out: torch.Tensor | None = None,
          packs: dict | None = None) -> torch.Tensor:
    """A projection of the model on rows ``x [M, K]``: ``x Wᵀ + b`` from the module's own tensors, plus, for a PEFT
    LoRA layer, each live adapter's ``s · (x Aᵀ) Bᵀ`` (never merged: ``W`` stays the loaded base; ``lora``: the
    call's adapters, ``_ModelPieces._read_adapters``). The adapter costs ``x Aᵀ`` ``[M, r]`` then ``· Bᵀ``, batched
    over the rows.

    Without ``out``: PEFT's own order (``y + ((x Aᵀ) Bᵀ) · s``, each product rounded to its operands' dtype), the
    path of CUDA and its graphs. With ``out`` (the CPU workspace): ``W xᵀ`` into the buffer (``_linear_t``); with
    ``packs`` (the CPU workspace's, fp32 with MKL): ``_packed_linear`` of the base weight; either then
    ``+= s · (x Aᵀ) Bᵀ`` in place (:func:`_add_lora`). All differ by rounding only.

    An adapter in another dtype than the base (PEFT's default ``autocast_adapter_dtype=True`` keeps fp32 adapters on
    a bf16 or fp16 base) runs as PEFT's ``lora.Linear.forward`` runs it: ``x`` cast to the adapter's dtype, the
    products and the sum with the base's output in the wider dtype, the result cast back to the base's dtype."""
    terms = lora.get(module, ())
    if packs is not None or out is not None:
        if packs is not None:
            y_MN = _packed_linear(x_MK, module.weight, module.bias, packs.setdefault(module, {}))
        else:
            y_MN = _linear_t(x_MK, module.weight, module.bias, out)
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


def _linear_t(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, out: torch.Tensor):
    """``F.linear(x, weight, bias)`` for 2-D ``x``, computed as ``W xᵀ`` into the flat buffer ``out`` (``[N, M]``,
    contiguous) and returned as its ``[M, N]`` view, feature-major (strides (1, M)).

    For a few rows (decode: M = the batch) MKL's product is up to 2x faster with the weight as the long operand
    (the 16K × 256 LM head of ``bench_generation.py`` at M = 32: 2.1–2.5 ms against 3.4–4.9 ms cache-cold; the MLP's
    704 × 256 products 95 against 124 µs), and the buffer saves a fresh allocation per step. Elementwise ops and
    the next product take the view as it is (``x`` may itself be such a view: ``xᵀ`` is then contiguous). MKL's
    packed GEMM (``_packed_linear``) is faster still in the step; this is the path where the workspace packs
    nothing."""
    M, N = x_MK.shape[0], weight_NK.shape[0]
    y_NM = torch.mm(weight_NK, x_MK.t(), out=out[: N * M].view(N, M))
    if bias_N is not None:
        y_NM += bias_N[:, None]
    return y_NM.t()


@functools.cache
def mkl_packed_gemm() -> bool:
    """Whether this torch has MKL's packed-weight GEMM ops (``torch.ops.mkl``, those inductor's CPU weight freezing
    calls): x86 builds with MKL."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _packed_linear(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None, packs: dict):
    """``F.linear(x, weight, bias)`` (fp32, CPU) by MKL's GEMM on a copy of the weight packed into its kernel's
    layout for ``M`` rows (``packs[M]``, packed on first use; the two most recent kept), row-major ``[M, N]``.

    For the decode step's LM head, MLP and stacked q/k/v (:meth:`_ModelPieces._qkv_rows`): at bench_generation's
    sizes (16K × 256, 32 rows) the LM head's product takes 0.80x the time of ``_linear_t``'s ``W xᵀ`` warm,
    0.55-0.8x at 2-16 rows, and its logits are row-major, so the sampler's reductions over the vocabulary run on
    contiguous rows; the MLP's 704 × 256 products gain nothing warm but take 0.8x in the step, where their weights
    come cache-cold (in situ: 270 -> 230 ms a call). o_proj gains nothing measurable (A/B 0.96x, then 1.02x), so
    it stays unpacked. Values: MKL's products, within fp32 rounding of ``F.linear`` (tested). A pack costs one pass
    over the weight (~5 ms for 16 MB) and ~its bytes, and is valid only while the weight is unchanged (the
    workspace's packs live for one ``generate`` call)."""
    M = x_MK.shape[0]
    packed = packs.pop(M, None)
    if packed is None:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight_NK, M)
        if len(packs) >= 2:
            del packs[next(iter(packs))]  # the least recently used
    packs[M] = packed
    return torch.ops.mkl._mkl_linear(x_MK, packed, weight_NK, bias_N, M)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: ``weight · (x / sqrt(mean(x²) + eps))``, normalised in fp32, cast back, then scaled.

    fp32 off CUDA: the same products in seven kernels, in place where nothing else reads them (``F.rms_norm`` is a
    composition on CPU too, of twelve ops with two copies; in the decode step every op comes cache-cold after the
    weights stream through, ~5-30 µs however small). ``mean`` is ``sum`` then a division by the size, so the
    result is bit-identical (checked for hidden sizes 8-4096, 1-77 rows, row- and feature-major, 1 and 2 threads)."""
    if x.dtype == weight.dtype == torch.float32 and not x.is_cuda:
        inv_rms = x.pow(2).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()
        return torch.mul(x, inv_rms).mul_(weight)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then RMSNorm: returns (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, _rms_norm(x, weight, eps)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up



class _Ops(NamedTuple):
    """The elementwise pieces of a layer; torch.compile fuses each into one or two kernels on CUDA."""

    rms_norm: Callable
    add_rms_norm: Callable
    rope_qk: Callable
    silu_mul: Callable


_EAGER_OPS = _Ops(_rms_norm, _add_rms_norm, _rope_qk, _silu_mul)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x·cos + rotate_half(x)·sin`` (Hugging Face's convention); x [..., D], cos/sin broadcast."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
