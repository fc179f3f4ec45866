"""The Triton kernels of :mod:`fastgrpo.kernels.distill_loss` and their launchers: the forward (the divergence's
per-token value and the softmax statistics of both models, vocabulary split over programs), the JSD's second pass,
and the backward (the hidden states' and heads' gradients from the statistics, no ``[N, V]`` tensor). The math and
the memory are stated in :mod:`fastgrpo.kernels.distill_loss`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .utils import HAS_TRITON, dot_in_fp32, launch_first_fitting
from .vocab_tiles import GROUP_N, input_precision, launch_configs, split_grid

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .vocab_tiles import accumulate_grads, grouped_tile, tile_logits


@dataclass(frozen=True)
class Divergence:
    """Which divergence: ``fwd_w · KL(q ‖ p) + rev_w · KL(p ‖ q)``, or the JSD with ``beta`` when ``jsd``."""

    fwd_w: float
    rev_w: float
    jsd: bool
    beta: float

    @property
    def grad_coefs(self) -> tuple[float, float]:
        """``(cf, cr)`` of the module docstring's gradient."""
        return (0.0, 1.0 - self.beta) if self.jsd else (self.fwd_w, self.rev_w)


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _distill_fwd_kernel(
        hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr,  # [N, Hs], [Vs, Hs], [Vs], [N, Ht], [Vt, Ht], [Vt]
        ms_ptr, ss_ptr, mt_ptr, st_ptr, af_ptr, ar_ptr,  # partial states [S, N] fp32
        N, V, Hs, Ht, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv,
        stride_wtk, inv_temp, tiles_per_split,
        HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, FWD_KL: tl.constexpr, REV_KL: tl.constexpr,
        DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (token tile, vocabulary split): online LSE of both models over the split's vocabulary tiles.

        Per token row, over the split: reads its two hidden rows once per vocabulary tile (from L2) and
        ``V_split · (Hs + Ht) / BLOCK_N`` head elements amortised over the tile; writes 4 fp32 partials (maxima and
        ``Σ exp(z − m)`` of each model) and, for the KL modes, ``af = Σ exp(zt − mt)(zt − zs)`` (FWD_KL) and
        ``ar = Σ exp(zs − ms)(zs − zt)`` (REV_KL), rescaled with their model's running max.
        FLOPs: ``2·(Hs + Ht)`` per (token, vocabulary) pair.
        """
        pid_n = tl.program_id(0).to(tl.int64)
        pid_s = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        ms = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        mt = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        ss = tl.zeros((BLOCK_N,), dtype=tl.float32)
        st = tl.zeros((BLOCK_N,), dtype=tl.float32)
        af = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ar = tl.zeros((BLOCK_N,), dtype=tl.float32)
        v_start = pid_s * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
        for v0 in range(v_start, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            zt = tile_logits(ht_ptr, wt_ptr, bt_ptr, offs_n, mask_n, offs_v, mask_v, Ht, stride_htn, stride_htk,
                              stride_wtv, stride_wtk, inv_temp, HAS_BT, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K)  # [BLOCK_N, BLOCK_V]
            zs = tile_logits(hs_ptr, ws_ptr, bs_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn, stride_hsk,
                              stride_wsv, stride_wsk, inv_temp, HAS_BS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K)  # [BLOCK_N, BLOCK_V]
            diff = tl.where(mask_v[None, :], zt - zs, 0.0)  # zt − zs, 0 on masked columns
            zt = tl.where(mask_v[None, :], zt, float("-inf"))
            zs = tl.where(mask_v[None, :], zs, float("-inf"))
            mt_new = tl.maximum(mt, tl.max(zt, axis=1))  # finite: every tile holds a valid column
            ms_new = tl.maximum(ms, tl.max(zs, axis=1))
            at = tl.exp(mt - mt_new)
            a_s = tl.exp(ms - ms_new)
            et = tl.exp(zt - mt_new[:, None])  # [BLOCK_N, BLOCK_V], 0 on masked columns
            es = tl.exp(zs - ms_new[:, None])
            st = st * at + tl.sum(et, axis=1)
            ss = ss * a_s + tl.sum(es, axis=1)
            if FWD_KL:
                af = af * at + tl.sum(et * diff, axis=1)
            if REV_KL:
                ar = ar * a_s - tl.sum(es * diff, axis=1)
            mt = mt_new
            ms = ms_new
        out = pid_s * N + offs_n
        tl.store(ms_ptr + out, ms, mask=mask_n)
        tl.store(ss_ptr + out, ss, mask=mask_n)
        tl.store(mt_ptr + out, mt, mask=mask_n)
        tl.store(st_ptr + out, st, mask=mask_n)
        if FWD_KL:
            tl.store(af_ptr + out, af, mask=mask_n)
        if REV_KL:
            tl.store(ar_ptr + out, ar, mask=mask_n)

    @triton.jit
    def _distill_jsd_kernel(
        hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr,  # as _distill_fwd_kernel
        stats_ptr,  # [4, N] fp32: ms, rs, mt, rt (each model's max and log Σ exp(z − max))
        jt_ptr, k_ptr,  # partial sums [S, N] fp32
        N, V, Hs, Ht, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv,
        stride_wtk, inv_temp, log_beta, log_1m_beta, tiles_per_split,
        HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """JSD's second pass, program (token tile, vocabulary split), both LSEs known: partial sums
        ``jt = Σ q (lt − log m)`` and ``k = Σ p (ls − log m)`` (so ``D = β jt + (1 − β) k``, ``c = k``).

        Reads as ``_distill_fwd_kernel`` plus 4 fp32 per token; writes 2 fp32 partials per token and split.
        """
        pid_n = tl.program_id(0).to(tl.int64)
        pid_s = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        ms, rs, mt, rt = _load_stats(stats_ptr, offs_n, mask_n, N)
        jt = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k = tl.zeros((BLOCK_N,), dtype=tl.float32)
        v_start = pid_s * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
        for v0 in range(v_start, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            valid = mask_n[:, None] & mask_v[None, :]
            lt = tile_logits(ht_ptr, wt_ptr, bt_ptr, offs_n, mask_n, offs_v, mask_v, Ht, stride_htn, stride_htk,
                              stride_wtv, stride_wtk, inv_temp, HAS_BT, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K) - mt[:, None] - rt[:, None]  # [BLOCK_N, BLOCK_V]
            ls = tile_logits(hs_ptr, ws_ptr, bs_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn, stride_hsk,
                              stride_wsv, stride_wsk, inv_temp, HAS_BS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                              BLOCK_K) - ms[:, None] - rs[:, None]
            lm = _log_mixture(ls, lt, log_beta, log_1m_beta)
            jt += tl.sum(tl.where(valid, tl.exp(lt) * (lt - lm), 0.0), axis=1)
            k += tl.sum(tl.where(valid, tl.exp(ls) * (ls - lm), 0.0), axis=1)
        out = pid_s * N + offs_n
        tl.store(jt_ptr + out, jt, mask=mask_n)
        tl.store(k_ptr + out, k, mask=mask_n)

    @triton.jit
    def _load_stats(stats_ptr, offs_n, mask_n, N):
        """Each model's max and ``r = log Σ exp(z − max)`` (so ``log p = (z − max) − r``: no rounding of a large
        ``lse`` against ``z``, which would cost ~1e-7·|z| in the log-probs of the top tokens)."""
        ms = tl.load(stats_ptr + offs_n, mask=mask_n, other=0.0)
        rs = tl.load(stats_ptr + N + offs_n, mask=mask_n, other=0.0)
        mt = tl.load(stats_ptr + 2 * N + offs_n, mask=mask_n, other=0.0)
        rt = tl.load(stats_ptr + 3 * N + offs_n, mask=mask_n, other=0.0)
        return ms, rs, mt, rt

    @triton.jit
    def _log_mixture(ls, lt, log_beta, log_1m_beta):
        """``log m = log(β e^lt + (1 − β) e^ls)`` as a two-term log-sum-exp (no underflow of tiny p, q)."""
        a = lt + log_beta
        b = ls + log_1m_beta
        hi = tl.maximum(a, b)
        return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))

    @triton.jit
    def _distill_bwd_kernel(
        hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr,  # as _distill_fwd_kernel
        stats_ptr, c_ptr, g_ptr,  # [4, N] as _distill_jsd_kernel; [N] fp32: the constant c, the upstream grad of D
        gh_ptr, gw_ptr, gb_ptr,  # fp32 accumulators [N, Hs], [Vs, Hs], [Vs] (contiguous, zero-initialised)
        N, V, Hs, Ht, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv,
        stride_wtk, inv_temp, cf, cr, log_beta, log_1m_beta,
        HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, JSD: tl.constexpr, REV: tl.constexpr,
        GRAD_H: tl.constexpr, GRAD_W: tl.constexpr, GRAD_B: tl.constexpr,
        DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, GROUP_N: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (token tile, vocabulary tile): recompute both tiles' logits, form ``dz``, accumulate the grads.

        As ``_linear_logprobs_bwd_kernel`` (one 2-D grid, fp32 atomics into ``grad_h`` and ``grad_W``, programs
        grouped by ``GROUP_N`` token tiles), with the teacher's tile recomputed too. FLOPs per tile:
        ``2·BN·BV·(Hs + Ht)`` recompute + ``4·BN·BV·Hs`` gradient products; atomically added bytes
        ``4·(BN + BV)·Hs``. ``REV``: the ``cr`` term is on (``cr ≠ 0``); ``JSD``: its ``X`` is ``log m``.
        """
        pid_n, pid_v = grouped_tile(tl.program_id(0), N, V, BLOCK_N, BLOCK_V, GROUP_N)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < N
        mask_v = offs_v < V
        valid = mask_n[:, None] & mask_v[None, :]
        ms, rs, mt, rt = _load_stats(stats_ptr, offs_n, mask_n, N)
        g = tl.load(g_ptr + offs_n, mask=mask_n, other=0.0)
        lt = tile_logits(ht_ptr, wt_ptr, bt_ptr, offs_n, mask_n, offs_v, mask_v, Ht, stride_htn, stride_htk,
                          stride_wtv, stride_wtk, inv_temp, HAS_BT, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                          BLOCK_K) - mt[:, None] - rt[:, None]  # [BLOCK_N, BLOCK_V]
        ls = tile_logits(hs_ptr, ws_ptr, bs_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn, stride_hsk,
                          stride_wsv, stride_wsk, inv_temp, HAS_BS, DOT_FP32, INPUT_PRECISION, BLOCK_N, BLOCK_V,
                          BLOCK_K) - ms[:, None] - rs[:, None]
        p = tl.exp(ls)
        dd = cf * (p - tl.exp(lt))  # ∂D/∂zs
        if REV:
            c = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0)
            if JSD:
                x = _log_mixture(ls, lt, log_beta, log_1m_beta)
            else:
                x = lt
            dd += cr * p * (ls - x - c[:, None])
        dz = tl.where(valid, dd * (g * inv_temp)[:, None], 0.0)

        accumulate_grads(dz, hs_ptr, ws_ptr, gh_ptr, gw_ptr, gb_ptr, offs_n, mask_n, offs_v, mask_v, Hs, stride_hsn,
                         stride_hsk, stride_wsv, stride_wsk, GRAD_H, GRAD_W, GRAD_B, DOT_FP32, INPUT_PRECISION,
                         BLOCK_K)


# Launch configurations (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages) on a GPU, largest tiles first, tried in
# order until one fits (``utils.launch_first_fitting``), keyed by the element size. Two logits tiles are live at
# once (both models'), so the tiles are half linear_logprobs' in the token dimension; `pytest -m gpu_compile`
# compiles every entry for sm_80 and sm_90 and checks shared memory and spills.
_FWD_CONFIGS = {
    2: [(64, 128, 64, 8, 3), (64, 64, 64, 4, 2), (32, 64, 32, 4, 1)],
    4: [(64, 64, 32, 8, 3), (32, 64, 32, 4, 2), (32, 64, 32, 4, 1)],
}
_BWD_CONFIGS = {
    2: [(64, 128, 64, 8, 2), (64, 64, 64, 4, 2), (32, 64, 32, 4, 1)],
    4: [(64, 64, 32, 8, 2), (32, 64, 32, 4, 2), (32, 64, 32, 4, 1)],
}


def _launch_key(name: str, t: torch.Tensor) -> tuple:
    return ("distill_loss", name, t.dtype, t.device.index)


def _model_args(hs, ws, bs, ht, wt, bt):
    """Pointer and stride arguments shared by the three kernels (a missing bias passes a dummy pointer)."""
    return ((hs, ws, bs if bs is not None else hs, ht, wt, bt if bt is not None else ht),
            (hs.stride(0), hs.stride(1), ws.stride(0), ws.stride(1), ht.stride(0), ht.stride(1), wt.stride(0),
             wt.stride(1)))


def log_betas(div: Divergence) -> tuple[float, float]:
    """``(log β, log(1 − β))`` of the JSD (zeros for the KLs): the mixture's log-weights."""
    return (math.log(div.beta), math.log1p(-div.beta)) if div.jsd else (0.0, 0.0)


def forward_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div: Divergence):
    N, Hs = hs.shape
    Ht = ht.shape[1]
    ptrs, strides = _model_args(hs, ws, bs, ht, wt, bt)
    flags = dict(HAS_BS=bs is not None, HAS_BT=bt is not None, DOT_FP32=dot_in_fp32(hs),
                 INPUT_PRECISION=input_precision(hs))
    fwd_kl, rev_kl = not div.jsd and div.fwd_w != 0.0, not div.jsd and div.rev_w != 0.0
    parts = []

    def launch(config):
        block_n, block_v, block_k, warps, stages = config
        n_tiles, splits, tiles_per_split = split_grid(N, V, block_n, block_v, hs)
        part_SN = [torch.empty(splits, N, device=hs.device, dtype=torch.float32) for _ in range(6)]
        _distill_fwd_kernel[(n_tiles, splits)](
            *ptrs, *part_SN, N, V, Hs, Ht, *strides, inv_temp, tiles_per_split, **flags, FWD_KL=fwd_kl, REV_KL=rev_kl,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
        parts[:] = part_SN

    launch_first_fitting(_launch_key("fwd", hs), launch_configs(hs, _FWD_CONFIGS), launch)
    ms_SN, ss_SN, mt_SN, st_SN, af_SN, ar_SN = parts
    # Combine the splits' partials, O(S·N): sums and the KL accumulators rescale by exp(m_s − m).
    ms_N, mt_N = ms_SN.max(0).values, mt_SN.max(0).values
    scale_s_SN, scale_t_SN = torch.exp(ms_SN - ms_N), torch.exp(mt_SN - mt_N)
    sum_s_N, sum_t_N = (ss_SN * scale_s_SN).sum(0), (st_SN * scale_t_SN).sum(0)
    stats_4N = torch.stack([ms_N, torch.log(sum_s_N), mt_N, torch.log(sum_t_N)])  # lse = m + r, kept apart
    if div.jsd:
        jt_N, k_N = jsd_pass_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N)
        return div.beta * jt_N + (1.0 - div.beta) * k_N, stats_4N, k_N
    d_N = torch.zeros(N, device=hs.device, dtype=torch.float32)
    rkl_N = None
    lse_gap_N = (stats_4N[0] - stats_4N[2]) + (stats_4N[1] - stats_4N[3])  # lse_s − lse_t
    if fwd_kl:  # KL(q ‖ p) = Σ q (zt − zs) + lse_s − lse_t
        d_N += div.fwd_w * ((af_SN * scale_t_SN).sum(0) / sum_t_N + lse_gap_N)
    if rev_kl:  # KL(p ‖ q) = Σ p (zs − zt) + lse_t − lse_s
        rkl_N = (ar_SN * scale_s_SN).sum(0) / sum_s_N - lse_gap_N
        d_N += div.rev_w * rkl_N
    return d_N, stats_4N, rkl_N


def jsd_pass_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N):
    N, Hs = hs.shape
    ptrs, strides = _model_args(hs, ws, bs, ht, wt, bt)
    parts = []

    def launch(config):
        block_n, block_v, block_k, warps, stages = config
        n_tiles, splits, tiles_per_split = split_grid(N, V, block_n, block_v, hs)
        part_SN = [torch.empty(splits, N, device=hs.device, dtype=torch.float32) for _ in range(2)]
        _distill_jsd_kernel[(n_tiles, splits)](
            *ptrs, stats_4N, *part_SN, N, V, Hs, ht.shape[1], *strides, inv_temp, *log_betas(div),
            tiles_per_split, HAS_BS=bs is not None, HAS_BT=bt is not None, DOT_FP32=dot_in_fp32(hs),
            INPUT_PRECISION=input_precision(hs), BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages,
        )
        parts[:] = part_SN

    launch_first_fitting(_launch_key("jsd", hs), launch_configs(hs, _FWD_CONFIGS), launch)
    return parts[0].sum(0), parts[1].sum(0)


def backward_triton(hs, ws, bs, ht, wt, bt, V, inv_temp, div, stats_4N, c_N, g_N, needs):
    N, Hs = hs.shape
    f32 = dict(dtype=torch.float32, device=hs.device)
    gh_NH = torch.zeros(N, Hs, **f32) if needs[0] else None
    gw_VH = torch.zeros(ws.shape[0], Hs, **f32) if needs[1] else None  # the one fp32 [Vs, Hs] accumulator
    gb_V = torch.zeros(ws.shape[0], **f32) if needs[2] else None
    ptrs, strides = _model_args(hs, ws, bs, ht, wt, bt)
    cf, cr = div.grad_coefs

    def launch(config):  # a config that does not fit fails at launch, before any atomic add
        block_n, block_v, block_k, warps, stages = config
        grid = (triton.cdiv(N, block_n) * triton.cdiv(V, block_v),)
        _distill_bwd_kernel[grid](
            *ptrs, stats_4N, c_N if c_N is not None else g_N, g_N,
            *(x if x is not None else g_N for x in (gh_NH, gw_VH, gb_V)),
            N, V, Hs, ht.shape[1], *strides, inv_temp, cf, cr, *log_betas(div),
            HAS_BS=bs is not None, HAS_BT=bt is not None, JSD=div.jsd, REV=cr != 0.0,
            GRAD_H=needs[0], GRAD_W=needs[1], GRAD_B=needs[2], DOT_FP32=dot_in_fp32(hs),
            INPUT_PRECISION=input_precision(hs), GROUP_N=GROUP_N, BLOCK_N=block_n, BLOCK_V=block_v,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )

    launch_first_fitting(_launch_key("bwd", hs), launch_configs(hs, _BWD_CONFIGS), launch)
    return gh_NH, gw_VH, gb_V
