"""Triton kernels of ``grpo_loss`` and their launchers (the math is in ``grpo_loss.py``'s docstring).

Shape legend: B sequences, T padded length, N packed tokens, C token chunks per sequence, K partial sums.

- forward, ``_grpo_loss_fwd_kernel``, grid (B, C): each program streams its chunk of one sequence in blocks and
  writes K = 7 partial sums (Σ m ℓ, Σ m, Σ m·kl, three clip counts, S_b) to ``part [K, B·C]``; at the sequence
  level (C = 1) it also writes ``r_b`` to ``rseq [B]``. Traffic per token: read logp, old, mask (+ ref when β ≠ 0,
  + the sampler's log-prob for ``kl_weight="sampling_ratio"``, + the advantage when per token, + the fp32 IS weight
  when on) once; write 28 bytes per program. At the sequence level a first pass reads logp, old, mask for
  ``log r_b``, the second reads logp, mask (+ ref, + sampler log-prob, + advantage, + IS weight).
- finalize, ``_grpo_loss_finalize_kernel``, one program: reduces ``part`` over chunks and sequences in a fixed order
  (deterministic, no atomics), writes the loss, the 4 metrics and per-sequence backward coefficients ``w_b`` and
  ``w_b·S_b / max(Σ_t m, 1)``.
- backward, ``_grpo_loss_bwd_kernel``, grid (B, C): reads the same per-token inputs (the sequence level needs
  neither ``old`` nor the advantages) and writes ``dlogp`` once. No host synchronisation anywhere; the upstream
  gradient is read on device.

Numerics: everything in fp32 after the loads; the per-token derivatives are closed forms (``_policy_term``,
``_kl_term``) that follow torch's autograd rules for ``min`` / ``clamp`` ties, so the kernels match the autograd
reference to fp32 rounding.
"""

from __future__ import annotations

import torch

from .grpo_options import POLICY_TERMS, LossCall
from .names import KL_ESTIMATORS, KL_WEIGHTS, REDUCTIONS
from .utils import HAS_TRITON

N_PARTS = 7  # Σ m ℓ, Σ m, Σ m·kl, Σ m·low, Σ m·high, Σ m·region, S_b
MAX_BLOCK = 1024  # tokens per loop step of a program
TARGET_PROGRAMS = 1024  # token level: split sequences into chunks until about this many programs run (8 per SM)
MAX_CHUNK_BLOCKS = 8  # ... with at most this many blocks per program
FINALIZE_BLOCK_B = 128  # sequences per loop step of the one-program finaliser
N_METRICS = 4  # kl and three clip counts


if HAS_TRITON:  # absent on some platforms: the plain-torch path still works there
    import triton
    import triton.language as tl

    @triton.jit
    def _clipped_pg(r, a, eps_low, eps_high, delta, dual_c, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
        """Per-token clipped policy loss ``ℓ`` and ``∂ℓ/∂r`` (torch's tie rules)."""
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
        return loss, dloss

    @triton.jit
    def _policy_term(r, lp, a, eps_low, eps_high, delta, dual_c, tau_pos, tau_neg, PG: tl.constexpr,
                     HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
        """Policy loss ``ℓ`` per token and ``∂ℓ/∂log r`` (the ratio's log: ``logp`` at the token level, ``log r_b``
        at the sequence level; CISPO's detached ratio leaves only ``∂ℓ/∂logp``)."""
        if PG == 0:  # clipped (grpo, bnpo, dr_grpo, dapo)
            loss, dloss = _clipped_pg(r, a, eps_low, eps_high, delta, dual_c, HAS_DELTA, HAS_DUAL)
            dlr = dloss * r
        elif PG == 1:  # cispo (TRL): sg(min(r, ε_high))
            c = tl.minimum(r, eps_high)
            loss = -c * a * lp
            dlr = -c * a
        elif PG == 2:  # cispo_clamp (NeMo-RL): sg(clamp(r, 1 − ε_low, 1 + ε_high))
            c = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
            loss = -c * a * lp
            dlr = -c * a
        else:  # sapo: −(4/τ) σ(τ (r − 1)) A
            tau = tl.where(a > 0, tau_pos, tau_neg)
            s = tl.sigmoid(tau * (r - 1.0))
            loss = -(s * 4.0 / tau) * a
            dlr = -4.0 * s * (1.0 - s) * a * r
        return loss, dlr

    @triton.jit
    def _clip_flags(r, a, eps_low, eps_high, delta, PG: tl.constexpr, HAS_DELTA: tl.constexpr):
        """The clip-ratio metrics' (low, high) flags of one ratio (0/1 fp32)."""
        if PG == 0:
            r1 = r
            if HAS_DELTA:
                r1 = tl.minimum(r, delta)
            low = (r1 < 1.0 - eps_low) & (a < 0)
            high = (r1 > 1.0 + eps_high) & (a > 0)
        elif PG == 1:
            low = r < 0.0  # never: CISPO (TRL) caps from above only
            high = (r > eps_high) & (a > 0)
        elif PG == 2:
            low = r < 1.0 - eps_low
            high = r > 1.0 + eps_high
        else:
            low = r < 0.0  # sapo clips nothing
            high = r < 0.0
        return low.to(tl.float32), high.to(tl.float32)

    @triton.jit
    def _kl_term(lp, rf, sp, r, valid, kl_in, kl_out, KL_EST: tl.constexpr, KL_WEIGHT: tl.constexpr,
                 SEQ_W: tl.constexpr, HAS_KL_IN: tl.constexpr, HAS_KL_OUT: tl.constexpr):
        """Per-token KL value ``kl``, ``∂kl/∂logp`` (this token's own) and ``∂kl/∂log r_b`` (the sequence ratio's
        weight at the sequence level; 0 otherwise)."""
        x_raw = tl.where(valid, rf - lp, 0.0)
        if HAS_KL_IN:
            x = tl.minimum(tl.maximum(x_raw, -kl_in), kl_in)
            gate = ((x_raw >= -kl_in) & (x_raw <= kl_in)).to(tl.float32)
        else:
            x = x_raw
            gate = tl.full(x.shape, 1.0, tl.float32)
        if KL_EST == 0:  # k1 = −x
            k = -x
            dk = tl.full(x.shape, -1.0, tl.float32)
        elif KL_EST == 1:  # k2 = x² / 2
            k = 0.5 * x * x
            dk = x
        else:  # k3 = eˣ − 1 − x
            ex = tl.exp(x)
            k = ex - 1.0 - x
            dk = ex - 1.0
        if KL_WEIGHT == 0:  # none
            w = tl.full(x.shape, 1.0, tl.float32)
            dw = tl.zeros(x.shape, tl.float32)
        elif KL_WEIGHT == 1:  # ratio: r (token) or r_b (sequence: its gradient goes through log r_b)
            w = r
            if SEQ_W:
                dw = tl.zeros(x.shape, tl.float32)
            else:
                dw = r
        elif KL_WEIGHT == 2:  # score: exp(logp − sg(logp)), value 1, gradient 1
            w = tl.full(x.shape, 1.0, tl.float32)
            dw = w
        else:  # sampling_ratio: exp(logp − sampling)
            w = tl.exp(tl.where(valid, lp - sp, 0.0))
            dw = w
        kl = w * k
        dkl = gate * (dw * k - w * dk)  # d/dlogp: ∂x/∂logp = −1
        if KL_WEIGHT == 1 and SEQ_W:
            dkl_seq = gate * w * k
        else:
            dkl_seq = tl.zeros(x.shape, tl.float32)
        if HAS_KL_OUT:
            go = ((kl >= -kl_out) & (kl <= kl_out)).to(tl.float32)
            kl = tl.minimum(tl.maximum(kl, -kl_out), kl_out)
            dkl = dkl * go
            dkl_seq = dkl_seq * go
        return kl, dkl, dkl_seq

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

    # Reads per token: logp, old, mask (+ ref when HAS_KL, + samp when KL_WEIGHT == 3, + adv when ADV_PER_TOKEN,
    # + isw when HAS_IS); twice at SEQ_LEVEL. Writes N_PARTS fp32 per program (+ r_b at SEQ_LEVEL).
    @triton.jit
    def _grpo_loss_fwd_kernel(
        logp_ptr, old_ptr, ref_ptr, samp_ptr, adv_ptr, mask_ptr, isw_ptr, cu_ptr, part_ptr, rseq_ptr,
        T, n_chunks, chunk_len, n_progs,
        eps_low, eps_high, delta, dual_c, beta, tau_pos, tau_neg, kl_in, kl_out,
        PACKED: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEQ_LEVEL: tl.constexpr, HAS_KL: tl.constexpr,
        HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_IS: tl.constexpr, PG: tl.constexpr,
        KL_EST: tl.constexpr, KL_WEIGHT: tl.constexpr, HAS_KL_IN: tl.constexpr, HAS_KL_OUT: tl.constexpr,
        BLOCK: tl.constexpr,
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
            tl.store(rseq_ptr + b, tl.exp(log_w))

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
            loss, dlr = _policy_term(r, lp, a, eps_low, eps_high, delta, dual_c, tau_pos, tau_neg, PG, HAS_DELTA,
                                     HAS_DUAL)
            low, high = _clip_flags(r, a, eps_low, eps_high, delta, PG, HAS_DELTA)
            if HAS_IS:  # rollout IS weight: the policy-gradient term only
                isw = tl.load(isw_ptr + idx, mask=inb, other=0.0)
                loss = isw * loss
                dlr = isw * dlr
            if HAS_KL:
                rf = tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                sp = lp
                if KL_WEIGHT == 3:
                    sp = tl.load(samp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                kl, _, dkl_seq = _kl_term(lp, rf, sp, r, valid, kl_in, kl_out, KL_EST, KL_WEIGHT, SEQ_LEVEL,
                                          HAS_KL_IN, HAS_KL_OUT)
                loss += beta * kl
                dlr += beta * dkl_seq
                acc_kl += tl.where(valid, m * kl, 0.0)
            acc_loss += tl.where(valid, m * loss, 0.0)
            acc_cnt += m
            acc_low += m * low
            acc_high += m * high
            acc_reg += m * tl.maximum(low, high)
            acc_s += tl.where(valid, m * dlr, 0.0)

        p = b * n_chunks + c
        tl.store(part_ptr + p, tl.sum(acc_loss, axis=0))
        tl.store(part_ptr + n_progs + p, tl.sum(acc_cnt, axis=0))
        tl.store(part_ptr + 2 * n_progs + p, tl.sum(acc_kl, axis=0))
        if SEQ_LEVEL and not ADV_PER_TOKEN:  # one clip flag per sequence, TRL's mean over sequences
            low_s, high_s = _clip_flags(tl.exp(log_w), a_seq, eps_low, eps_high, delta, PG, HAS_DELTA)
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

    # Reads per token: mask, logp (+ old, adv and isw unless SEQ_LEVEL, + ref when HAS_KL, + samp when KL_WEIGHT
    # == 3); writes dlogp once.
    @triton.jit
    def _grpo_loss_bwd_kernel(
        grad_ptr, logp_ptr, old_ptr, ref_ptr, samp_ptr, adv_ptr, mask_ptr, isw_ptr, cu_ptr, wseq_ptr, gseq_ptr,
        rseq_ptr, dlogp_ptr,
        T, chunk_len,
        eps_low, eps_high, delta, dual_c, beta, tau_pos, tau_neg, kl_in, kl_out,
        PACKED: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, SEQ_LEVEL: tl.constexpr, HAS_KL: tl.constexpr,
        HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_IS: tl.constexpr, PG: tl.constexpr,
        KL_EST: tl.constexpr, KL_WEIGHT: tl.constexpr, HAS_KL_IN: tl.constexpr, HAS_KL_OUT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        start, length, lo, hi = _seq_bounds(cu_ptr, b, c, T, chunk_len, PACKED)
        offs = tl.arange(0, BLOCK)
        g = tl.load(grad_ptr).to(tl.float32)
        w = tl.load(wseq_ptr + b)
        if SEQ_LEVEL:
            gs = tl.load(gseq_ptr + b)
            r_b = tl.load(rseq_ptr + b)
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
                r = tl.zeros([BLOCK], tl.float32) + r_b
            else:
                od = tl.load(old_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                if ADV_PER_TOKEN:
                    a = tl.load(adv_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                else:
                    a = tl.zeros([BLOCK], tl.float32) + a_seq
                r = tl.exp(tl.where(valid, lp - od, 0.0))
                _, dlr = _policy_term(r, lp, a, eps_low, eps_high, delta, dual_c, tau_pos, tau_neg, PG, HAS_DELTA,
                                      HAS_DUAL)
                if HAS_IS:
                    dlr = tl.load(isw_ptr + idx, mask=inb, other=0.0) * dlr
                d = w * m * dlr
            if HAS_KL:
                rf = tl.load(ref_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                sp = lp
                if KL_WEIGHT == 3:
                    sp = tl.load(samp_ptr + idx, mask=inb, other=0.0).to(tl.float32)
                _, dkl, _ = _kl_term(lp, rf, sp, r, valid, kl_in, kl_out, KL_EST, KL_WEIGHT, SEQ_LEVEL, HAS_KL_IN,
                                     HAS_KL_OUT)
                d += w * m * beta * dkl
            d = tl.where(valid, g * d, 0.0)
            tl.store(dlogp_ptr + idx, d.to(dlogp_ptr.dtype.element_ty), mask=inb)


def launch_config(max_len: int, n_seqs: int) -> tuple[int, int, int, int]:
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


def _common_args(c: LossCall, ref, samp, isw, logp):
    """Pointers that may be absent (an unused stand-in), the scalars and the constexpr switches of both kernels."""
    o = c.options
    ptrs = (ref if ref is not None else logp, samp if samp is not None else logp)
    scalars = (o.epsilon_low, o.eps_high, o.delta or 0.0, o.dual_clip_c or 0.0, o.beta, o.sapo_temperature_pos,
               o.sapo_temperature_neg, o.kl_input_clamp or 0.0, o.kl_output_clamp or 0.0)
    flags = dict(PACKED=c.packed, ADV_PER_TOKEN=c.adv_per_token, SEQ_LEVEL=o.seq_level, HAS_KL=o.beta != 0.0,
                 HAS_DELTA=o.delta is not None, HAS_DUAL=o.dual_clip_c is not None, HAS_IS=isw is not None,
                 PG=POLICY_TERMS.index(o.policy), KL_EST=KL_ESTIMATORS.index(o.kl_estimator),
                 KL_WEIGHT=KL_WEIGHTS.index(o.kl_weight), HAS_KL_IN=o.kl_input_clamp is not None,
                 HAS_KL_OUT=o.kl_output_clamp is not None)
    return ptrs, scalars, flags


def triton_forward(logp, old, ref, samp, adv, mask, isw, cu, c: LossCall):
    """Loss, metrics ``[4]`` and the backward's per-sequence vectors ``w``, ``g``, ``r`` (``[B]`` each)."""
    B, seq_level = c.n_seqs, c.options.seq_level
    block, chunk, n_chunks, warps = launch_config(c.max_len, c.n_seqs)
    if seq_level:
        n_chunks, chunk = 1, max(c.max_len, 1)
    n_progs = B * n_chunks
    dev = logp.device
    part = torch.empty((N_PARTS, n_progs), device=dev, dtype=torch.float32)
    rseq = torch.empty(B, device=dev, dtype=torch.float32) if seq_level else part
    T = 0 if c.packed else logp.shape[1]
    cu_arg = cu if c.packed else part  # an unused pointer when padded
    (ref_arg, samp_arg), scalars, flags = _common_args(c, ref, samp, isw, logp)
    _grpo_loss_fwd_kernel[(B, n_chunks)](
        logp, old, ref_arg, samp_arg, adv, _mask_for_kernel(mask), isw if isw is not None else logp, cu_arg, part,
        rseq, T, n_chunks, chunk, n_progs, *scalars,
        **flags, BLOCK=block, num_warps=warps,
    )
    loss = torch.empty((), device=dev, dtype=torch.float32)
    metrics = torch.empty(N_METRICS, device=dev, dtype=torch.float32)
    wseq = torch.empty(B, device=dev, dtype=torch.float32)
    gseq = torch.empty(B, device=dev, dtype=torch.float32) if seq_level else wseq
    if isinstance(c.num_items, torch.Tensor):
        num_mode, num_ptr, num_val = 2, c.num_items, 0.0
    else:
        num_mode, num_ptr, num_val = (0, part, 0.0) if c.num_items is None else (1, part, float(c.num_items))
    _grpo_loss_finalize_kernel[(1,)](
        part, loss, metrics, wseq, gseq, num_ptr, B, n_chunks, n_progs, num_val, float(B * c.completion_length),
        LOSS_TYPE=REDUCTIONS.index(c.options.reduction), NUM_ITEMS=num_mode, SEQ_LEVEL=seq_level,
        CLIP_PER_SEQ=seq_level and not c.adv_per_token, BLOCK_B=min(FINALIZE_BLOCK_B, triton.next_power_of_2(B)),
        C_PAD=triton.next_power_of_2(n_chunks), num_warps=4,
    )
    return loss, metrics, wseq, gseq, rseq if seq_level else None


def triton_backward(grad, logp, old, ref, samp, adv, mask, isw, cu, wseq, gseq, rseq, c: LossCall):
    block, chunk, n_chunks, warps = launch_config(c.max_len, c.n_seqs)
    dlogp = torch.empty_like(logp)
    (ref_arg, samp_arg), scalars, flags = _common_args(c, ref, samp, isw, logp)
    _grpo_loss_bwd_kernel[(c.n_seqs, n_chunks)](
        grad, logp, old, ref_arg, samp_arg, adv, _mask_for_kernel(mask), isw if isw is not None else logp,
        cu if c.packed else wseq, wseq, gseq, rseq if rseq is not None else wseq, dlogp,
        0 if c.packed else logp.shape[1], chunk, *scalars,
        **flags, BLOCK=block, num_warps=warps,
    )
    return dlogp
