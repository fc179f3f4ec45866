"""Plain-torch path of ``grpo_loss`` (CPU without the interpreter): the kernels' algorithm and closed-form gradient
in torch, chunk by chunk (``TORCH_CHUNK`` tokens), saving the same ``[B]`` vectors for backward as the kernels instead
of autograd's temporaries. The math is in ``grpo_loss.py``'s docstring; each function mirrors its Triton twin in
``grpo_kernels.py`` (``_policy_term``, ``_clip_flags``, ``_kl_term``).

Shape legend: B sequences, T padded length, N packed tokens.
"""

from __future__ import annotations

import torch

from .grpo_kernels import N_PARTS
from .grpo_options import GRPOLossOptions, LossCall

TORCH_CHUNK = 65536  # tokens per chunk (a few fp32 temporaries of this size)


def _clipped_pg(r, a, o: GRPOLossOptions, with_grad: bool):
    """Clipped policy loss ``ℓ`` and ``∂ℓ/∂r`` (torch's tie rules; None unless ``with_grad``)."""
    lo, hi = 1.0 - o.epsilon_low, 1.0 + o.eps_high
    r2 = r.clamp(lo, hi)
    r1 = r if o.delta is None else r.clamp(max=o.delta)
    x1, x2 = r1 * a, r2 * a
    loss = -torch.minimum(x1, x2)
    dloss = None
    if with_grad:
        dr2 = ((r >= lo) & (r <= hi)).float()
        dr1 = torch.ones_like(r) if o.delta is None else (r <= o.delta).float()
        dloss = -a * torch.where(x1 < x2, dr1, torch.where(x1 > x2, dr2, 0.5 * (dr1 + dr2)))
    if o.dual_clip_c is not None:
        cap = -o.dual_clip_c * a
        neg = a < 0
        if with_grad:
            keep = torch.where(loss < cap, 1.0, torch.where(loss == cap, 0.5, 0.0))
            dloss = torch.where(neg, dloss * keep, dloss)
        loss = torch.where(neg, torch.minimum(loss, cap), loss)
    return loss, dloss


def policy_term(r, lp, a, o: GRPOLossOptions, *, with_grad: bool = True):
    """``ℓ`` and ``∂ℓ/∂log r`` (None unless ``with_grad``; CISPO: ``∂ℓ/∂logp``, its ratio being detached)."""
    if o.policy == "clipped":
        loss, dloss = _clipped_pg(r, a, o, with_grad)
        return loss, (dloss * r if with_grad else None)
    if o.policy in ("cispo", "cispo_clamp"):
        c = r.clamp(max=o.eps_high) if o.policy == "cispo" else r.clamp(1.0 - o.epsilon_low, 1.0 + o.eps_high)
        return -c * a * lp, -c * a
    tau = torch.where(a > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)  # sapo
    s = torch.sigmoid(tau * (r - 1.0))
    return -(s * 4.0 / tau) * a, -4.0 * s * (1.0 - s) * a * r


def clip_flags(r, a, o: GRPOLossOptions):
    """The clip-ratio metrics' (low, high) flags (0/1 fp32)."""
    if o.policy == "clipped":
        r1 = r if o.delta is None else r.clamp(max=o.delta)
        return ((r1 < 1.0 - o.epsilon_low) & (a < 0)).float(), ((r1 > 1.0 + o.eps_high) & (a > 0)).float()
    if o.policy == "cispo":
        return torch.zeros_like(r), ((r > o.eps_high) & (a > 0)).float()
    if o.policy == "cispo_clamp":
        return (r < 1.0 - o.epsilon_low).float(), (r > 1.0 + o.eps_high).float()
    return torch.zeros_like(r), torch.zeros_like(r)


def kl_term(lp, rf, sp, r, valid, o: GRPOLossOptions, *, with_grad: bool = True, value: bool = True):
    """Per-token ``kl`` (None unless ``value`` or the output clamp needs it), ``∂kl/∂logp`` and ``∂kl/∂log r_b``
    (nonzero only for ``kl_weight="ratio"`` at the sequence level; None where 0 or unless ``with_grad``). Factors of
    1 and 0 are skipped and k3's ``k − k'(x)`` is taken as ``−x``: this runs on every chunk of the CPU trainer."""
    x = torch.where(valid, rf - lp, 0.0)
    gate = None
    if o.kl_input_clamp is not None:
        c = o.kl_input_clamp
        gate = ((x >= -c) & (x <= c)).float()
        x = x.clamp(-c, c)
    if o.kl_estimator == "k1":
        k, dk = -x, -1.0
    elif o.kl_estimator == "k2":
        k, dk = 0.5 * x * x, x
    else:
        ex = torch.exp(x)
        k, dk = ex - 1.0 - x, ex - 1.0
    seq_w = o.kl_weight == "ratio" and o.seq_level
    w = None  # None: the weight is 1 (none, score)
    if o.kl_weight == "ratio":
        w = r
    elif o.kl_weight == "sampling_ratio":
        w = torch.exp(torch.where(valid, lp - sp, 0.0))
    kl = go = None
    if value or o.kl_output_clamp is not None:
        kl = k if w is None else w * k
        if o.kl_output_clamp is not None:
            c = o.kl_output_clamp
            go = ((kl >= -c) & (kl <= c)).float()
            kl = kl.clamp(-c, c)
    if not with_grad:
        return kl, None, None
    # ∂kl/∂logp = (∂W/∂logp)·k − W·k'(x): ∂W/∂logp is 0 (none; ratio at the sequence level), 1 (score) or W
    k_minus_dk = -x if o.kl_estimator == "k3" else k - dk
    if o.kl_weight == "none":
        dkl = -dk
    elif o.kl_weight == "score":
        dkl = k_minus_dk
    elif seq_w:
        dkl = -(w * dk)
    else:
        dkl = w * k_minus_dk
    dkl_seq = w * k if seq_w else None
    for factor in (gate, go):
        if factor is not None:
            dkl = dkl * factor
            dkl_seq = None if dkl_seq is None else dkl_seq * factor
    return kl, dkl, dkl_seq


def _chunks(sid_N, c: LossCall, n_tok: int):
    """Chunks of about ``TORCH_CHUNK`` tokens: ``(index, seq_add, per_token)`` with ``seq_add(acc_B, x)`` adding the
    chunk's per-sequence sums of ``x`` into ``acc_B`` and ``per_token(x_B)`` spreading per-sequence values over
    the chunk's tokens. Padded ``[B, T]``: chunks of rows; packed ``[N]``: token ranges with their sequence ids."""
    if sid_N is None:
        rows = max(1, TORCH_CHUNK // max(c.max_len, 1))
        for b0 in range(0, c.n_seqs, rows):
            sl = slice(b0, min(b0 + rows, c.n_seqs))
            yield sl, (lambda acc, x, sl=sl: acc[sl].add_(x.sum(-1))), (lambda x_B, sl=sl: x_B[sl, None])
    else:
        for n0 in range(0, n_tok, TORCH_CHUNK):
            sl = slice(n0, min(n0 + TORCH_CHUNK, n_tok))
            sid = sid_N[sl]
            yield sl, (lambda acc, x, sid=sid: acc.index_add_(0, sid, x)), (lambda x_B, sid=sid: x_B[sid])


def torch_forward(logp, old, ref, samp, adv, mask, isw, sid_N, c: LossCall):
    """The kernels' algorithm in torch, chunk by chunk: per-sequence sums, then the finaliser's formulas.

    Temporaries are a few chunk-sized fp32 tensors; what backward needs is three ``[B]`` vectors."""
    o, B, dev = c.options, c.n_seqs, logp.device
    zeros = lambda: torch.zeros(B, dtype=torch.float32, device=dev)  # noqa: E731
    num_B, cnt_B, kl_B, low_B, high_B, reg_B, s_B = (zeros() for _ in range(N_PARTS))
    chunks = list(_chunks(sid_N, c, logp.shape[0]))
    r_B = None
    if o.seq_level:  # first pass: log r_b = Σ m (logp − old) / max(Σ m, 1), and Σ m·isw for the [B] shortcut
        lr_B = zeros()
        wm_B = cnt_B if isw is None else zeros()
        for sl, seq_add, _ in chunks:
            m = mask[sl].float()
            seq_add(lr_B, torch.where(m != 0, m * (logp[sl].float() - old[sl].float()), 0.0))
            seq_add(cnt_B, m)
            if isw is not None:
                seq_add(wm_B, m * isw[sl])
        r_B = torch.exp(lr_B / cnt_B.clamp(min=1.0))  # [B]
    adv_f = adv.float()
    pg_per_seq = o.seq_level and not c.adv_per_token  # the policy term is one value per sequence: done on [B]
    for sl, seq_add, per_token in chunks:
        m = mask[sl].float()
        valid = m != 0
        lp = logp[sl].float()
        r = per_token(r_B).expand(m.shape) if o.seq_level else torch.exp(torch.where(valid, lp - old[sl].float(), 0.0))
        if o.beta != 0.0:
            sp = samp[sl].float() if o.kl_weight == "sampling_ratio" else lp
            seq_w = o.seq_level and o.kl_weight == "ratio"  # the weight's gradient goes through log r_b
            kl, _, dkl_seq = kl_term(lp, ref[sl].float(), sp, r, valid, o, with_grad=seq_w)
            mkl = torch.where(valid, m * kl, 0.0)
            seq_add(kl_B, mkl)
            seq_add(num_B, o.beta * mkl)
            if seq_w:
                seq_add(s_B, torch.where(valid, m * (o.beta * dkl_seq), 0.0))
        if not o.seq_level:  # the sequence level counted in its first pass
            seq_add(cnt_B, m)
        if pg_per_seq:
            continue
        a = adv_f[sl] if c.adv_per_token else per_token(adv_f)
        loss, dlr = policy_term(r, lp, a, o, with_grad=o.seq_level)
        if isw is not None:
            loss = isw[sl] * loss
            if o.seq_level:
                dlr = isw[sl] * dlr
        seq_add(num_B, torch.where(valid, m * loss, 0.0))
        low, high = clip_flags(r, a, o)
        seq_add(low_B, m * low)
        seq_add(high_B, m * high)
        seq_add(reg_B, m * torch.maximum(low, high))
        if o.seq_level:
            seq_add(s_B, torch.where(valid, m * dlr, 0.0))
    if pg_per_seq:
        pg_B, dlr_B = policy_term(r_B, None, adv_f, o)  # [B]
        num_B += pg_B * wm_B
        s_B += dlr_B * wm_B
    total_cnt = cnt_B.sum()
    tok_denom = total_cnt.clamp(min=1.0)
    cnt_c = cnt_B.clamp(min=1.0)
    if o.reduction == "grpo":
        loss = (num_B / cnt_c).sum() / B
        w_B = 1.0 / (B * cnt_c)
    else:
        if o.reduction == "bnpo":
            denom = tok_denom
        elif o.reduction == "dr_grpo":
            denom = torch.tensor(float(B * c.completion_length), device=dev)
        elif c.num_items is None:
            denom = tok_denom
        else:
            denom = torch.as_tensor(c.num_items, dtype=torch.float32, device=dev).clamp(min=1.0)
        loss = num_B.sum() / denom
        w_B = (1.0 / denom).expand(B)
    if pg_per_seq:  # one clip flag per sequence, mean over sequences
        low_B, high_B = clip_flags(r_B, adv_f, o)
        clip = [x.sum() / B for x in (low_B, high_B, torch.maximum(low_B, high_B))]
    else:
        clip = [x.sum() / tok_denom for x in (low_B, high_B, reg_B)]
    metrics = torch.stack([kl_B.sum() / tok_denom, *clip])
    g_B = w_B * s_B / cnt_c if o.seq_level else w_B
    return loss, metrics, w_B.contiguous(), g_B, r_B


def torch_backward(grad, logp, old, ref, samp, adv, mask, isw, sid_N, w_B, g_B, r_B, c: LossCall):
    """``dlogp`` chunk by chunk, from the per-sequence coefficients of :func:`torch_forward`."""
    o = c.options
    dlogp = torch.empty_like(logp)
    adv_f = adv.float()
    for sl, _, per_token in _chunks(sid_N, c, logp.shape[0]):
        m = mask[sl].float()
        valid = m != 0
        lp = logp[sl].float()
        w = per_token(w_B)
        if o.seq_level:
            d = m * per_token(g_B)
            r = per_token(r_B).expand(m.shape)
        else:
            a = adv_f[sl] if c.adv_per_token else per_token(adv_f)
            r = torch.exp(torch.where(valid, lp - old[sl].float(), 0.0))
            dlr = policy_term(r, lp, a, o)[1]
            d = w * m * (dlr if isw is None else isw[sl] * dlr)
        if o.beta != 0.0:
            sp = samp[sl].float() if o.kl_weight == "sampling_ratio" else lp
            d = d + w * m * o.beta * kl_term(lp, ref[sl].float(), sp, r, valid, o, value=False)[1]
        dlogp[sl] = torch.where(valid, grad * d, 0.0).to(logp.dtype)
    return dlogp
