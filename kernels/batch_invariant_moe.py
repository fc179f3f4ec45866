"""A sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE) in ``numerics.batch_invariant``: the router's weights and
the routed experts, one function each, which the generation engine's decoder (``fastgrpo.engine.batch_invariant``) and
the trainer's packed forward (the router's hook and the experts interface, ``fastgrpo.models.moe``) both call, so a
token's experts, their weights and the block's output depend on that token's hidden state alone, bit for bit.

Per token ``x`` ``[H]`` (``fastgrpo.kernels.moe``'s math), on the invariant ops (``fastgrpo.kernels.batch_invariant``;
both functions run inside ``invariant_forward``, where PyTorch's CPU ``mm``, ``silu``, ``sigmoid`` and ``_softmax``
are the invariant ones)::

    z = x W_rᵀ                  the exact product, in x's dtype (the router's own ``F.linear`` on the overrides)
    p = softmax(z) in fp32      max, then exp(z − max) (position-independent), divided by their exact sum
    e_0..e_{K−1}                the K largest p, largest first; equal p: the lower expert first (a stable sort)
    w_k = p[e_k]  (/ (((w_0 + w_1) + w_2) + …) with norm_topk_prob)    cast to z's dtype
    y_e(x) = (silu(x G_eᵀ) ⊙ x U_eᵀ) D_eᵀ     both products exact on expert e's rows, each cast to x's dtype
    out = ((w_0 y_{e_0} + w_1 y_{e_1}) + …)  in fp32, k in the router's order, cast to x's dtype

Every reduction is exact or a fixed sequence of correctly rounded ops, so which tokens share an expert's product, the
call's size, and a token's place in it change nothing. With replay ids (router replay) the weights are ``p`` at those
ids, renormalised the same way: replaying the ids the engine chose gives the weights it used. The backward (autograd
over these ops: the products' and SiLU's, outside the forward scope) is PyTorch's fast one.

Cost against ``fastgrpo.kernels.moe``'s per-expert CPU path: the exact products (fp64 GEMMs on grids; the experts'
weight grids kept per version like every weight's, 2x their fp32 bytes: for Qwen3-30B-A3B's 48 × 128 experts that is
why the mode stays on small and mid-size models), a ``[T, E]`` stable sort, and ``[T, K, H]`` of the experts' outputs
before the ordered sum (``fastgrpo.kernels.moe`` sums them in place: ``[T, H]``).

Shape legend: T tokens, H hidden size, E experts, I expert width, K experts per token, S = T·K (token, expert) pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch_invariant import active, ordered_sum


def _require_forward_scope() -> None:
    if not active():
        raise RuntimeError("the batch-invariant MoE block runs inside invariant_forward() (its products are the "
                           "overrides' exact ones)")


def route(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool, ids_TK: torch.Tensor | None = None):
    """``(weights [T, K] in the logits' dtype, ids [T, K] int64)`` of router logits ``z`` (module docstring): the
    top-K of ``softmax(z)`` (fp32, the invariant ``_softmax``) largest first, ties to the lower expert; or, with
    ``ids`` (router replay), those experts. Differentiable in ``z``."""
    _require_forward_scope()
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)  # [T, E]
    if ids_TK is None:
        ids_TK = torch.sort(probs_TE, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w_TK = probs_TE.gather(1, ids_TK)
    if norm_topk_prob:
        w_TK = w_TK / ordered_sum(w_TK)[:, None]
    return w_TK.to(logits_TE.dtype), ids_TK


def experts(x_TH: torch.Tensor, gate_up_EIH: torch.Tensor, down_EHI: torch.Tensor, ids_TK: torch.Tensor,
            w_TK: torch.Tensor) -> torch.Tensor:
    """``Σ_k w_k y_{e_k}(x)`` per token (module docstring), ``[T, H]`` in x's dtype: the (token, expert) pairs sorted by
    expert, two exact products per expert with rows (the host reads the ``[E]`` counts: one synchronisation a
    block on CUDA), the outputs back in (token, k) order and summed over k in that order. ``gate_up`` ``[E, 2I, H]``
    (gate rows first), ``down`` ``[E, H, I]``: Hugging Face's fused expert layout. Differentiable in x, both weights
    and ``w``."""
    _require_forward_scope()
    T, K = ids_TK.shape
    H = x_TH.shape[1]
    flat_S = ids_TK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)  # pairs by expert
    x_SH = x_TH[order_S // K]
    parts, lo = [], 0
    for e, n in enumerate(torch.bincount(flat_S, minlength=gate_up_EIH.shape[0]).tolist()):
        if n:
            gate, up = torch.mm(x_SH[lo : lo + n], gate_up_EIH[e].t()).chunk(2, dim=-1)  # [n, I] each
            parts.append(torch.mm(F.silu(gate) * up, down_EHI[e].t()))  # [n, H]
            lo += n
    if not parts:
        return x_TH.new_zeros(T, H)
    y_TKH = torch.cat(parts)[torch.argsort(order_S)].view(T, K, H)  # (token, k) order
    out_TH = w_TK[:, 0, None].float() * y_TKH[:, 0].float()
    for k in range(1, K):
        out_TH = out_TH + w_TK[:, k, None].float() * y_TKH[:, k].float()
    return out_TH.to(x_TH.dtype)
