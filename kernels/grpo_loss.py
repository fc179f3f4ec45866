"""GRPO-family policy loss (grpo, bnpo, dr_grpo, dapo; GSPO's sequence level) in one Triton pass each way.

Shape legend: B sequences, T padded length, N packed tokens, C token chunks per sequence, K partial sums.

Math (TRL 1.16 ``GRPOTrainer._compute_loss``; ``kernels/reference.py::grpo_loss_ref`` is the spec). With the mask
``m`` and the importance weight ``r = exp(logp − old)`` per token (``importance_sampling_level="token"``) or
``r_b = exp(Σ_t m (logp − old) / max(Σ_t m, 1))`` per sequence (``"sequence"``, GSPO)::

    r1 = min(r, δ) (delta given)    r2 = clamp(r, 1 − ε_low, 1 + ε_high)
    ℓ  = −min(r1·A, r2·A)
    ℓ  = min(ℓ, −c·A) where A < 0   (dual_clip_c = c, NeMo-RL / veRL)
    ℓ  = ω·ℓ                        (rollout IS weight ω per token, a constant: ``rollout_is.py``; rollout_is ≠ none)
    ℓ += β·(exp(ref − logp) − (ref − logp) − 1)   (k3 KL, β ≠ 0)

    grpo    mean_b Σ_t m ℓ / max(Σ_t m, 1)      bnpo  Σ m ℓ / max(Σ m, 1)
    dr_grpo Σ m ℓ / (B · max_completion_length)  dapo  Σ m ℓ / max(num_items_in_batch or Σ m, 1)

so the loss is ``Σ_{b,t} w_b m_t ℓ_t`` with one weight ``w_b`` per sequence, and its gradient w.r.t. ``logp`` is
elementwise once ``w_b`` is known (at the sequence level, plus a per-sequence sum ``S_b = Σ_t m ∂ℓ_t/∂log r_b``
spread back over the tokens with weight ``m_t / max(Σ_t m, 1)``). Gradients of ``min`` and ``clamp`` follow torch's
autograd exactly: a tie in ``min`` sends half the gradient to each side, ``clamp`` passes it on its closed range.

Kernels (forward: ``_grpo_loss_fwd_kernel`` + the one-program ``_grpo_loss_finalize_kernel``; backward:
``_grpo_loss_bwd_kernel``):
- forward, grid (B, C): each program streams its chunk of one sequence in blocks and writes K = 7 partial sums
  (Σ m ℓ, Σ m, Σ m·kl, three clip counts, S_b) to ``part [K, B·C]``. Traffic per token: read logp, old, mask
  (+ ref when β ≠ 0, + the advantage when per token, + the fp32 IS weight when on) once; write 28 bytes per
  program. At the sequence level C = 1: a first pass reads logp, old, mask for ``log r_b``, the second reads logp,
  mask (+ ref, + advantage, + IS weight).
- finalize, one program: reduces ``part`` over chunks and sequences in a fixed order (deterministic, no atomics),
  writes the loss, the 4 metrics and per-sequence backward coefficients ``w_b`` and ``w_b·S_b / max(Σ_t m, 1)``.
- backward, grid (B, C): reads the same per-token inputs (the sequence level needs neither ``old`` nor the
  advantages) and writes ``dlogp`` once. No host synchronisation anywhere; the upstream gradient is read on device.

Plain-torch path (CPU without the interpreter): the same algorithm and closed-form gradient in torch, chunk by chunk
(``TORCH_CHUNK`` tokens), saving the same two ``[B]`` vectors for backward instead of autograd's temporaries.

Departure from the reference: where ``mask == 0`` the log-ratio and ``ref − logp`` are taken as 0 before ``exp``,
so garbage (±inf) in padding cannot turn into NaN through ``0 · inf``; on finite inputs the numbers are the same.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ._utils import FLOAT_DTYPES, HAS_TRITON, check_cu_seqlens, check_shape, check_tensor, seq_index, use_triton
from .reference import LOSS_TYPES
from .rollout_is import MODES as ROLLOUT_IS_MODES
from .rollout_is import rollout_is_weights

LEVELS = ("token", "sequence")
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, *FLOAT_DTYPES)
N_PARTS = 7  # Σ m ℓ, Σ m, Σ m·kl, Σ m·low, Σ m·high, Σ m·region, S_b
MAX_BLOCK = 1024  # tokens per loop step of a program
TARGET_PROGRAMS = 1024  # token level: split sequences into chunks until about this many programs run (8 per SM)
MAX_CHUNK_BLOCKS = 8  # ... with at most this many blocks per program
FINALIZE_BLOCK_B = 128  # sequences per loop step of the one-program finaliser
TORCH_CHUNK = 65536  # plain-torch path: tokens per chunk (a few fp32 temporaries of this size)
METRIC_NAMES = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


if HAS_TRITON:  # absent on some platforms: the plain-torch path still works there
    import triton
    import triton.language as tl

    @triton.jit
    def _clipped_pg(r, a, eps_low, eps_high, delta, dual_c, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
        """Per-token policy loss ``ℓ``, ``∂ℓ/∂r`` (torch's tie rules) and ``r1`` (the ratio the metrics use)."""
        lo = 1.0 - eps_low
        hi = 1.0 + eps_high
        r2 = tl.minimum(tl.maximum(r, lo), hi)
        dr2 = ((r >= lo) & (r <= hi)).to(tl.float32)
        if HAS_DELTA:
            r1 = tl.minimum(r, delta)
            dr1 = (r <= delta).to(tl.float32)
        else:
            r1 = r
            dr1 = tl.full(r.shape, 1.0, tl.float32)
        x1 = r1 * a
        x2 = r2 * a
        loss = -tl.minimum(x1, x2)
        dloss = -a * tl.where(x1 < x2, dr1, tl.where(x1 > x2, dr2, 0.5 * (dr1 + dr2)))
        if HAS_DUAL:
            cap = -dual_c * a
            neg = a < 0
            keep = tl.where(loss < cap, 1.0, tl.where(loss == cap, 0.5, 0.0))
            dloss = tl.where(neg, dloss * keep, dloss)
            loss = tl.where(neg, tl.minimum(loss, cap), loss)
        return loss, dloss, r1


    @triton.jit
    def _seq_bounds(cu_ptr, b, c, T, chunk_len, PACKED: tl.constexpr):
        """First token offset of sequence ``b``, its length, and the [lo, hi) token range of chunk ``c``."""
        if PACKED:
            start = tl.load(cu_ptr + b).to(tl.int64)
            length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
        else:
            start = b * T
            length = b * 0 + T
        lo = c * chunk_len
        hi = tl.minimum(lo + chunk_len, length)
        return start, length, lo, hi


    # Reads per token: logp, old, mask (+ ref when HAS_KL, + adv when ADV_PER_TOKEN, + isw when HAS_IS); twice at
    # SEQ_LEVEL.
    # Writes N_PARTS fp32 per program.
    @triton.jit
    def _grpo_loss_fwd_kernel(
        logp_ptr, old_ptr, ref_ptr, adv_ptr, mask_ptr, isw_ptr, cu_ptr, part_ptr,
        T, n_chunks, chunk_len, n_progs,
        eps_low, eps_high, delta, dual_c, beta,
        PACKED: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEQ_LEVEL: tl.constexpr, HAS_KL: tl.constexpr,
        HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_IS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        start, length, lo, hi = _seq_bounds(cu_ptr, b, c, T, chunk_len, PACKED)
        offs = tl.arange(0, BLOCK)
        zero = tl.zeros([BLOCK], tl.float32)

        log_w = 0.0
        if SEQ_LEVEL:  # first pass over the whole sequence (C = 1): log r_b = Σ m (logp − old) / max(Σ m, 1)
            acc_lr = zero
            acc_m = zero
            for off in range(0, length, BLOCK):
                idx = start + off + offs
                inb = off + offs < length
                m = tl.load(mask_ptr + idx, mask=inb, other=0).to(tl.float32)
                lp = tl.load(logp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                od = tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                acc_lr += tl.where(m != 0, m * (lp - od), 0.0)
                acc_m += m
            cnt_seq = tl.sum(acc_m, axis=0)
            log_w = tl.sum(acc_lr, axis=0) / tl.maximum(cnt_seq, 1.0)

        if not ADV_PER_TOKEN:
            a_seq = tl.load(adv_ptr + b).to(tl.float32)
        acc_loss = zero
        acc_cnt = zero
        acc_kl = zero
        acc_low = zero
        acc_high = zero
        acc_reg = zero
        acc_s = zero
        for off in range(lo, hi, BLOCK):
            idx = start + off + offs
            inb = off + offs < hi
            m = tl.load(mask_ptr + idx, mask=inb, other=0).to(tl.float32)
            valid = m != 0
            lp = tl.load(logp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
            if ADV_PER_TOKEN:
                a = tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32)
            else:
                a = zero + a_seq
            if SEQ_LEVEL:
                r = zero + tl.exp(log_w)
            else:
                od = tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                r = tl.exp(tl.where(valid, lp - od, 0.0))
            loss, dloss, r1 = _clipped_pg(r, a, eps_low, eps_high, delta, dual_c, HAS_DELTA, HAS_DUAL)
            if HAS_IS:  # rollout IS weight: the policy-gradient term only
                isw = tl.load(isw_ptr + idx, mask=inb, other=0.0)
                loss = isw * loss
                dloss = isw * dloss
            if HAS_KL:
                rf = tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                d = tl.where(valid, rf - lp, 0.0)
                kl = tl.exp(d) - d - 1.0
                loss += beta * kl
                acc_kl += m * kl
            low = ((r1 < 1.0 - eps_low) & (a < 0)).to(tl.float32)
            high = ((r1 > 1.0 + eps_high) & (a > 0)).to(tl.float32)
            acc_loss += tl.where(valid, m * loss, 0.0)
            acc_cnt += m
            acc_low += m * low
            acc_high += m * high
            acc_reg += m * tl.maximum(low, high)
            acc_s += tl.where(valid, m * dloss * r, 0.0)

        p = b * n_chunks + c
        tl.store(part_ptr + p, tl.sum(acc_loss, axis=0))
        tl.store(part_ptr + n_progs + p, tl.sum(acc_cnt, axis=0))
        tl.store(part_ptr + 2 * n_progs + p, tl.sum(acc_kl, axis=0))
        if SEQ_LEVEL and not ADV_PER_TOKEN:  # one clip flag per sequence, TRL's mean over sequences
            r1_seq = tl.exp(log_w)
            if HAS_DELTA:
                r1_seq = tl.minimum(r1_seq, delta)
            low_s = ((r1_seq < 1.0 - eps_low) & (a_seq < 0)).to(tl.float32)
            high_s = ((r1_seq > 1.0 + eps_high) & (a_seq > 0)).to(tl.float32)
            tl.store(part_ptr + 3 * n_progs + p, low_s)
            tl.store(part_ptr + 4 * n_progs + p, high_s)
            tl.store(part_ptr + 5 * n_progs + p, tl.maximum(low_s, high_s))
        else:
            tl.store(part_ptr + 3 * n_progs + p, tl.sum(acc_low, axis=0))
            tl.store(part_ptr + 4 * n_progs + p, tl.sum(acc_high, axis=0))
            tl.store(part_ptr + 5 * n_progs + p, tl.sum(acc_reg, axis=0))
        tl.store(part_ptr + 6 * n_progs + p, tl.sum(acc_s, axis=0))


    # Reads part [N_PARTS, B·C] (twice: totals, then per-sequence coefficients); writes loss, 4 metrics, w [B], g [B].
    @triton.jit
    def _grpo_loss_finalize_kernel(
        part_ptr, loss_ptr, metrics_ptr, wseq_ptr, gseq_ptr, num_items_ptr,
        B, n_chunks, n_progs, num_items, dr_denom,
        LOSS_TYPE: tl.constexpr, NUM_ITEMS: tl.constexpr, SEQ_LEVEL: tl.constexpr, CLIP_PER_SEQ: tl.constexpr,
        BLOCK_B: tl.constexpr, C_PAD: tl.constexpr,
    ):
        rows = tl.arange(0, BLOCK_B)
        cols = tl.arange(0, C_PAD)[None, :]
        acc = tl.zeros([BLOCK_B], tl.float32)
        acc_num, acc_cnt, acc_seq, acc_kl, acc_low, acc_high, acc_reg = acc, acc, acc, acc, acc, acc, acc
        for b0 in range(0, B, BLOCK_B):
            bb = (b0 + rows)[:, None]
            ok = (bb < B) & (cols < n_chunks)
            p = part_ptr + bb * n_chunks + cols
            num_b = tl.sum(tl.load(p, mask=ok, other=0.0), axis=1)
            cnt_b = tl.sum(tl.load(p + n_progs, mask=ok, other=0.0), axis=1)
            acc_num += num_b
            acc_cnt += cnt_b
            acc_seq += num_b / tl.maximum(cnt_b, 1.0)
            acc_kl += tl.sum(tl.load(p + 2 * n_progs, mask=ok, other=0.0), axis=1)
            acc_low += tl.sum(tl.load(p + 3 * n_progs, mask=ok, other=0.0), axis=1)
            acc_high += tl.sum(tl.load(p + 4 * n_progs, mask=ok, other=0.0), axis=1)
            acc_reg += tl.sum(tl.load(p + 5 * n_progs, mask=ok, other=0.0), axis=1)
        total_num = tl.sum(acc_num, axis=0)
        total_cnt = tl.sum(acc_cnt, axis=0)
        tok_denom = tl.maximum(total_cnt, 1.0)
        if LOSS_TYPE == 0:  # grpo
            loss = tl.sum(acc_seq, axis=0) / B
        elif LOSS_TYPE == 1:  # bnpo
            denom = tok_denom
            loss = total_num / denom
        elif LOSS_TYPE == 2:  # dr_grpo
            denom = total_cnt * 0.0 + dr_denom
            loss = total_num / denom
        else:  # dapo
            if NUM_ITEMS == 2:
                denom = tl.maximum(tl.load(num_items_ptr).to(tl.float32), 1.0)
            elif NUM_ITEMS == 1:
                denom = tl.maximum(total_cnt * 0.0 + num_items, 1.0)
            else:
                denom = tok_denom
            loss = total_num / denom
        tl.store(loss_ptr, loss)
        clip_denom = tok_denom
        if CLIP_PER_SEQ:
            clip_denom = total_cnt * 0.0 + B
        tl.store(metrics_ptr, tl.sum(acc_kl, axis=0) / tok_denom)
        tl.store(metrics_ptr + 1, tl.sum(acc_low, axis=0) / clip_denom)
        tl.store(metrics_ptr + 2, tl.sum(acc_high, axis=0) / clip_denom)
        tl.store(metrics_ptr + 3, tl.sum(acc_reg, axis=0) / clip_denom)

        for b0 in range(0, B, BLOCK_B):
            b1 = b0 + rows
            bb = b1[:, None]
            ok = (bb < B) & (cols < n_chunks)
            cnt_b = tl.sum(tl.load(part_ptr + n_progs + bb * n_chunks + cols, mask=ok, other=0.0), axis=1)
            cnt_b = tl.maximum(cnt_b, 1.0)
            if LOSS_TYPE == 0:
                w_b = 1.0 / (B * cnt_b)
            else:
                w_b = tl.zeros([BLOCK_B], tl.float32) + 1.0 / denom
            tl.store(wseq_ptr + b1, w_b, mask=b1 < B)
            if SEQ_LEVEL:  # C = 1: S_b sits at column 0
                s_b = tl.load(part_ptr + 6 * n_progs + b1, mask=b1 < B, other=0.0)
                tl.store(gseq_ptr + b1, w_b * s_b / cnt_b, mask=b1 < B)


    # Reads per token: mask, logp (+ old, adv and isw unless SEQ_LEVEL, + ref when HAS_KL); writes dlogp once.
    @triton.jit
    def _grpo_loss_bwd_kernel(
        grad_ptr, logp_ptr, old_ptr, ref_ptr, adv_ptr, mask_ptr, isw_ptr, cu_ptr, wseq_ptr, gseq_ptr, dlogp_ptr,
        T, chunk_len,
        eps_low, eps_high, delta, dual_c, beta,
        PACKED: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEQ_LEVEL: tl.constexpr, HAS_KL: tl.constexpr,
        HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_IS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        start, length, lo, hi = _seq_bounds(cu_ptr, b, c, T, chunk_len, PACKED)
        offs = tl.arange(0, BLOCK)
        g = tl.load(grad_ptr).to(tl.float32)
        w = tl.load(wseq_ptr + b)
        if SEQ_LEVEL:
            gs = tl.load(gseq_ptr + b)
        if not ADV_PER_TOKEN:
            a_seq = tl.load(adv_ptr + b).to(tl.float32)
        for off in range(lo, hi, BLOCK):
            idx = start + off + offs
            inb = off + offs < hi
            m = tl.load(mask_ptr + idx, mask=inb, other=0).to(tl.float32)
            valid = m != 0
            lp = tl.load(logp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
            if SEQ_LEVEL:
                d = m * gs
            else:
                od = tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                if ADV_PER_TOKEN:
                    a = tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                else:
                    a = tl.zeros([BLOCK], tl.float32) + a_seq
                r = tl.exp(tl.where(valid, lp - od, 0.0))
                _, dloss, _ = _clipped_pg(r, a, eps_low, eps_high, delta, dual_c, HAS_DELTA, HAS_DUAL)
                if HAS_IS:
                    dloss = tl.load(isw_ptr + idx, mask=inb, other=0.0) * dloss
                d = w * m * dloss * r
            if HAS_KL:
                rf = tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                d += w * m * beta * (1.0 - tl.exp(tl.where(valid, rf - lp, 0.0)))
            d = tl.where(valid, g * d, 0.0)
            tl.store(dlogp_ptr + idx, d.to(dlogp_ptr.dtype.element_ty), mask=inb)


@dataclass(frozen=True)
class _Options:
    """Static options of one call (constexpr switches and scalars of the kernels)."""

    loss_type: str
    seq_level: bool
    adv_per_token: bool
    beta: float
    eps_low: float
    eps_high: float
    delta: float | None
    dual_c: float | None
    max_completion_length: int
    num_items: float | torch.Tensor | None
    n_seqs: int
    max_len: int
    packed: bool
    rollout_is: str = "none"
    rollout_is_cap: float = 3.0
    rollout_is_min: float = 0.0


def _launch_config(max_len: int, n_seqs: int) -> tuple[int, int, int, int]:
    """Block size, chunk length, chunks per sequence (token level) and warps.

    One program per (sequence, chunk): chunks hold as many blocks as keep about ``TARGET_PROGRAMS`` programs in
    flight (enough loads in flight to cover memory latency), between 1 and ``MAX_CHUNK_BLOCKS`` blocks."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(max(max_len, 1))))
    blocks_per_seq = triton.cdiv(max(max_len, 1), block)
    chunk = block * max(1, min(MAX_CHUNK_BLOCKS, n_seqs * blocks_per_seq // TARGET_PROGRAMS))
    n_chunks = max(1, triton.cdiv(max_len, chunk))
    return block, chunk, n_chunks, 4 if block >= 512 else 2


def _mask_for_kernel(mask: torch.Tensor) -> torch.Tensor:
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _triton_forward(logp, old, ref, adv, mask, isw, cu, o: _Options):
    B = o.n_seqs
    block, chunk, n_chunks, warps = _launch_config(o.max_len, o.n_seqs)
    if o.seq_level:
        n_chunks, chunk = 1, max(o.max_len, 1)
    n_progs = B * n_chunks
    dev = logp.device
    part = torch.empty((N_PARTS, n_progs), device=dev, dtype=torch.float32)
    T = 0 if o.packed else logp.shape[1]
    cu_arg = cu if o.packed else part  # an unused pointer when padded
    ref_arg = ref if ref is not None else logp
    scalars = (o.eps_low, o.eps_high, o.delta or 0.0, o.dual_c or 0.0, o.beta)
    flags = dict(PACKED=o.packed, ADV_PER_TOKEN=o.adv_per_token, SEQ_LEVEL=o.seq_level, HAS_KL=o.beta != 0.0,
                 HAS_DELTA=o.delta is not None, HAS_DUAL=o.dual_c is not None, HAS_IS=isw is not None, BLOCK=block)
    _grpo_loss_fwd_kernel[(B, n_chunks)](
        logp, old, ref_arg, adv, _mask_for_kernel(mask), isw if isw is not None else logp, cu_arg, part, T, n_chunks,
        chunk, n_progs, *scalars,
        **flags, num_warps=warps,
    )
    loss = torch.empty((), device=dev, dtype=torch.float32)
    metrics = torch.empty(len(METRIC_NAMES), device=dev, dtype=torch.float32)
    wseq = torch.empty(B, device=dev, dtype=torch.float32)
    gseq = torch.empty(B, device=dev, dtype=torch.float32) if o.seq_level else wseq
    if isinstance(o.num_items, torch.Tensor):
        num_mode, num_ptr, num_val = 2, o.num_items, 0.0
    else:
        num_mode, num_ptr, num_val = (0, part, 0.0) if o.num_items is None else (1, part, float(o.num_items))
    _grpo_loss_finalize_kernel[(1,)](
        part, loss, metrics, wseq, gseq, num_ptr, B, n_chunks, n_progs, num_val, float(B * o.max_completion_length),
        LOSS_TYPE=LOSS_TYPES.index(o.loss_type), NUM_ITEMS=num_mode, SEQ_LEVEL=o.seq_level,
        CLIP_PER_SEQ=o.seq_level and not o.adv_per_token, BLOCK_B=min(FINALIZE_BLOCK_B, triton.next_power_of_2(B)),
        C_PAD=triton.next_power_of_2(n_chunks), num_warps=4,
    )
    return loss, metrics, wseq, gseq


def _triton_backward(grad, logp, old, ref, adv, mask, isw, cu, wseq, gseq, o: _Options):
    block, chunk, n_chunks, warps = _launch_config(o.max_len, o.n_seqs)
    dlogp = torch.empty_like(logp)
    _grpo_loss_bwd_kernel[(o.n_seqs, n_chunks)](
        grad, logp, old, ref if ref is not None else logp, adv, _mask_for_kernel(mask),
        isw if isw is not None else logp, cu if o.packed else wseq, wseq, gseq, dlogp, 0 if o.packed else logp.shape[1],
        chunk, o.eps_low, o.eps_high, o.delta or 0.0, o.dual_c or 0.0, o.beta,
        PACKED=o.packed, ADV_PER_TOKEN=o.adv_per_token, SEQ_LEVEL=o.seq_level, HAS_KL=o.beta != 0.0,
        HAS_DELTA=o.delta is not None, HAS_DUAL=o.dual_c is not None, HAS_IS=isw is not None, BLOCK=block,
        num_warps=warps,
    )
    return dlogp


class _GRPOLossFunction(torch.autograd.Function):
    """``seq`` is ``cu_seqlens`` on the Triton path, the packed tokens' sequence ids on the torch path (None when
    padded); ``isw`` the rollout IS weights (None: off). Both paths save only the inputs and two ``[B]`` vectors for
    backward."""

    @staticmethod
    def forward(ctx, logp, old, ref, adv, mask, isw, seq, o: _Options, triton_path: bool):
        fwd = _triton_forward if triton_path else _torch_forward
        loss, metrics, wseq, gseq = fwd(logp, old, ref, adv, mask, isw, seq, o)
        ctx.save_for_backward(logp, old, ref, adv, mask, isw, seq, wseq, gseq)
        ctx.options, ctx.triton_path = o, triton_path
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        logp, old, ref, adv, mask, isw, seq, wseq, gseq = ctx.saved_tensors
        grad = grad_loss.to(torch.float32).contiguous()
        bwd = _triton_backward if ctx.triton_path else _torch_backward
        dlogp = bwd(grad, logp, old, ref, adv, mask, isw, seq, wseq, gseq, ctx.options)
        return dlogp, None, None, None, None, None, None, None, None


def _clipped_pg_torch(r, a, o: _Options, *, with_grad: bool = True):
    """:func:`_clipped_pg` in torch: ``ℓ``, ``∂ℓ/∂r`` (torch's tie rules; None unless ``with_grad``) and ``r1``."""
    lo, hi = 1.0 - o.eps_low, 1.0 + o.eps_high
    r2 = r.clamp(lo, hi)
    r1 = r if o.delta is None else r.clamp(max=o.delta)
    if with_grad:
        dr2 = ((r >= lo) & (r <= hi)).float()
        dr1 = torch.ones_like(r) if o.delta is None else (r <= o.delta).float()
    x1, x2 = r1 * a, r2 * a
    loss = -torch.minimum(x1, x2)
    dloss = -a * torch.where(x1 < x2, dr1, torch.where(x1 > x2, dr2, 0.5 * (dr1 + dr2))) if with_grad else None
    if o.dual_c is not None:
        cap = -o.dual_c * a
        neg = a < 0
        if with_grad:
            keep = torch.where(loss < cap, 1.0, torch.where(loss == cap, 0.5, 0.0))
            dloss = torch.where(neg, dloss * keep, dloss)
        loss = torch.where(neg, torch.minimum(loss, cap), loss)
    return loss, dloss, r1


def _torch_chunks(sid_N, o: _Options, n_tok: int):
    """Chunks of about ``TORCH_CHUNK`` tokens: ``(index, seq_add, per_token)`` with ``seq_add(acc_B, x)`` adding the
    chunk's per-sequence sums of ``x`` into ``acc_B`` and ``per_token(x_B)`` spreading per-sequence values over
    the chunk's tokens. Padded ``[B, T]``: chunks of rows; packed ``[N]``: token ranges with their sequence ids."""
    if sid_N is None:
        rows = max(1, TORCH_CHUNK // max(o.max_len, 1))
        for b0 in range(0, o.n_seqs, rows):
            sl = slice(b0, min(b0 + rows, o.n_seqs))
            yield sl, (lambda acc, x, sl=sl: acc[sl].add_(x.sum(-1))), (lambda x_B, sl=sl: x_B[sl, None])
    else:
        for n0 in range(0, n_tok, TORCH_CHUNK):
            sl = slice(n0, min(n0 + TORCH_CHUNK, n_tok))
            sid = sid_N[sl]
            yield sl, (lambda acc, x, sid=sid: acc.index_add_(0, sid, x)), (lambda x_B, sid=sid: x_B[sid])


def _torch_forward(logp, old, ref, adv, mask, isw, sid_N, o: _Options):
    """The kernels' algorithm in torch, chunk by chunk: per-sequence sums, then the finaliser's formulas.

    Temporaries are a few chunk-sized fp32 tensors; what backward needs is two ``[B]`` vectors."""
    B, dev = o.n_seqs, logp.device
    zeros = lambda: torch.zeros(B, dtype=torch.float32, device=dev)  # noqa: E731
    num_B, cnt_B, kl_B, low_B, high_B, reg_B, s_B = (zeros() for _ in range(N_PARTS))
    chunks = list(_torch_chunks(sid_N, o, logp.shape[0]))
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
    pg_per_seq = o.seq_level and not o.adv_per_token  # the policy term is one value per sequence: done on [B]
    for sl, seq_add, per_token in chunks:
        m = mask[sl].float()
        valid = m != 0
        lp = logp[sl].float()
        if o.beta != 0.0:
            d = torch.where(valid, ref[sl].float() - lp, 0.0)
            kl = torch.exp(d) - d - 1
            seq_add(kl_B, m * kl)
            seq_add(num_B, torch.where(valid, m * (o.beta * kl), 0.0))
        if not o.seq_level:  # the sequence level counted in its first pass
            seq_add(cnt_B, m)
        if pg_per_seq:
            continue
        a = adv_f[sl] if o.adv_per_token else per_token(adv_f)
        if o.seq_level:
            r = per_token(r_B).expand(m.shape)
        else:
            r = torch.exp(torch.where(valid, lp - old[sl].float(), 0.0))
        loss, dloss, r1 = _clipped_pg_torch(r, a, o, with_grad=o.seq_level)
        if isw is not None:
            loss = isw[sl] * loss
            if o.seq_level:
                dloss = isw[sl] * dloss
        seq_add(num_B, torch.where(valid, m * loss, 0.0))
        low, high = ((r1 < 1.0 - o.eps_low) & (a < 0)).float(), ((r1 > 1.0 + o.eps_high) & (a > 0)).float()
        seq_add(low_B, m * low)
        seq_add(high_B, m * high)
        seq_add(reg_B, m * torch.maximum(low, high))
        if o.seq_level:
            seq_add(s_B, torch.where(valid, m * dloss * r, 0.0))
    if pg_per_seq:
        pg_B, dpg_B, _ = _clipped_pg_torch(r_B, adv_f, o, with_grad=True)  # [B]
        num_B += pg_B * wm_B
        s_B = dpg_B * r_B * wm_B
    total_cnt = cnt_B.sum()
    tok_denom = total_cnt.clamp(min=1.0)
    cnt_c = cnt_B.clamp(min=1.0)
    if o.loss_type == "grpo":
        loss = (num_B / cnt_c).sum() / B
        w_B = 1.0 / (B * cnt_c)
    else:
        if o.loss_type == "bnpo":
            denom = tok_denom
        elif o.loss_type == "dr_grpo":
            denom = torch.tensor(float(B * o.max_completion_length), device=dev)
        elif o.num_items is None:
            denom = tok_denom
        else:
            denom = torch.as_tensor(o.num_items, dtype=torch.float32, device=dev).clamp(min=1.0)
        loss = num_B.sum() / denom
        w_B = (1.0 / denom).expand(B)
    if o.seq_level and not o.adv_per_token:  # one clip flag per sequence, mean over sequences
        r1_B = r_B if o.delta is None else r_B.clamp(max=o.delta)
        low_B = ((r1_B < 1.0 - o.eps_low) & (adv_f < 0)).float()
        high_B = ((r1_B > 1.0 + o.eps_high) & (adv_f > 0)).float()
        clip = [x.sum() / B for x in (low_B, high_B, torch.maximum(low_B, high_B))]
    else:
        clip = [x.sum() / tok_denom for x in (low_B, high_B, reg_B)]
    metrics = torch.stack([kl_B.sum() / tok_denom, *clip])
    g_B = w_B * s_B / cnt_c if o.seq_level else w_B
    return loss, metrics, w_B.contiguous(), g_B


def _torch_backward(grad, logp, old, ref, adv, mask, isw, sid_N, w_B, g_B, o: _Options):
    """``dlogp`` chunk by chunk, from the per-sequence coefficients of :func:`_torch_forward`."""
    dlogp = torch.empty_like(logp)
    adv_f = adv.float()
    for sl, _, per_token in _torch_chunks(sid_N, o, logp.shape[0]):
        m = mask[sl].float()
        valid = m != 0
        lp = logp[sl].float()
        w = per_token(w_B)
        if o.seq_level:
            d = m * per_token(g_B)
        else:
            a = adv_f[sl] if o.adv_per_token else per_token(adv_f)
            r = torch.exp(torch.where(valid, lp - old[sl].float(), 0.0))
            dloss = _clipped_pg_torch(r, a, o)[1]
            d = w * m * (dloss if isw is None else isw[sl] * dloss) * r
        if o.beta != 0.0:
            d = d + w * m * o.beta * (1.0 - torch.exp(torch.where(valid, ref[sl].float() - lp, 0.0)))
        dlogp[sl] = torch.where(valid, grad * d, 0.0).to(logp.dtype)
    return dlogp


def _check_scalar(name: str, value, *, low: float | None = None, strict: bool = False, allow_none=True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")


def _validate(logprobs, old_logprobs, advantages, mask, ref_logprobs, beta, epsilon_low, epsilon_high, delta,
              dual_clip_c, loss_type, importance_sampling_level, max_completion_length, num_items_in_batch,
              cu_seqlens, per_token_advantages, sampling_logprobs, rollout_is, rollout_is_cap,
              rollout_is_min) -> _Options:
    check_tensor("logprobs", logprobs, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    dev = logprobs.device
    packed = cu_seqlens is not None
    if packed and logprobs.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [N] when cu_seqlens is given (packed), got {tuple(logprobs.shape)}")
    if not packed and logprobs.dim() != 2:
        raise ValueError(f"logprobs must be 2-D [B, T] (padded), or 1-D [N] with cu_seqlens, "
                         f"got {tuple(logprobs.shape)}")
    like = f"logprobs {tuple(logprobs.shape)}"
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES, device=dev)
    check_shape("old_logprobs", old_logprobs, logprobs.shape, like)
    check_tensor("mask", mask, dtypes=MASK_DTYPES, device=dev)
    check_shape("mask", mask, logprobs.shape, like)
    _check_scalar("beta", beta, allow_none=False)
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("ref_logprobs is required when beta != 0 (the KL penalty needs the reference log-probs)")
    if ref_logprobs is not None:
        check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("ref_logprobs", ref_logprobs, logprobs.shape, like)
    if rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, got {rollout_is!r}")
    if sampling_logprobs is not None:
        check_tensor("sampling_logprobs", sampling_logprobs, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("sampling_logprobs", sampling_logprobs, logprobs.shape, like)
    elif rollout_is != "none":
        raise ValueError(f"sampling_logprobs is required when rollout_is={rollout_is!r} (the sampler's log-probs)")
    _check_scalar("rollout_is_min", rollout_is_min, low=0.0, allow_none=False)
    _check_scalar("rollout_is_cap", rollout_is_cap, low=rollout_is_min, strict=True, allow_none=False)
    if packed:
        check_tensor("cu_seqlens", cu_seqlens, device=dev)
        check_cu_seqlens(cu_seqlens, logprobs.shape[0])
        n_seqs = cu_seqlens.numel() - 1
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # launch geometry: one read of B + 1 offsets
    else:
        n_seqs, max_len = logprobs.shape
    check_tensor("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES, device=dev)
    if per_token_advantages is not None and not isinstance(per_token_advantages, bool):
        raise ValueError(f"per_token_advantages must be None, True or False, got {per_token_advantages!r}")
    if packed:
        n_tok = logprobs.shape[0]
        if advantages.dim() != 1 or advantages.shape[0] not in (n_seqs, n_tok):
            raise ValueError(f"advantages must be [B={n_seqs}] or [N={n_tok}] for packed input, "
                             f"got {tuple(advantages.shape)}")
        adv_per_token = advantages.shape[0] == n_tok and n_tok != n_seqs
        if per_token_advantages is not None:
            expected = n_tok if per_token_advantages else n_seqs
            if advantages.shape[0] != expected:
                raise ValueError(f"advantages has {advantages.shape[0]} values, per_token_advantages="
                                 f"{per_token_advantages} expects {expected}")
            adv_per_token = per_token_advantages
    else:
        if advantages.shape in ((n_seqs,), (n_seqs, 1)):
            adv_per_token = False
        elif advantages.shape == (n_seqs, max_len):
            adv_per_token = True
        else:
            raise ValueError(f"advantages must be [B], [B, 1] or [B, T] with B, T = {n_seqs}, {max_len}, "
                             f"got {tuple(advantages.shape)}")
        if per_token_advantages is not None and per_token_advantages != adv_per_token:
            raise ValueError(f"per_token_advantages={per_token_advantages} contradicts advantages of shape "
                             f"{tuple(advantages.shape)}")
    _check_scalar("epsilon_low", epsilon_low, low=0.0, allow_none=False)
    _check_scalar("epsilon_high", epsilon_high, low=0.0)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    _check_scalar("delta", delta, low=1.0 + eps_high, strict=True)
    _check_scalar("dual_clip_c", dual_clip_c, low=1.0, strict=True)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}")
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    if loss_type == "dr_grpo" and packed and max_completion_length is None:
        raise ValueError("max_completion_length is required for loss_type='dr_grpo' with packed input "
                         "(padded input defaults it to T)")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one value, got shape {tuple(num_items_in_batch.shape)}")
        num_items = num_items_in_batch.to(device=dev, dtype=torch.float32).reshape(())
    else:
        _check_scalar("num_items_in_batch", num_items_in_batch, low=0.0)
        num_items = num_items_in_batch
    return _Options(
        loss_type=loss_type, seq_level=importance_sampling_level == "sequence", adv_per_token=adv_per_token,
        beta=float(beta), eps_low=float(epsilon_low), eps_high=float(eps_high),
        delta=None if delta is None else float(delta), dual_c=None if dual_clip_c is None else float(dual_clip_c),
        max_completion_length=max_completion_length or max_len, num_items=num_items, n_seqs=n_seqs,
        max_len=max_len, packed=packed, rollout_is=rollout_is, rollout_is_cap=float(rollout_is_cap),
        rollout_is_min=float(rollout_is_min),
    )


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    dual_clip_c: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    per_token_advantages: bool | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    rollout_is: str = "none",
    rollout_is_cap: float = 3.0,
    rollout_is_min: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-family loss and TRL's metrics; the math is in the module docstring.

    Inputs: padded ``logprobs``/``old_logprobs``/``ref_logprobs``/``mask`` ``[B, T]``, or packed ``[N]`` with
    ``cu_seqlens`` ``[B + 1]`` int32 (same results). ``mask`` is bool, integer or float (float values weigh
    tokens, as TRL's multiply does). ``advantages``: ``[B]`` (or ``[B, 1]``) per sequence, ``[B, T]`` / ``[N]``
    per token. Packed 1-D advantages of length N are per token unless N == B; then they are per sequence (the
    reference's rule) unless ``per_token_advantages=True`` says otherwise. Only ``logprobs`` receives a gradient:
    ``old_logprobs``, ``ref_logprobs`` and ``advantages`` are constants (TRL passes them detached).

    Rollout importance sampling (``kernels/rollout_is.py``, TRL's ``vllm_importance_sampling_*``):
    ``sampling_logprobs`` are the sampler's log-probs of the same tokens (a constant, like ``old_logprobs``);
    ``rollout_is`` one of none, token_truncate, token_mask, sequence_truncate, sequence_mask re-weights each token's
    policy-gradient term (not the KL term) by ``π_old / π_sampler`` (``exp(old − sampling)`` per token, or its
    product over the sequence), clamped to ``[rollout_is_min, rollout_is_cap]`` (truncate) or set to 0 outside it
    (mask). With ``sampling_logprobs`` and ``rollout_is="none"`` the loss is unchanged and only the
    ``sampling/sampling_logp_difference`` metrics are added.

    Returns ``(loss, metrics)``: loss a 0-d fp32 tensor; metrics detached 0-d fp32 tensors ``kl`` (β ≠ 0),
    ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (token means over the mask;
    at the sequence level with per-sequence advantages, means over sequences, as TRL), and with
    ``sampling_logprobs`` the ``sampling/...`` metrics of ``rollout_is.py``. No host synchronisation beyond input
    validation (packed input reads the B + 1 offsets once). Non-contiguous inputs are copied.
    """
    o = _validate(logprobs, old_logprobs, advantages, mask, ref_logprobs, beta, epsilon_low, epsilon_high, delta,
                  dual_clip_c, loss_type, importance_sampling_level, max_completion_length, num_items_in_batch,
                  cu_seqlens, per_token_advantages, sampling_logprobs, rollout_is, rollout_is_cap, rollout_is_min)
    ref = ref_logprobs.detach().contiguous() if o.beta != 0.0 else None
    old = old_logprobs.detach().contiguous()
    adv = advantages.detach().reshape(-1) if not o.adv_per_token else advantages.detach()
    adv = adv.contiguous()
    mask = mask.contiguous()
    logprobs = logprobs.contiguous()
    triton_path = use_triton(logprobs)
    need_sid = o.packed and (not triton_path or o.rollout_is.startswith("sequence"))
    sid_N = seq_index(cu_seqlens, logprobs.shape[0]) if need_sid else None  # [N], no host sync
    isw, is_metrics = None, {}
    if sampling_logprobs is not None:
        isw, is_metrics = rollout_is_weights(old, sampling_logprobs, mask, mode=o.rollout_is, cap=o.rollout_is_cap,
                                             low=o.rollout_is_min, sid_N=sid_N, n_seqs=o.n_seqs)
    seq = cu_seqlens.contiguous() if triton_path and o.packed else sid_N
    loss, metrics = _GRPOLossFunction.apply(logprobs, old, ref, adv, mask, isw, seq, o, triton_path)
    names = METRIC_NAMES if o.beta != 0.0 else METRIC_NAMES[1:]
    return loss, {**{name: metrics[METRIC_NAMES.index(name)].detach() for name in names}, **is_metrics}
