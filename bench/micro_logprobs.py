"""``logprobs_from_logits`` against eager torch, TRL's ``selective_log_softmax`` and ``torch.compile``.

Groups: ``logprobs <mode> <logp|logp+entropy> B×T×V dtype`` for mode ``fwd`` (no grad: old/reference log-probs)
and ``fwd+bwd`` (random upstream gradients for logp and the entropy; the logits gradient is returned). Members:

- ``fastgrpo``: :func:`fastgrpo.kernels.logprobs.logprobs_from_logits` (Triton on GPU, chunked torch on CPU);
- ``fastgrpo inplace``: ``inplace_backward=True`` (fwd+bwd only; fresh logits before each call, not timed);
- ``eager``: ``kernels.reference.logprobs_ref``, i.e. ``log_softmax(logits.float() / T).gather(...)``;
- ``trl``: TRL's ``selective_log_softmax`` / ``selective_log_softmax_and_entropy`` (``trl.trainer.utils``; its
  Triton kernel on GPU, its row loop on CPU), when trl is importable, at the same ``temperature`` (0.9), no
  ``row_mask`` (every row computed, as fastgrpo) and TRL's default ``entropy_requires_grad=True``;
- ``torch.compile``: the eager composition compiled (fwd+bwd of logp only: one compile, to bound the GPU check's
  time).

Bytes moved: forward reads the logits once (N·V·element size); forward+backward reads them twice and writes the
gradient (3·N·V·element size). Roofline: the copy bandwidth measured in the session. Shapes: CPU 4×512×32000
fp32; GPU 16×1024×151936 bf16 (Qwen's vocabulary); smoke run 2×64×1000.
"""

from __future__ import annotations

import functools

import pytest
import torch
from common import DEVICE, SMOKE_DTYPE, check_same, measure, members, sizes
from fastgrpo.kernels.logprobs import logprobs_from_logits
from fastgrpo.kernels.reference import logprobs_ref

TEMPERATURE = 0.9
SHAPES = {"cpu": [(4, 512, 32000, torch.float32)], "cuda": [(16, 1024, 151936, torch.bfloat16)],
          "smoke": [(2, 64, 1000, SMOKE_DTYPE)]}
METHODS = ("fastgrpo", "fastgrpo inplace", "eager", "trl", "torch.compile")


def _cases():
    for B, T, V, dtype in sizes(SHAPES):
        for entropy in (False, True):
            for mode in ("fwd", "fwd+bwd"):
                for method in members(METHODS, compiled=("torch.compile",)):
                    backward_only = method == "fastgrpo inplace" or (method == "torch.compile" and not entropy)
                    if (backward_only and mode == "fwd") or (method == "torch.compile" and entropy):
                        continue
                    what = "logp+entropy" if entropy else "logp"
                    dt = str(dtype).removeprefix("torch.")
                    yield pytest.param((B, T, V, dtype), entropy, mode, method,
                                       id=f"{mode}-{what}-{B}x{T}x{V}-{dt}-{method}")


@functools.lru_cache(maxsize=1)
def _inputs(B, T, V, dtype):
    """Logits [B, T, V] (a leaf that requires grad), targets [B, T], upstream gradients for logp and entropy."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(B, T, V, device=DEVICE, generator=g) * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), device=DEVICE, generator=g)
    grads = torch.randn(2, B, T, device=DEVICE, generator=g)
    return logits, targets, grads


def _method(name, entropy):
    """fn(logits, targets) -> logp or (logp, entropy) for one member of the group."""
    if name in ("fastgrpo", "fastgrpo inplace"):
        return functools.partial(logprobs_from_logits, temperature=TEMPERATURE, return_entropy=entropy,
                                 inplace_backward=name == "fastgrpo inplace")
    eager = functools.partial(logprobs_ref, temperature=TEMPERATURE, return_entropy=entropy)
    if name == "eager":
        return eager
    if name == "torch.compile":
        return torch.compile(eager, dynamic=False)
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed (pip install -e '.[bench]')")
    if entropy:
        return functools.partial(trl_utils.selective_log_softmax_and_entropy, temperature=TEMPERATURE)
    return functools.partial(trl_utils.selective_log_softmax, temperature=TEMPERATURE)


def _call(fn, logits, targets, grads, entropy, mode):
    """Run one method; returns its outputs by name (and the logits gradient for fwd+bwd)."""
    if mode == "fwd":
        with torch.no_grad():
            out = fn(logits, targets)
    else:
        out = fn(logits, targets)
    outs = out if entropy else (out,)
    named = dict(zip(("logp", "entropy"), (o.detach() for o in outs)))
    if mode == "fwd+bwd":
        (named["grad_logits"],) = torch.autograd.grad(outs, logits, tuple(grads[: len(outs)]))
    return named


@functools.lru_cache(maxsize=1)
def _fastgrpo_result(shape, entropy, mode):
    logits, targets, grads = _inputs(*shape)
    return _call(_method("fastgrpo", entropy), logits, targets, grads, entropy, mode)


@pytest.mark.parametrize(("shape", "entropy", "mode", "method"), list(_cases()))
def test_logprobs(benchmark, ceilings, shape, entropy, mode, method):
    B, T, V, dtype = shape
    logits, targets, grads = _inputs(*shape)
    fn = _method(method, entropy)
    holder = [logits]
    if method == "fastgrpo inplace":  # the backward overwrites its logits: a fresh copy before each call

        def fresh_logits():
            holder[0] = logits.detach().clone().requires_grad_()
    else:
        fresh_logits = None
    if fresh_logits:
        fresh_logits()
    want = _fastgrpo_result(shape, entropy, mode)  # fastgrpo's own case: this call was its warm-up
    err = 0.0 if method == "fastgrpo" else check_same(_call(fn, holder[0], targets, grads, entropy, mode), want,
                                                      dtype, method)
    N, elem = B * T, logits.element_size()
    benchmark.group = f"logprobs {mode} {'logp+entropy' if entropy else 'logp'} {B}x{T}x{V} {dtype}"
    measure(benchmark, lambda: _call(fn, holder[0], targets, grads, entropy, mode), device=DEVICE, method=method,
            ceilings=ceilings, bytes_moved=(N * V * elem) * (1 if mode == "fwd" else 3), setup=fresh_logits,
            op="logprobs", shape=f"N={N} V={V}", dtype=str(dtype), temperature=TEMPERATURE,
            max_abs_err_vs_fastgrpo=err)
