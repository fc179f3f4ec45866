"""A sparse mixture-of-experts block (Qwen3-MoE's): the router, the experts as grouped GEMMs, the load-balancing loss.

Math, per token ``x`` ``[H]``, with router ``W_r`` ``[E, H]`` and expert ``e``'s weights in Hugging Face's fused
layout, ``gate_up_proj[e] = [G_e; U_e]`` ``[2I, H]`` (gate rows first) and ``down_proj[e] = D_e`` ``[H, I]``::

    z   = x W_rᵀ                                   router logits [E], in x's dtype
    p   = softmax(z) in fp32;  (w_k, e_k)_{k<K} = top-K of p;  w_k ← w_k / Σ_j w_j  when norm_topk_prob
    y_e(x) = (silu(x G_eᵀ) ⊙ x U_eᵀ) D_eᵀ        silu(g) = g·σ(g)
    out = Σ_k w_k y_{e_k}(x)

Backward, with upstream ``δ = ∂L/∂out`` and ``a = silu(g)⊙u``, ``g = x G_eᵀ``, ``u = x U_eᵀ`` for pair ``(x, e_k)``::

    ∂L/∂w_k = ⟨δ D_e, a⟩                           (then through the renormalisation and softmax to z, W_r and x)
    da = w_k δ D_e;  dg = da ⊙ u ⊙ σ(g)(1 + g(1 − σ(g)));  du = da ⊙ silu(g)
    ∂L/∂x += [dg, du] [G_e; U_e];  ∂L/∂[G_e; U_e] += [dg, du]ᵀ x;  ∂L/∂D_e += (w_k δ)ᵀ a

The top-K ids are discrete (no gradient); the weights are differentiable. This is exactly
``transformers``' ``Qwen3MoeSparseMoeBlock`` (``Qwen3MoeTopKRouter`` + ``Qwen3MoeExperts``): the same tensors, the
router in the same ops (logits in the input's dtype, fp32 softmax, weights cast back to the input's dtype). Dropless:
no capacity factor, every (token, expert) pair is computed whatever the load.

Paths (``utils.use_triton``): Triton on CUDA and under ``TRITON_INTERPRET=1`` (``moe_kernels.py``): the pairs sorted by
expert, one grouped-GEMM launch for every expert's gate/up with SiLU·mul in its epilogue, one for down times the
routing weight, a gather-sum by token; the backward is two grouped GEMMs, two per-expert weight-gradient launches
and a gather-sum, and gives ``∂L/∂w`` from the down GEMM's epilogue. Otherwise a plain-torch path with the same
steps, its matmuls per expert (the host reads the per-expert counts: CPU tensors). Both accumulate in fp32.

Memory (S = T·K pairs): the forward keeps ``[S, 2I]`` (the gate/up pre-activations, for the backward; only when a
gradient is needed) and passes through ``[S, I]`` and ``[S, H]``; the backward allocates ``[S, 2I]``, ``[S, I]``,
``[S, H]`` and the weights' gradients. Nothing of size ``[T, E, ·]``, no copy of the weights per token, no padding
to a capacity. The routing state is O(S + E) integers. The torch path also holds x in expert order ``[S, H]`` in the
forward, and x and the upstream gradient in expert order in the backward.

Triton-path constraints: fp32 / bf16 / fp16, all of x and the weights in one dtype; any H, I, E, T (masked tiles: odd
sizes, empty experts and every token on one expert are fine); ``top_k ≤ E``. The per-expert weight-gradient launch
streams an expert's rows in one program per output tile (no split over rows), so a very skewed load leaves SMs idle.

Shape legend: T tokens, H hidden size, E experts, I expert intermediate size, K experts per token, S = T·K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import moe_kernels as mk
from .utils import FLOAT_DTYPES, check_shape, check_tensor, use_triton


# ----------------------------------------------------------------------------------------------------------------------
# The experts: Triton and plain-torch bodies of one autograd.Function
# ----------------------------------------------------------------------------------------------------------------------
def _forward_triton(x_TH, gate_up_EIH, down_EHI, r, w_S, save):
    I2, H = gate_up_EIH.shape[1:]
    I = I2 // 2
    act_SI, gu_SI2, _ = mk.grouped_gemm(mk.MODE_SWIGLU, x_TH, gate_up_EIH, I, H, r, gather=True,
                                        b_strides=(gate_up_EIH.stride(1), gate_up_EIH.stride(2)), out_cols=I,
                                        dual_rows=I, save=save)
    ys_SH, _, _ = mk.grouped_gemm(mk.MODE_SCALE, act_SI, down_EHI, H, I, r, gather=False,
                                  b_strides=(down_EHI.stride(1), down_EHI.stride(2)), out_cols=H, w_S=w_S)
    del act_SI
    return mk.gather_sum(ys_SH, r.pos, x_TH.shape[0], r.top_k), gu_SI2


def _backward_triton(g_TH, x_TH, gate_up_EIH, down_EHI, r, w_S, gu_SI2):
    I2, H = gate_up_EIH.shape[1:]
    I = I2 // 2
    dgu_SI2, act_SI, parts = mk.grouped_gemm(mk.MODE_SWIGLU_BWD, g_TH, down_EHI, I, H, r, gather=True,
                                             b_strides=(down_EHI.stride(2), down_EHI.stride(1)), out_cols=I2,
                                             w_S=w_S, gu=gu_SI2)
    dw_S = parts.sum(0)  # [S]: the N tiles' parts of ⟨δ D_e, a⟩, in a fixed order
    d_down = mk.expert_wgrad(g_TH, act_SI, H, I, r, r.E, l_gather=True, r_gather=False, w_S=w_S)  # [E, H, I]
    del act_SI
    d_gate_up = mk.expert_wgrad(dgu_SI2, x_TH, I2, H, r, r.E, l_gather=False, r_gather=True)  # [E, 2I, H]
    dx_SH, _, _ = mk.grouped_gemm(mk.MODE_PLAIN, dgu_SI2, gate_up_EIH, H, I2, r, gather=False,
                                  b_strides=(gate_up_EIH.stride(2), gate_up_EIH.stride(1)), out_cols=H)
    del dgu_SI2
    return mk.gather_sum(dx_SH, r.pos, x_TH.shape[0], r.top_k), d_gate_up, d_down, dw_S


def _segments(r):
    """``(expert, first row, end row)`` of every expert with rows (host read of the counts: CPU tensors only)."""
    bounds = r.offsets.tolist()
    return [(e, bounds[e], bounds[e + 1]) for e in range(r.E) if bounds[e + 1] > bounds[e]]


def _swiglu_parts(gu_nI2):
    g, u = gu_nI2.float().chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    return g, u, sig, g * sig


def _gather_sum_torch(src_SH, r, T):
    """``out[t] = Σ_j src[pos[t, j]]`` in fp32, in ``src``'s dtype (the Triton path's ``gather_sum``)."""
    pos_TK = r.pos.long().view(T, r.top_k)
    out_TH = src_SH[pos_TK[:, 0]].float()
    for j in range(1, r.top_k):
        out_TH += src_SH[pos_TK[:, j]]
    return out_TH.to(src_SH.dtype)


def _forward_torch(x_TH, gate_up_EIH, down_EHI, r, w_S, save):
    """Per expert only the two matmuls; the gather and the elementwise work run once over all pairs (each op is a
    parallel region of the CPU thread pool, and on a loaded machine each waits for its slowest thread)."""
    x_SH = x_TH[r.tok.long()]  # [S, H] in expert order
    gu_SI2 = torch.empty(r.S, gate_up_EIH.shape[1], dtype=x_TH.dtype, device=x_TH.device)
    ys_SH = torch.empty(r.S, x_TH.shape[1], dtype=x_TH.dtype, device=x_TH.device)
    segments = _segments(r)
    for e, lo, hi in segments:
        torch.mm(x_SH[lo:hi], gate_up_EIH[e].t(), out=gu_SI2[lo:hi])
    del x_SH
    _, u, _, silu = _swiglu_parts(gu_SI2)
    act_SI = silu.mul_(u).to(x_TH.dtype)
    for e, lo, hi in segments:
        torch.mm(act_SI[lo:hi], down_EHI[e].t(), out=ys_SH[lo:hi])
    ys_SH.mul_(w_S[:, None])
    return _gather_sum_torch(ys_SH, r, x_TH.shape[0]), gu_SI2 if save else None


def _backward_torch(g_TH, x_TH, gate_up_EIH, down_EHI, r, w_S, gu_SI2):
    """As the forward: per expert the four matmuls, the rest once over all pairs. Besides the Triton path's buffers
    it gathers x and the upstream gradient in expert order (``[S, H]`` each)."""
    dt = x_TH.dtype
    tok = r.tok.long()
    g_SH = g_TH[tok]  # [S, H]
    dact_SI = torch.empty(r.S, down_EHI.shape[2], dtype=dt, device=x_TH.device)
    segments = _segments(r)
    for e, lo, hi in segments:
        torch.mm(g_SH[lo:hi], down_EHI[e], out=dact_SI[lo:hi])  # δ D_e
    g, u, sig, silu = _swiglu_parts(gu_SI2)
    act = silu * u
    dact = dact_SI.float()
    dw_S = torch.linalg.vecdot(dact, act)
    da = dact.mul_(w_S[:, None])
    dgu_SI2 = torch.cat([da * u * sig * (1.0 + g * (1.0 - sig)), da.mul_(silu)], dim=1).to(dt)
    del g, u, sig, silu, dact, da, dact_SI
    gw_SH, act_SI = g_SH.mul_(w_S[:, None]), act.to(dt)  # the upstream gradient times the routing weight
    x_SH = x_TH[tok]
    dx_SH = torch.empty(r.S, x_TH.shape[1], dtype=dt, device=x_TH.device)
    d_gate_up, d_down = torch.zeros_like(gate_up_EIH), torch.zeros_like(down_EHI)
    for e, lo, hi in segments:
        torch.mm(gw_SH[lo:hi].t(), act_SI[lo:hi], out=d_down[e])
        torch.mm(dgu_SI2[lo:hi].t(), x_SH[lo:hi], out=d_gate_up[e])
        torch.mm(dgu_SI2[lo:hi], gate_up_EIH[e], out=dx_SH[lo:hi])
    return _gather_sum_torch(dx_SH, r, x_TH.shape[0]), d_gate_up, d_down, dw_S


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, gate_up_EIH, down_EHI, w_TK, r, kernel):
        w_S = w_TK.reshape(-1)[r.order].float().contiguous()  # [S] routing weights in expert order
        save = any(ctx.needs_input_grad[:4])  # the backward needs the gate/up pre-activations
        if r.S == 0:
            out_TH, gu_SI2 = x_TH.new_zeros(x_TH.shape), None
        else:
            out_TH, gu_SI2 = (_forward_triton if kernel else _forward_torch)(x_TH, gate_up_EIH, down_EHI, r, w_S,
                                                                             save)
        ctx.save_for_backward(x_TH, gate_up_EIH, down_EHI, w_TK, w_S, gu_SI2)
        ctx.kernel, ctx.r = kernel, r
        return out_TH

    @staticmethod
    def backward(ctx, g_TH):
        x_TH, gate_up_EIH, down_EHI, w_TK, w_S, gu_SI2 = ctx.saved_tensors
        r = ctx.r
        if r.S == 0:
            return torch.zeros_like(x_TH), torch.zeros_like(gate_up_EIH), torch.zeros_like(down_EHI), \
                torch.zeros_like(w_TK), None, None
        bwd = _backward_triton if ctx.kernel else _backward_torch
        dx, d_gate_up, d_down, dw_S = bwd(g_TH.to(x_TH.dtype).contiguous(), x_TH, gate_up_EIH, down_EHI, r, w_S,
                                          gu_SI2)
        dw_TK = torch.empty(r.S, dtype=torch.float32, device=x_TH.device)
        dw_TK[r.order] = dw_S
        return dx, d_gate_up, d_down, dw_TK.view(w_TK.shape).to(w_TK.dtype), None, None


# ----------------------------------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------------------------------
def _check_experts(hidden, gate_up_proj, down_proj):
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, nonempty=False)
    if hidden.dim() < 1:
        raise ValueError("hidden must have a last (hidden size) dimension")
    H = hidden.shape[-1]
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=(hidden.dtype,), device=hidden.device)
    E, I2 = gate_up_proj.shape[:2]
    if I2 % 2 or gate_up_proj.shape[2] != H:
        raise ValueError(f"gate_up_proj has shape {tuple(gate_up_proj.shape)}: expected [E, 2·I, H] with H = {H}")
    check_tensor("down_proj", down_proj, ndim=3, dtypes=(hidden.dtype,), device=hidden.device)
    check_shape("down_proj", down_proj, (E, H, I2 // 2), "gate_up_proj [E, 2·I, H] as [E, H, I]")


def moe_experts(hidden, gate_up_proj, down_proj, topk_ids, topk_weights, *, check_ids=True, kernel=None):
    """``out = Σ_k w_k y_{e_k}(x)`` for every token, the experts as grouped GEMMs (module docstring).

    Args:
        hidden: ``[..., H]`` fp32/bf16/fp16 (``[0, H]`` gives ``[0, H]``).
        gate_up_proj: ``[E, 2I, H]``, gate rows then up rows (``Qwen3MoeExperts.gate_up_proj``), hidden's dtype.
        down_proj: ``[E, H, I]`` (``Qwen3MoeExperts.down_proj``).
        topk_ids: integer ``[..., K]`` expert ids in ``[0, E)`` (checked: a host read per call, unless
            ``check_ids=False``: ids a router produced, e.g. inside a CUDA graph, where no host read may happen).
        topk_weights: ``[..., K]`` float routing weights (differentiable).
        kernel: the Triton path (True) or the torch one (False); None: by device (``utils.use_triton``: Triton on
            CUDA and under ``TRITON_INTERPRET=1``). A model's CPU forward passes ``hidden.is_cuda``: the interpreter
            is for the kernels' own tests.

    Returns ``[..., H]`` in hidden's dtype; gradients reach hidden, both weights and ``topk_weights``.
    """
    _check_experts(hidden, gate_up_proj, down_proj)
    E = gate_up_proj.shape[0]
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int64, torch.int32), device=hidden.device, nonempty=False)
    check_shape("topk_ids", topk_ids, (*hidden.shape[:-1], topk_ids.shape[-1]), "hidden's leading dims")
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, device=hidden.device, nonempty=False)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids")
    if not 1 <= topk_ids.shape[-1] <= E:
        raise ValueError(f"topk_ids has {topk_ids.shape[-1]} experts per token; expected 1 to {E}")
    if check_ids and topk_ids.numel() and not (0 <= int(topk_ids.min()) and int(topk_ids.max()) < E):
        raise ValueError(f"topk_ids has ids outside [0, {E})")
    return _experts(hidden, gate_up_proj, down_proj, topk_ids, topk_weights, kernel)


def _experts(hidden, gate_up_proj, down_proj, topk_ids, topk_weights, kernel=None):
    H, K = hidden.shape[-1], topk_ids.shape[-1]
    x_TH = hidden.reshape(-1, H).contiguous()
    r = mk.Routing(topk_ids.reshape(-1, K), gate_up_proj.shape[0])
    kernel = use_triton(x_TH) if kernel is None else kernel
    out = _MoEExperts.apply(x_TH, gate_up_proj, down_proj, topk_weights.reshape(-1, K), r, kernel)
    return out.view(hidden.shape)


def moe_router(hidden, router_weight, top_k, *, norm_topk_prob, topk_ids=None):
    """``(router_logits [T, E], topk_weights [T, K], topk_ids [T, K])``, ``Qwen3MoeTopKRouter``'s ops: logits in
    hidden's dtype, fp32 softmax, top-K, renormalised when ``norm_topk_prob``, weights in the logits' dtype.
    ``hidden`` ``[..., H]`` is flattened to ``[T, H]``.

    ``topk_ids`` (router replay): route to these experts instead of the top-K (``[..., K]`` or ``[T, K]``, e.g. the
    ones the generation engine recorded); their weights are recomputed from the current logits, ``p[t, ids[t]]``
    (renormalised when ``norm_topk_prob``), so the router still gets its gradient."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, nonempty=False)
    check_tensor("router_weight", router_weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if router_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"router_weight has shape {tuple(router_weight.shape)}: expected [E, {hidden.shape[-1]}]")
    if not (isinstance(top_k, int) and 1 <= top_k <= router_weight.shape[0]):
        raise ValueError(f"top_k must be an int in [1, {router_weight.shape[0]}], got {top_k!r}")
    logits_TE = F.linear(hidden.reshape(-1, hidden.shape[-1]), router_weight)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    if topk_ids is None:
        weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    else:
        check_tensor("topk_ids", topk_ids, dtypes=(torch.int64, torch.int32), device=hidden.device, nonempty=False)
        check_shape("topk_ids", topk_ids.reshape(-1, topk_ids.shape[-1]), (logits_TE.shape[0], top_k),
                    "[tokens, top_k]")
        ids_TK = topk_ids.reshape(-1, top_k).long()
        weights_TK = probs_TE.gather(1, ids_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return logits_TE, weights_TK.to(logits_TE.dtype), ids_TK


def sparse_moe_block(hidden, router_weight, gate_up_proj, down_proj, *, top_k, norm_topk_prob, topk_ids=None):
    """``Qwen3MoeSparseMoeBlock.forward`` on its tensors (``gate.weight``, ``experts.gate_up_proj``,
    ``experts.down_proj``): returns ``(out [..., H], router_logits [T, E])``; the logits feed
    :func:`load_balancing_loss`. Gradients reach hidden, the router and both expert weights. ``topk_ids``: router
    replay (:func:`moe_router`; ids outside ``[0, E)`` raise, a host read)."""
    _check_experts(hidden, gate_up_proj, down_proj)
    if topk_ids is not None and topk_ids.numel() and not (0 <= int(topk_ids.min()) and
                                                          int(topk_ids.max()) < gate_up_proj.shape[0]):
        raise ValueError(f"topk_ids has ids outside [0, {gate_up_proj.shape[0]})")
    logits_TE, weights_TK, ids_TK = moe_router(hidden, router_weight, top_k, norm_topk_prob=norm_topk_prob,
                                               topk_ids=topk_ids)
    return _experts(hidden, gate_up_proj, down_proj, ids_TK, weights_TK), logits_TE


def load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """The Switch-Transformer load-balancing loss exactly as ``transformers``' ``load_balancing_loss_func``::

        f_e = Σ_{layers, rows} m·[e ∈ top-K(p)] / R,   P_e = Σ_{layers, rows} m·p_e / R,   loss = E · Σ_e f_e P_e

    with ``p = softmax(z)`` in the logits' own dtype (as there), ``m`` the row's ``attention_mask`` value (1 without
    one), ``R = Σ m`` over every layer's rows: the counts and probabilities of all layers are pooled before the product.
    ``router_logits``: one ``[T, E]`` tensor or a tuple / list of them (one per layer; ``transformers`` returns 0 for a
    lone tensor, this takes it as one layer). The trainer adds ``router_aux_loss_coef · loss``. Gradients flow through
    ``P`` only (the top-K counts are discrete).
    """
    layers = tuple(router_logits) if isinstance(router_logits, (tuple, list)) else (router_logits,)
    device = layers[0].device
    count_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    m_N = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for z_TE in layers:
        p_TE = torch.softmax(z_TE.to(device), dim=-1)
        ids_TK = torch.topk(p_TE, top_k, dim=-1).indices
        m = torch.ones(z_TE.shape[0], device=device) if m_N is None else m_N
        count_E = count_E + torch.zeros_like(count_E).scatter_add_(0, ids_TK.reshape(-1), m.repeat_interleave(top_k))
        prob_E = prob_E + (p_TE.float() * m[:, None]).sum(0)
        rows = rows + m.sum()
    return num_experts * ((count_E / rows) * (prob_E / rows)).sum()


# ----------------------------------------------------------------------------------------------------------------------
# Reference (the specification the tests compare against; clarity over speed)
# ----------------------------------------------------------------------------------------------------------------------
def moe_experts_reference(hidden, gate_up_proj, down_proj, topk_ids, topk_weights, *, upcast=True):
    """``Σ_k w_k y_{e_k}(x)`` by a loop over experts, in fp32 when ``upcast`` (else in the inputs' dtype, rounding
    where ``transformers``' eager experts round); returns ``[T, H]``."""
    cast = (lambda t: t.float()) if upcast else (lambda t: t)
    x_TH, w_TK = cast(hidden.reshape(-1, hidden.shape[-1])), cast(topk_weights.reshape(-1, topk_ids.shape[-1]))
    ids_TK = topk_ids.reshape(w_TK.shape)
    I = down_proj.shape[2]
    out_TH = torch.zeros_like(x_TH)
    for e in range(gate_up_proj.shape[0]):
        tok, j = torch.nonzero(ids_TK == e, as_tuple=True)
        G, U, D = cast(gate_up_proj[e, :I]), cast(gate_up_proj[e, I:]), cast(down_proj[e])
        x_nH = x_TH[tok]
        y_nH = (F.silu(x_nH @ G.t()) * (x_nH @ U.t())) @ D.t()
        out_TH = out_TH.index_add(0, tok, y_nH * w_TK[tok, j, None])
    return out_TH


def sparse_moe_block_reference(hidden, router_weight, gate_up_proj, down_proj, *, top_k, norm_topk_prob,
                               upcast=True):
    """:func:`sparse_moe_block` by :func:`moe_router` and :func:`moe_experts_reference` (``upcast``: all in fp32)."""
    cast = (lambda t: t.float()) if upcast else (lambda t: t)
    logits_TE, weights_TK, ids_TK = moe_router(cast(hidden), cast(router_weight), top_k,
                                               norm_topk_prob=norm_topk_prob)
    out_TH = moe_experts_reference(hidden, gate_up_proj, down_proj, ids_TK, weights_TK, upcast=upcast)
    return out_TH.view(hidden.shape), logits_TE
