"""Triton pieces the fused LM-head kernels share (``linear_logprobs``, ``distill_kernels``): one tile's logits
straight from hidden states and the head, the backward's grouped tile order and its gradient accumulation, and the
launchers' choice of configurations and of the forward's vocabulary splits. The math of each is in its docstring;
the kernels' is in ``linear_logprobs.py``.
"""

from __future__ import annotations

import torch

from .utils import HAS_TRITON, dot_in_fp32, num_sms

if HAS_TRITON:
    import triton
    import triton.language as tl

# ----------------------------------------------------------------------------------------------------------------------
# Triton functions (inlined into the kernels that call them)
# ----------------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def tile_logits(h_ptr, w_ptr, b_ptr, offs_n, mask_n, offs_v, mask_v, H, stride_hn, stride_hk, stride_wv,
                     stride_wk, inv_temp, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """``z = (h[offs_n] @ W[offs_v]ᵀ + b[offs_v]) / T`` for one tile, ``[BLOCK_N, BLOCK_V]`` fp32.

        Reads ``BLOCK_N·H + BLOCK_V·H`` elements; the K loop masks ``H`` that is not a multiple of ``BLOCK_K``.
        """
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            h = tl.load(h_ptr + offs_n[:, None] * stride_hn + offs_k[None, :] * stride_hk,
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            w = tl.load(w_ptr + offs_v[:, None] * stride_wv + offs_k[None, :] * stride_wk,
                        mask=mask_v[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_V, BLOCK_K]
            if DOT_FP32:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)  # [BLOCK_V]
            acc += b[None, :]
        return acc * inv_temp

    @triton.jit
    def grouped_tile(pid, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_N: tl.constexpr):
        """The (token tile, vocabulary tile) of program ``pid`` of a backward's 1-D grid, programs grouped
        ``GROUP_N`` token tiles × all vocabulary tiles, so the ones in flight share ``W`` and ``h`` tiles in L2 and
        spread their atomics over different rows. Both int64."""
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_v = tl.cdiv(V, BLOCK_V)
        group_size = GROUP_N * num_pid_v
        first_n = (pid // group_size) * GROUP_N
        rows = tl.minimum(num_pid_n - first_n, GROUP_N)
        pid_n = (first_n + (pid % group_size) % rows).to(tl.int64)
        pid_v = ((pid % group_size) // rows).to(tl.int64)
        return pid_n, pid_v

    @triton.jit
    def accumulate_grads(dz, h_ptr, w_ptr, gh_ptr, gw_ptr, gb_ptr, offs_n, mask_n, offs_v, mask_v, H, stride_hn,
                         stride_hk, stride_wv, stride_wk, GRAD_H: tl.constexpr, GRAD_W: tl.constexpr,
                         GRAD_B: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """Add one tile's ``dz`` ``[BLOCK_N, BLOCK_V]`` (fp32, 0 outside the masks) into the fp32 accumulators
        (contiguous ``[N, H]``, ``[V, H]``, ``[V]``): ``grad_h += dz @ W``, ``grad_W += dzᵀ @ h``, ``grad_b += Σ_n dz``,
        by atomic adds (``(BLOCK_N + BLOCK_V)·H`` fp32), the products over ``H`` in ``BLOCK_K`` steps."""
        if GRAD_B:
            tl.atomic_add(gb_ptr + offs_v, tl.sum(dz, axis=0), mask=mask_v, sem="relaxed")
        if DOT_FP32:
            dz_op = dz
        else:
            dz_op = dz.to(w_ptr.dtype.element_ty)  # bf16/fp16 operands for the tensor cores
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            if GRAD_H:
                w = tl.load(w_ptr + offs_v[:, None] * stride_wv + offs_k[None, :] * stride_wk,
                            mask=mask_v[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_V, BLOCK_K]
                if DOT_FP32:
                    w = w.to(tl.float32)
                gh = tl.dot(dz_op, w, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_K]
                tl.atomic_add(gh_ptr + offs_n[:, None] * H + offs_k[None, :], gh,
                              mask=mask_n[:, None] & mask_k[None, :], sem="relaxed")
            if GRAD_W:
                h = tl.load(h_ptr + offs_n[:, None] * stride_hn + offs_k[None, :] * stride_hk,
                            mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
                if DOT_FP32:
                    h = h.to(tl.float32)
                gw = tl.dot(tl.trans(dz_op), h, input_precision=INPUT_PRECISION)  # [BLOCK_V, BLOCK_K]
                tl.atomic_add(gw_ptr + offs_v[:, None] * H + offs_k[None, :], gw,
                              mask=mask_v[:, None] & mask_k[None, :], sem="relaxed")


# Under the interpreter: few, large tiles (it runs per operation).
INTERPRET_CONFIG = (16, 128, 64, 4, 1)
GROUP_N = 16  # backward: token tiles per program group (they share W and h tiles in L2)
PROGRAMS_PER_SM = 2  # forward: vocabulary splits until about this many programs per SM run (8 in all, interpreted)


def launch_configs(t: torch.Tensor, table: dict) -> list[tuple[int, int, int, int, int]]:
    """The launch configurations to try for input ``t``: ``table``'s for its element size, or the interpreter's."""
    return [INTERPRET_CONFIG] if dot_in_fp32(t) else table[t.element_size()]


def split_grid(N: int, V: int, block_n: int, block_v: int, t: torch.Tensor) -> tuple[int, int, int]:
    """A forward's grid over tokens and vocabulary splits, ``(token tiles, splits, vocabulary tiles per split)``:
    enough programs to fill the GPU of ``t``, every split at least one tile."""
    target_programs = 8 if dot_in_fp32(t) else PROGRAMS_PER_SM * num_sms(t)
    n_tiles, v_tiles = triton.cdiv(N, block_n), triton.cdiv(V, block_v)
    splits = min(v_tiles, max(1, triton.cdiv(target_programs, n_tiles)))
    tiles_per_split = triton.cdiv(v_tiles, splits)
    return n_tiles, triton.cdiv(v_tiles, tiles_per_split), tiles_per_split


def input_precision(t: torch.Tensor) -> str:
    """fp32 inputs on a GPU: 3xTF32 (≈ fp32 accuracy); bf16/fp16: the setting is moot (tensor cores); the
    interpreter: plain fp32."""
    if dot_in_fp32(t):
        return "ieee"
    return "tf32x3" if t.dtype == torch.float32 else "tf32"
