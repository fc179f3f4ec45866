"""Packed variable-length causal attention with GQA: ``cu_seqlens`` in, no padding anywhere.

For every sequence b (tokens ``[cu[b], cu[b+1])``) and query head h, with key/value head ``h // (Hq // Hkv)``::

    O[i] = Σ_j softmax_j(scale · q_i · k_j  (j ≤ i when causal, j in the same sequence)) · v_j

q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens`` ``[B + 1]`` int32. Tokens of different sequences never see
each other. Returns ``[T, Hq, D]`` in the input dtype; differentiable in q, k and v.

Paths (DESIGN.md): the Triton kernels on CUDA and under ``TRITON_INTERPRET=1``; otherwise a plain-torch path
that runs ``scaled_dot_product_attention`` per sequence (sequences of equal length batched together), which is
how the CPU trainer runs a packed forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import FLOAT_DTYPES, check_cu_seqlens, check_tensor

MAX_HEAD_DIM = 256


def _check_inputs(q, k, v, cu_seqlens, max_seqlen, *, check_offsets: bool) -> None:
    """Shapes, dtypes, devices; with ``check_offsets`` also the ``cu_seqlens`` values (one host read)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    T, Hq, D = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [T={T}, Hkv, D={D}] to match q")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"q's head count {Hq} must be a multiple of k's head count {k.shape[1]} (GQA)")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {D}; supported head dims are 1..{MAX_HEAD_DIM}")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,), device=q.device)
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive int, got {max_seqlen!r}")
    if check_offsets:
        check_cu_seqlens(cu_seqlens, T)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence ({longest} tokens)")


def _varlen_attention_torch(q, k, v, cu_seqlens, causal: bool, scale: float) -> torch.Tensor:
    """Per-sequence SDPA; sequences of the same length go through one batched call (q/k/v gathered)."""
    T, Hq, D = q.shape
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    gqa = Hq != k.shape[1]
    out = q.new_empty(T, Hq, D)  # [T, Hq, D]
    for L, starts in by_length.items():
        if len(starts) == 1:
            rows = slice(starts[0], starts[0] + L)
            qs, ks, vs = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
        else:
            rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(L, device=q.device)).flatten()
            qs, ks, vs = (x[rows].view(len(starts), L, x.shape[1], D).transpose(1, 2) for x in (q, k, v))  # [n,H,L,D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa)  # [n,Hq,L,D]
        out[rows] = o.transpose(1, 2).reshape(-1, Hq, D)
    return out


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """Packed causal attention; see the module docstring for the math.

    Args:
        q: ``[T, Hq, D]`` fp32/bf16/fp16 queries of all sequences, concatenated.
        k, v: ``[T, Hkv, D]`` keys and values, same dtype and device; ``Hq % Hkv == 0``.
        cu_seqlens: ``[B + 1]`` int32 offsets, ``0 = cu[0] ≤ cu[1] ≤ … ≤ cu[B] = T``.
        max_seqlen: an int ≥ the longest sequence (sizes the kernel grid).
        causal: mask keys after the query within each sequence.
        softmax_scale: defaults to ``D ** -0.5``.
    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, check_offsets=True)
    return _dispatch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale)


def varlen_attention_unchecked(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """:func:`varlen_attention` without reading ``cu_seqlens`` back to the host to check its values.

    For callers that built the offsets themselves and call once per layer (the Hugging Face integration):
    shapes, dtypes and devices are still checked; the offsets are trusted.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, check_offsets=False)
    return _dispatch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale)


def _dispatch(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return _varlen_attention_torch(q, k, v, cu_seqlens, bool(causal), scale)
