"""Shared plumbing for the kernels: which path runs, and input validation.

Path choice: Triton on CUDA tensors; the Triton kernel under the interpreter when
``TRITON_INTERPRET=1`` was set before triton was imported (CPU tensors); otherwise a plain-torch path with the
same memory promise. A CUDA failure is raised, never hidden by a fallback.

Every check raises ``ValueError`` naming the offending argument, so a user of the drop-in losses learns what to
fix from the message alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch

try:  # triton is absent on some platforms (macOS, Windows): the torch paths still work there
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# dtypes a loss mask may have (float values weigh tokens)
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, *FLOAT_DTYPES)
# SMs assumed for a launch that is not on a CUDA tensor (the ahead-of-time compile gate, tests/kernels/
# test_gpu_compile.py, launches with CPU tensors): an H100 / H200.
DEFAULT_NUM_SMS = 132


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel runs for ``t``: a CUDA tensor, or a CPU tensor under the interpreter."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def dot_in_fp32(t: torch.Tensor) -> bool:
    """Feed ``tl.dot`` fp32 operands under the interpreter: bf16 arithmetic there is wrong."""
    return INTERPRET and not t.is_cuda


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s GPU (``DEFAULT_NUM_SMS`` for a CPU tensor)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else DEFAULT_NUM_SMS


# Index of the launch configuration that fitted, per launch key (see ``launch_first_fitting``).
_CHOSEN: dict[tuple, int] = {}


def launch_first_fitting(key: tuple, configs: Sequence, launch: Callable[[object], None]) -> None:
    """Call ``launch(config)`` with the first of ``configs`` (largest tiles first) that the GPU accepts.

    A configuration needing more shared memory (or registers per thread) than the device has raises triton's
    ``OutOfResources`` when it is launched; the next one is tried, and the last one's failure is raised. The index
    that fitted is remembered per ``key`` (kernel, dtype, shape class, device), so later calls start there and
    compile nothing twice. Every kernel with large tiles launches through this, so each has a fallback that fits
    sm_80 (163 KiB of dynamic shared memory per block) as well as sm_90 (227 KiB); ``pytest -m gpu_compile``
    compiles every entry for both.
    """
    from triton.runtime.errors import OutOfResources

    for i in range(min(_CHOSEN.get(key, 0), len(configs) - 1), len(configs)):
        try:
            launch(configs[i])
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _CHOSEN[key] = i
        return


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    nonempty: bool = True,
) -> None:
    """Validate one tensor argument; raise ``ValueError`` that names it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            dims = " or ".join(map(str, allowed))
            raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the other inputs)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if nonempty and t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], like: str) -> None:
    """Raise ``ValueError`` unless ``t.shape == shape`` (``like`` names where ``shape`` comes from)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} to match {like}")


def check_targets(name: str, targets: torch.Tensor, vocab_size: int, ignore_index: int | None = None) -> None:
    """Targets must be integer token ids in ``[0, vocab_size)`` (``ignore_index`` allowed where given).

    This reads two scalars back to the host: it is input validation, done once per call, not per token.
    """
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32 token ids, got {targets.dtype}")
    valid = targets if ignore_index is None else targets[targets != ignore_index]
    if valid.numel() == 0:
        return
    lo, hi = int(valid.min()), int(valid.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} has ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size})")


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> None:
    """``cu_seqlens``: int32 ``[B + 1]``, starts at 0, non-decreasing, ends at ``total`` tokens."""
    check_tensor(name, cu_seqlens, ndim=1, dtypes=(torch.int32,))
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must hold at least two offsets [0, ..., total], got {cu_seqlens.tolist()}")
    c = cu_seqlens.cpu()
    if int(c[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(c[0])}")
    if int(c[-1]) != total:
        raise ValueError(f"{name} must end at the number of tokens {total}, got {int(c[-1])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {c.tolist()}")


def seq_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every packed token: ``[N]`` int64 with value ``b`` on ``[cu[b], cu[b+1])``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


def pad_packed(x_N: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Packed ``[N, ...]`` → padded ``[B, T_max, ...]`` (``fill`` in the padding). Used by references and tests."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    B, T = len(lengths), max(max(lengths), 1)
    out = x_N.new_full((B, T, *x_N.shape[1:]), fill)
    for b, (start, n) in enumerate(zip(cu_seqlens[:-1].tolist(), lengths)):
        out[b, :n] = x_N[start : start + n]
    return out


def unpad_padded(x_BT: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad_packed`: padded ``[B, T, ...]`` → packed ``[N, ...]``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return torch.cat([x_BT[b, :n] for b, n in enumerate(lengths)], dim=0)
