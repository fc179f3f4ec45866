"""Triton kernels of the MoE experts (``moe.py`` states the math) and their launchers.

Shape legend: T tokens, K routed experts per token, S = T·K (token, expert) pairs in expert order, E experts, H hidden
size, I expert intermediate size, M/N/K_ the dims of one GEMM.

The pairs are sorted by expert (``moe.py``), so expert ``e`` owns the rows ``[offsets[e], offsets[e+1])`` of every
``[S, ·]`` buffer. A *tile map* cuts each expert's rows into tiles of ``BLOCK_M`` rows (an expert's last tile is
partial; an empty expert has none) and lists them for the whole batch: program ``m`` of a grouped GEMM reads its
expert and first row from the map, so one launch covers every expert. The map is built on the device from the
per-expert counts, with ``cdiv(S, BLOCK_M) + E`` entries (an upper bound of ``Σ_e cdiv(count_e, BLOCK_M)``); the
programs past the real tiles exit at once. No host synchronisation: the grid never depends on the routing.

- ``_moe_gemm_kernel``, grid (tiles, N tiles): ``C[s] = A[row(s)] @ B_eᵀ`` for the rows ``s`` of one expert's tile,
  ``row(s)`` the token of pair ``s`` when the A side is gathered (x, the upstream gradient), ``s`` otherwise. Reads
  ``BLOCK_M·K_`` of A and ``N·K_`` of ``B_e`` per tile (the weights from L2: the row tiles of one expert run next to
  each other), writes ``BLOCK_M·N``. Epilogues (``MODE``): plain, times the routing weight, SiLU·mul on the gate and
  up halves (two accumulators, ``B_e``'s rows ``n`` and ``I + n``), or the SiLU·mul backward.
- ``_moe_wgrad_kernel``, grid (E, M tiles × N tiles): an expert's weight gradient ``Σ_{s ∈ e} L[s]ᵀ R[s]``, its rows
  streamed in ``BLOCK_K`` steps, accumulated in fp32 and stored once (no atomics). An empty expert stores zeros.
- ``_moe_gather_sum_kernel``, grid (T tiles, H tiles): the unpermute, ``out[t] = Σ_j src[pos[t, j]]`` in fp32 (the
  routing weights are already in ``src``), reads ``K·H`` and writes ``H`` per token: deterministic, no atomics.
"""

from __future__ import annotations

import torch

from .utils import HAS_TRITON, dot_in_fp32, launch_first_fitting
from .vocab_tiles import input_precision

MODE_PLAIN, MODE_SCALE, MODE_SWIGLU, MODE_SWIGLU_BWD = 0, 1, 2, 3

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cast(x, ptr, FIX_RTNE: tl.constexpr):
        """``x`` (fp32) in ``ptr``'s element type, rounded to nearest even. The interpreter (triton 3.9) truncates
        fp32 → bf16 (a GPU rounds to nearest even), which doubles and biases every bf16 rounding: with ``FIX_RTNE``
        the value is first rounded in its bits, so that the truncating cast is exact."""
        if FIX_RTNE:
            if ptr.dtype.element_ty == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                x = bits.to(tl.float32, bitcast=True)
        return x.to(ptr.dtype.element_ty)

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, c2_ptr, rows_ptr, w_ptr, gu_ptr, dw_ptr,  # see the launcher
        tile_e_ptr, tile_row_ptr, offs_ptr,  # the tile map [tiles] int32 ×2, the experts' offsets [E + 1] int32
        S, N, K, E, dual_rows,
        stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_c2m, stride_gm,
        MODE: tl.constexpr, GATHER: tl.constexpr, SAVE: tl.constexpr, DOT_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (row tile of one expert, N tile): ``acc = A[rows] @ B_e[n]ᵀ`` over ``K`` in ``BLOCK_K`` steps.

        ``MODE_SWIGLU`` also accumulates ``acc2 = A[rows] @ B_e[dual_rows + n]ᵀ`` (the up half) and writes
        ``c = silu(acc)·acc2`` (+ both pre-activations into ``c2 [S, 2N]`` when ``SAVE``). ``MODE_SWIGLU_BWD`` reads the
        saved gate/up pair ``(g, u)`` from ``gu``, writes ``c = [w·acc·u·silu'(g), w·acc·silu(g)]`` (``[S, 2N]``),
        ``c2 = silu(g)·u`` and this N tile's part of ``∂/∂w = Σ_n acc·silu(g)·u`` into ``dw [N tiles, S]``.
        """
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1).to(tl.int64)
        e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
        if e >= E:  # past the batch's real tiles
            return
        row0 = tl.load(tile_row_ptr + pid_m).to(tl.int64)
        row_end = tl.load(offs_ptr + e + 1).to(tl.int64)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        rows = offs_m
        if GATHER:
            rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        b_base = b_ptr + e * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if MODE == 2:  # MODE_SWIGLU
                b2 = tl.load(b_base + (dual_rows + offs_n[None, :]) * stride_bn + offs_k[:, None] * stride_bk,
                             mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
                if DOT_FP32:
                    b2 = b2.to(tl.float32)
                acc2 = tl.dot(a, b2, acc2, input_precision=INPUT_PRECISION)
        mask = mask_m[:, None] & mask_n[None, :]
        c_offs = offs_m[:, None] * stride_cm + offs_n[None, :]
        if MODE == 0:  # MODE_PLAIN
            tl.store(c_ptr + c_offs, _cast(acc, c_ptr, DOT_FP32), mask=mask)
        if MODE == 1:  # MODE_SCALE
            w = tl.load(w_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
            tl.store(c_ptr + c_offs, _cast(acc * w[:, None], c_ptr, DOT_FP32), mask=mask)
        if MODE == 2:  # MODE_SWIGLU
            act = acc * tl.sigmoid(acc) * acc2
            tl.store(c_ptr + c_offs, _cast(act, c_ptr, DOT_FP32), mask=mask)
            if SAVE:
                c2_offs = offs_m[:, None] * stride_c2m + offs_n[None, :]
                tl.store(c2_ptr + c2_offs, _cast(acc, c2_ptr, DOT_FP32), mask=mask)
                tl.store(c2_ptr + c2_offs + N, _cast(acc2, c2_ptr, DOT_FP32), mask=mask)
        if MODE == 3:  # MODE_SWIGLU_BWD
            g_offs = offs_m[:, None] * stride_gm + offs_n[None, :]
            g = tl.load(gu_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + g_offs + N, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            act = silu * u
            tl.store(dw_ptr + pid_n * S + offs_m, tl.sum(tl.where(mask, acc * act, 0.0), axis=1), mask=mask_m)
            w = tl.load(w_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
            da = acc * w[:, None]
            tl.store(c_ptr + c_offs, _cast(da * u * sig * (1.0 + g * (1.0 - sig)), c_ptr, DOT_FP32), mask=mask)
            tl.store(c_ptr + c_offs + N, _cast(da * silu, c_ptr, DOT_FP32), mask=mask)
            c2_offs = offs_m[:, None] * stride_c2m + offs_n[None, :]
            tl.store(c2_ptr + c2_offs, _cast(act, c2_ptr, DOT_FP32), mask=mask)

    @triton.jit
    def _moe_wgrad_kernel(
        l_ptr, r_ptr, out_ptr, rows_ptr, w_ptr, offs_ptr,  # L [·, M], R [·, N], out [E, M, N], rows [S], w [S]
        M, N, stride_lm, stride_lc, stride_rm, stride_rc, stride_oe, stride_om,
        L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, L_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (expert, output tile): ``out[e] = Σ_{s ∈ e} (w_s·)L[row(s)]ᵀ R[row(s)]``; reads the expert's
        ``count_e·(BLOCK_M + BLOCK_N)`` operand elements, writes ``BLOCK_M·BLOCK_N`` once."""
        e = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid // num_n).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % num_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s0 in range(start, end, BLOCK_K):
            offs_s = s0 + tl.arange(0, BLOCK_K)
            mask_s = offs_s < end
            tok = tl.load(rows_ptr + offs_s, mask=mask_s, other=0).to(tl.int64)
            l_rows = tok if L_GATHER else offs_s.to(tl.int64)
            r_rows = tok if R_GATHER else offs_s.to(tl.int64)
            lt = tl.load(l_ptr + l_rows[:, None] * stride_lm + offs_m[None, :] * stride_lc,
                         mask=mask_s[:, None] & mask_m[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
            rt = tl.load(r_ptr + r_rows[:, None] * stride_rm + offs_n[None, :] * stride_rc,
                         mask=mask_s[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if L_SCALE:
                w = tl.load(w_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)
                lt = _cast(lt.to(tl.float32) * w[:, None], l_ptr, DOT_FP32)
            if DOT_FP32:
                lt = lt.to(tl.float32)
                rt = rt.to(tl.float32)
            acc = tl.dot(tl.trans(lt), rt, acc, input_precision=INPUT_PRECISION)
        tl.store(out_ptr + e * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :],
                 _cast(acc, out_ptr, DOT_FP32), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _moe_gather_sum_kernel(src_ptr, pos_ptr, out_ptr, T, H, top_k, stride_s, stride_o, FIX_RTNE: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program (token tile, H tile): ``out[t] = Σ_j src[pos[t·top_k + j]]`` in fp32."""
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_t = offs_t < T
        mask = mask_t[:, None] & (offs_h[None, :] < H)
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for j in range(0, top_k):
            p = tl.load(pos_ptr + offs_t * top_k + j, mask=mask_t, other=0).to(tl.int64)
            acc += tl.load(src_ptr + p[:, None] * stride_s + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_t[:, None] * stride_o + offs_h[None, :], _cast(acc, out_ptr, FIX_RTNE), mask=mask)


# Launch configurations (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on a GPU per GEMM mode, largest first, tried
# in order until one fits (``utils.launch_first_fitting``), keyed by the element size. Shared memory is the pipelined
# K loop's num_stages·(BLOCK_M + BLOCK_N)·BLOCK_K elements (2·BLOCK_N with the gate/up pair): at most 96 KiB for the
# first bf16 entries, under sm_80's 163 KiB. Registers set the tile: the gate/up pair keeps two fp32 accumulators and
# the SiLU·mul backward's epilogue six live tiles, so those take fewer elements per thread (no bf16 spills on sm_90).
# `pytest -m gpu_compile` compiles every entry for sm_80 and sm_90.
GEMM_CONFIGS = {
    MODE_PLAIN: {2: [(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (64, 64, 32, 4, 2)],
                 4: [(64, 64, 32, 4, 3), (64, 64, 32, 4, 2), (32, 64, 32, 4, 1)]},
    MODE_SWIGLU: {2: [(128, 64, 64, 8, 3), (64, 64, 64, 4, 3), (64, 32, 32, 4, 2)],
                  4: [(64, 64, 32, 8, 3), (64, 32, 32, 4, 2), (32, 32, 32, 4, 1)]},
    MODE_SWIGLU_BWD: {2: [(64, 64, 64, 8, 3), (64, 32, 64, 4, 3), (32, 32, 32, 4, 2)],
                      4: [(64, 64, 32, 8, 3), (64, 32, 32, 4, 2), (32, 32, 32, 4, 1)]},
}
GEMM_CONFIGS[MODE_SCALE] = GEMM_CONFIGS[MODE_PLAIN]
# Few rows per expert (a decode step: 128 rows × top-8 over 128 experts is 8 pairs per expert on average, and the
# engine's CUDA graphs fix S = rows × K per batch bucket): an expert's rows fit one 16-row tile (tl.dot's smallest M),
# so its weights are streamed once per N tile and no MMA work is spent on 112 empty rows of a 128-row tile; the grid
# (≈ E × N / BLOCK_N programs: 2048 for Qwen3-30B-A3B's down product) still fills the SMs. Such a GEMM is bound by
# reading the active experts' weights (3·H·I elements each), so the K loop takes long steps (BLOCK_K 128 in bf16)
# with 3 stages in flight: 72 KiB of shared memory for the gate/up pair as compiled for sm_80 and sm_90, at most 128
# registers a thread and no spills (`pytest -m gpu_compile`, the moe_decode row).
FEW_ROWS_PER_EXPERT = 16  # mean pairs per expert at or below which the few-rows configurations are used
FEW_ROWS_CONFIGS = {
    MODE_PLAIN: {2: [(16, 128, 128, 4, 3), (16, 64, 64, 4, 2), (16, 32, 32, 4, 1)],
                 4: [(16, 128, 64, 4, 3), (16, 64, 32, 4, 2), (16, 32, 32, 4, 1)]},
    MODE_SWIGLU: {2: [(16, 64, 128, 4, 3), (16, 32, 64, 4, 2), (16, 32, 32, 4, 1)],
                  4: [(16, 64, 64, 4, 3), (16, 32, 32, 4, 2), (16, 32, 32, 2, 1)]},
}
FEW_ROWS_CONFIGS[MODE_SCALE] = FEW_ROWS_CONFIGS[MODE_PLAIN]
WGRAD_CONFIGS = GEMM_CONFIGS[MODE_PLAIN]  # BLOCK_K counts an expert's rows there
INTERPRET_CONFIG = (16, 64, 64, 4, 1)  # few, large tiles: the interpreter runs per operation
GATHER_BLOCK_T, GATHER_BLOCK_H, GATHER_WARPS = 16, 128, 4


def _configs(t: torch.Tensor, table: dict) -> list[tuple[int, int, int, int, int]]:
    return [INTERPRET_CONFIG] if dot_in_fp32(t) else table[t.element_size()]


def _key(name: str, t: torch.Tensor) -> tuple:
    return ("moe", name, t.dtype, t.device.index)


class Routing:
    """The batch's pairs in expert order and their tile maps: ``order [S]`` (pair index ``t·K + j`` of sorted row
    ``s``), ``tok [S]`` (its token), ``pos [S]`` (the inverse: the sorted row of pair ``t·K + j``), ``counts [E]``,
    ``offsets [E + 1]`` int32, and one tile map per ``BLOCK_M`` (built on first use). All on the device, no host sync:
    a stable sort (pairs of one expert keep the token order) and a scatter-add count."""

    def __init__(self, ids_TK: torch.Tensor, num_experts: int):
        flat_S = ids_TK.reshape(-1)
        self.S, self.E, self.top_k = flat_S.numel(), num_experts, ids_TK.shape[-1]
        self.order = torch.sort(flat_S, stable=True).indices  # [S] int64
        self.tok = (self.order // self.top_k).to(torch.int32)  # [S]
        self.pos = torch.empty_like(self.order)
        self.pos[self.order] = torch.arange(self.S, device=flat_S.device)
        self.pos = self.pos.to(torch.int32)  # [S]
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_S.device)
        self.counts.scatter_add_(0, flat_S.long(), torch.ones_like(flat_S, dtype=torch.int64))  # [E]
        self.offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat_S.device)
        self.offsets[1:] = torch.cumsum(self.counts, 0)
        self._maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tile_map(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert [tiles], first row [tiles])`` int32; entries past the real tiles have expert ``E``."""
        if block_m not in self._maps:
            tiles_E = (self.counts + block_m - 1) // block_m
            end_E = torch.cumsum(tiles_E, 0)  # [E] int64
            i = torch.arange(triton.cdiv(self.S, block_m) + self.E, device=end_E.device)
            e = torch.searchsorted(end_E, i, right=True)  # [tiles] in [0, E]
            ec = e.clamp(max=self.E - 1)
            row0 = self.offsets[ec].long() + (i - end_E[ec] + tiles_E[ec]) * block_m
            self._maps[block_m] = (e.to(torch.int32), row0.to(torch.int32))
        return self._maps[block_m]


def few_rows(r: Routing) -> bool:
    """At most ``FEW_ROWS_PER_EXPERT`` pairs per expert on average (a host-side count: S and E are shapes)."""
    return r.S <= FEW_ROWS_PER_EXPERT * r.E


def grouped_gemm(mode: int, a, b_E, N: int, K: int, r: Routing, *, gather: bool, b_strides: tuple[int, int],
                 out_cols: int, w_S=None, gu=None, dual_rows: int = 0, save: bool = False):
    """One launch of ``_moe_gemm_kernel`` over every expert's rows; returns ``(c, c2, dw parts)`` (see the kernel).

    ``a``: ``[T, K]`` gathered by token (``gather``) or ``[S, K]``; ``b_E``: ``[E, ·, ·]`` whose ``(n, k)`` element is
    at ``b_strides``; ``c``: ``[S, out_cols]`` in ``a``'s dtype."""
    S = r.S
    c = torch.empty(S, out_cols, dtype=a.dtype, device=a.device)
    c2 = None
    if mode == MODE_SWIGLU and save:
        c2 = torch.empty(S, 2 * N, dtype=a.dtype, device=a.device)
    if mode == MODE_SWIGLU_BWD:
        c2 = torch.empty(S, N, dtype=a.dtype, device=a.device)
    out = []

    def launch(config):
        block_m, block_n, block_k, warps, stages = config
        tile_e, tile_row = r.tile_map(block_m)
        n_tiles = triton.cdiv(N, block_n)
        parts = torch.empty(n_tiles, S, dtype=torch.float32, device=a.device) if mode == MODE_SWIGLU_BWD else None
        _moe_gemm_kernel[(tile_e.numel(), n_tiles)](
            a, b_E, c, c2 if c2 is not None else c, r.tok, w_S if w_S is not None else c, gu if gu is not None else c,
            parts if parts is not None else c, tile_e, tile_row, r.offsets,
            S, N, K, r.E, dual_rows, a.stride(0), a.stride(1), b_E.stride(0), b_strides[0], b_strides[1],
            c.stride(0), c2.stride(0) if c2 is not None else 0, gu.stride(0) if gu is not None else 0,
            MODE=mode, GATHER=gather, SAVE=save, DOT_FP32=dot_in_fp32(a), INPUT_PRECISION=input_precision(a),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
        out[:] = [parts]

    few = few_rows(r) and mode in FEW_ROWS_CONFIGS
    table = FEW_ROWS_CONFIGS[mode] if few else GEMM_CONFIGS[mode]
    launch_first_fitting(_key(f"gemm{mode}{int(save)}{int(few)}", a), _configs(a, table), launch)
    return c, c2, out[0]


def expert_wgrad(l, r_mat, M: int, N: int, r: Routing, E: int, *, l_gather: bool, r_gather: bool, w_S=None,
                 out_dtype=None) -> torch.Tensor:
    """``out [E, M, N]``, ``out[e] = Σ_{s ∈ e} (w_s·)L[row(s)]ᵀ R[row(s)]`` (``L``: ``[·, M]``, ``R``: ``[·, N]``)."""
    out = torch.empty(E, M, N, dtype=out_dtype or l.dtype, device=l.device)

    def launch(config):
        block_m, block_n, block_k, warps, stages = config
        grid = (E, triton.cdiv(M, block_m) * triton.cdiv(N, block_n))
        _moe_wgrad_kernel[grid](
            l, r_mat, out, r.tok, w_S if w_S is not None else l, r.offsets, M, N, l.stride(0), l.stride(1),
            r_mat.stride(0), r_mat.stride(1), out.stride(0), out.stride(1),
            L_GATHER=l_gather, R_GATHER=r_gather, L_SCALE=w_S is not None, DOT_FP32=dot_in_fp32(l),
            INPUT_PRECISION=input_precision(l), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages,
        )

    launch_first_fitting(_key(f"wgrad{int(l_gather)}{int(r_gather)}", l), _configs(l, WGRAD_CONFIGS), launch)
    return out


def gather_sum(src_SH: torch.Tensor, pos_S: torch.Tensor, T: int, top_k: int) -> torch.Tensor:
    """``out [T, H]``, ``out[t] = Σ_j src[pos[t·top_k + j]]`` accumulated in fp32, in ``src``'s dtype."""
    H = src_SH.shape[1]
    out = torch.empty(T, H, dtype=src_SH.dtype, device=src_SH.device)
    grid = (triton.cdiv(T, GATHER_BLOCK_T), triton.cdiv(H, GATHER_BLOCK_H))
    _moe_gather_sum_kernel[grid](src_SH, pos_S, out, T, H, top_k, src_SH.stride(0), out.stride(0),
                                 FIX_RTNE=dot_in_fp32(src_SH), BLOCK_T=GATHER_BLOCK_T, BLOCK_H=GATHER_BLOCK_H,
                                 num_warps=GATHER_WARPS)
    return out
