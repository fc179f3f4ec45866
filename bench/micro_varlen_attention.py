"""Packed causal GQA attention (``varlen_attention``) against flash-attn, PyTorch's kernels and padded SDPA.

A packed row holds whole documents, causal within each (GPU: 32768 tokens from documents of 16K, 8K, 4K, 2K, 1K,
512 and 512 tokens; CPU: 2048 tokens from 1024 … 64; smoke run: 128 tokens from 64, 32, 16 and 16, 4/2 heads).
Groups ``varlen_attention <mode> tokens Hq/Hkv D dtype`` for ``fwd`` (no autograd) and ``fwd+bwd`` (random upstream
gradient, to the gradients of q, k and v). Members, all on the same data and checked against fastgrpo's output and
gradients before they are timed (causal within each document, GQA, the default softmax scale 1/√D on every side):

- ``fastgrpo``: :func:`fastgrpo.kernels.varlen_attention.varlen_attention` (Triton on GPU, per-document SDPA on CPU);
- ``flash-attn``: ``flash_attn_varlen_func`` (FlashAttention-2, native GQA), when flash-attn is importable (GPU);
- ``torch varlen``: ``torch.nn.attention.varlen.varlen_attn`` (GPU, when the installed torch has it);
- ``flex``: ``flex_attention`` compiled with a ``same document and q ≥ k`` block mask (GPU; fwd+bwd of the first
  head layout only: one compile, to bound the GPU check's time);
- ``padded sdpa``: every document padded to the longest, k/v expanded to the query heads,
  ``scaled_dot_product_attention(is_causal=True)`` (flash backend on GPU); the padding itself is not timed.

Useful FLOPs only (padding and masked-out scores are not counted): a causal document of L tokens has
``P = L(L + 1)/2`` visible (query, key) pairs per query head; forward ``4·D·P`` (QKᵀ and PV), backward ``10·D·P``
(QKᵀ recomputed, dV, dP, dQ, dK), summed over heads and documents. Roofline: the matmul rate.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from common import DEVICE, SMOKE_DTYPE, check_same, dtype_name, measure, sizes
from fastgrpo.kernels.utils import pad_packed, seq_index, unpad_padded
from fastgrpo.kernels.varlen_attention import varlen_attention

DOCS = {"cuda": [16384, 8192, 4096, 2048, 1024, 512, 512], "cpu": [1024, 512, 256, 128, 64, 64],
        "smoke": [64, 32, 16, 16]}
HEADS = {"cuda": [(12, 2, 128, torch.bfloat16), (32, 8, 128, torch.bfloat16)], "cpu": [(12, 2, 64, torch.float32)],
         "smoke": [(4, 2, 64, SMOKE_DTYPE)]}
METHODS = ("fastgrpo", "flash-attn", "torch varlen", "flex", "padded sdpa")


def causal_flops(lengths, Hq, D, mode):
    """Useful FLOPs of causal attention over the documents: forward 4·D·P, backward 10·D·P per query head."""
    pairs = sum(L * (L + 1) // 2 for L in lengths)
    return (4 if mode == "fwd" else 14) * D * pairs * Hq


def _cases():
    for Hq, Hkv, D, dtype in sizes(HEADS):
        for mode in ("fwd", "fwd+bwd"):
            for method in METHODS:
                if method == "flex" and ((Hq, Hkv) != sizes(HEADS)[0][:2] or mode == "fwd"):
                    continue
                yield pytest.param((Hq, Hkv, D, dtype), mode, method,
                                   id=f"{mode}-{sum(sizes(DOCS))}-{Hq}x{Hkv}x{D}-{dtype_name(dtype)}-{method}")


@functools.lru_cache(maxsize=1)
def _inputs(Hq, Hkv, D, dtype):
    """Packed q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens, upstream gradient [T, Hq, D]."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    lengths = sizes(DOCS)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(T, h, D, device=DEVICE, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    return q, k, v, cu, torch.randn(T, Hq, D, device=DEVICE, generator=g).to(dtype)


def _torch_varlen():
    """``varlen_attn`` with causal masking and GQA, adapted to the installed signature."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    params = inspect.signature(varlen_attn).parameters
    causal_kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in params

    def run(q, k, v, cu, max_len):
        if native_gqa:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, enable_gqa=True, **causal_kw)
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal_kw)

    return run


def _method(name, heads):
    """(leaves, grad_out, fn(*leaves) -> out, to_packed(out, grads) -> {"out", "grad_q", "grad_k", "grad_v"})."""
    q, k, v, cu, grad_out = _inputs(*heads)
    T, max_len, group = q.shape[0], max(sizes(DOCS)), q.shape[1] // k.shape[1]
    packed = [x.clone().requires_grad_() for x in (q, k, v)]

    def as_packed(out, grads):
        return {"out": out, **({} if grads is None else dict(zip(("grad_q", "grad_k", "grad_v"), grads)))}

    if name == "fastgrpo":
        return packed, grad_out, lambda q, k, v: varlen_attention(q, k, v, cu, max_len), as_packed
    if DEVICE != "cuda" and name != "padded sdpa":
        pytest.skip(f"{name}: GPU only")
    if name == "flash-attn":
        flash = pytest.importorskip("flash_attn", reason="flash-attn is not installed (it builds against CUDA)")
        return packed, grad_out, lambda q, k, v: flash.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                                              causal=True), as_packed
    if name == "torch varlen":
        run = _torch_varlen()
        return packed, grad_out, lambda q, k, v: run(q, k, v, cu, max_len), as_packed

    def fold_heads(g_kv):  # gradient of k/v expanded to the query heads -> [T, Hkv, D]
        return g_kv.unflatten(1, (-1, group)).sum(2)

    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = seq_index(cu, T)  # [T] document of every token

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(document_causal, None, None, T, T, device=DEVICE)
        compiled = torch.compile(flex_attention, dynamic=False)
        leaves = [x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]  # [1, H, T, D]

        def flex_packed(out, grads):
            out = out[0].transpose(0, 1)
            return as_packed(out, None if grads is None else [g[0].transpose(0, 1) for g in grads])

        return (leaves, grad_out.transpose(0, 1).unsqueeze(0).contiguous(),
                lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True), flex_packed)
    padded = [pad_packed(x.repeat_interleave(n, dim=1), cu).transpose(1, 2).contiguous().requires_grad_()
              for x, n in ((q, 1), (k, group), (v, group))]  # [B, Hq, T_max, D]

    def sdpa(q, k, v):
        if DEVICE == "cuda":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def unpad(x):
        return unpad_padded(x.transpose(1, 2), cu)  # [T, H, D]

    def sdpa_packed(out, grads):
        if grads is None:
            return as_packed(unpad(out), None)
        gq, gk, gv = (unpad(g) for g in grads)
        return as_packed(unpad(out), [gq, fold_heads(gk), fold_heads(gv)])

    return padded, pad_packed(grad_out, cu).transpose(1, 2).contiguous(), sdpa, sdpa_packed


def _call(fn, leaves, grad_out, mode):
    if mode == "fwd":
        with torch.no_grad():
            return fn(*leaves), None
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


@functools.lru_cache(maxsize=1)
def _fastgrpo_result(heads, mode):
    leaves, grad_out, fn, to_packed = _method("fastgrpo", heads)
    return to_packed(*_call(fn, leaves, grad_out, mode))


@pytest.mark.parametrize(("heads", "mode", "method"), list(_cases()))
def test_varlen_attention(benchmark, ceilings, heads, mode, method):
    Hq, Hkv, D, dtype = heads
    leaves, grad_out, fn, to_packed = _method(method, heads)
    want = _fastgrpo_result(heads, mode)  # fastgrpo's own case: this call was its warm-up
    err = 0.0 if method == "fastgrpo" else check_same(to_packed(*_call(fn, leaves, grad_out, mode)), want, dtype,
                                                      method)
    lengths = sizes(DOCS)
    benchmark.group = f"varlen_attention {mode} {sum(lengths)} tokens {Hq}/{Hkv}x{D} {dtype_name(dtype)}"
    measure(benchmark, lambda: _call(fn, leaves, grad_out, mode), device=DEVICE, method=method, ceilings=ceilings,
            flops=causal_flops(lengths, Hq, D, mode), op="varlen_attention",
            shape=f"docs={'/'.join(map(str, lengths))} Hq={Hq} Hkv={Hkv} D={D}", dtype=dtype_name(dtype),
            max_abs_err_vs_fastgrpo=err)
