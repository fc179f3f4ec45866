"""``fused_linear_logprobs`` / ``fused_linear_cross_entropy`` against materialised logits and the peers.

``linear_logprobs <mode> N×H×V dtype``: log-probs of the targets from ``hidden [N, H]`` and the LM head
``[V, H]``; ``fwd`` without grad (old / reference log-probs), ``fwd+bwd`` with a random upstream gradient, to the
gradients of hidden and weight. Members:

- ``fastgrpo``: :func:`fastgrpo.kernels.linear_logprobs.fused_linear_logprobs` (Triton on GPU, chunked torch on CPU);
- ``eager``: ``hidden @ weightᵀ`` in the compute dtype → fp32 ``log_softmax`` → gather (``common.eager_logprobs``);
- ``trl``: TRL's ``trl.kernels.ChunkedLogProbFunction`` (what ``add_fused_lm_head`` runs) with its default
  vocabulary chunk of 32768, when trl is importable, with the flags under which it computes fastgrpo's log-probs:
  no bias, ``temperature=1``, no ``final_logit_softcapping``, ``logit_scale=1``, no optional outputs (entropy);
- ``torch.compile``: the eager composition compiled (fwd+bwd only: one compile, to bound the GPU check's time).

``cross_entropy fwd+bwd``: the SFT loss (mean ``−logp`` over the tokens), ``fastgrpo``
(:func:`fused_linear_cross_entropy`), ``eager`` (``F.cross_entropy`` on fp32 logits) and Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss`` (a Triton kernel: GPU only).

``linear_logprobs fwd+bwd confident`` (GPU): ``grad_filter_eps = 2⁻¹²`` (``fastgrpo grad_filter``) against the exact
backward on a low-entropy distribution like a trained LM's, where whole vocabulary tiles fall under the threshold.

FLOPs: forward 2·N·H·V; forward+backward 8·N·H·V (forward, recompute, two gradients; fastgrpo's design, credited
to every member); roofline: the matmul rate. Shapes: CPU 2048×256×32000 fp32; GPU 16384×1536×151936 bf16; smoke
run 256×64×1000.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from common import DEVICE, SMOKE_DTYPE, check_same, dtype_name, eager_logprobs, loss_and_grads, measure, members, sizes
from fastgrpo.kernels.linear_logprobs import fused_linear_cross_entropy, fused_linear_logprobs

SHAPES = {"cpu": [(2048, 256, 32000, torch.float32)], "cuda": [(16384, 1536, 151936, torch.bfloat16)],
          "smoke": [(256, 64, 1000, SMOKE_DTYPE)]}
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16
FILTER_EPS = 2.0**-12  # Cut Cross-Entropy's default for bf16: below bf16's resolution next to 1


def _cases():
    for N, H, V, dtype in sizes(SHAPES):
        name = f"{N}x{H}x{V}-{dtype_name(dtype)}"
        for mode in ("fwd", "fwd+bwd"):
            methods = ("fastgrpo", "eager", "trl", "torch.compile")[: 4 if mode == "fwd+bwd" else 3]
            for method in members(methods, compiled=("torch.compile",)):
                yield pytest.param((N, H, V, dtype), "linear_logprobs", mode, method, id=f"{mode}-{name}-{method}")
        for method in ("fastgrpo", "eager", "liger"):
            yield pytest.param((N, H, V, dtype), "cross_entropy", "fwd+bwd", method, id=f"ce-{name}-{method}")
        if DEVICE == "cuda":
            for method in ("fastgrpo", "fastgrpo grad_filter"):
                yield pytest.param((N // 4, H, V, dtype), "confident", "fwd+bwd", method,
                                   id=f"confident-{name}-{method}")


@functools.lru_cache(maxsize=1)
def _inputs(N, H, V, dtype, confident):
    """hidden [N, H], weight [V, H] (leaves), targets [N], upstream gradient [N]. ``confident``: hidden rows aligned
    with their target's head row (scale 14), a low-entropy distribution like a trained LM's."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(V, H, device=DEVICE, generator=g) / math.sqrt(H)
    y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    h = torch.randn(N, H, device=DEVICE, generator=g)
    h = 14.0 * w[y] + h / math.sqrt(H) if confident else h
    grad = torch.randn(N, device=DEVICE, generator=g)
    return h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(), y, grad


def _fn(op, method):
    """fn(hidden, weight, targets) -> logp [N] (linear_logprobs, confident) or the mean NLL (cross_entropy)."""
    if op == "cross_entropy":
        if method == "fastgrpo":
            return fused_linear_cross_entropy
        if method == "eager":
            return lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y)
        if DEVICE != "cuda":
            pytest.skip("LigerFusedLinearCrossEntropyLoss is a Triton kernel: GPU only")
        liger = pytest.importorskip("liger_kernel.transformers",
                                    reason="liger-kernel is not installed (pip install -e '.[bench]')")
        module = liger.LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: module(w, h, y)
    if method == "fastgrpo":
        return fused_linear_logprobs
    if method == "fastgrpo grad_filter":
        return functools.partial(fused_linear_logprobs, grad_filter_eps=FILTER_EPS)
    if method == "eager":
        return eager_logprobs
    if method == "torch.compile":
        return torch.compile(eager_logprobs, dynamic=False)
    trl = pytest.importorskip("trl.kernels", reason="trl is not installed (pip install -e '.[bench]')")
    return lambda h, w, y: trl.ChunkedLogProbFunction.apply(h, w, None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ())[0]


def _call(fn, shape, op, mode):
    h, w, y, grad = _inputs(*shape, op == "confident")
    if mode == "fwd":
        with torch.no_grad():
            return {"logp": fn(h, w, y)}
    out = fn(h, w, y)
    loss = out if op == "cross_entropy" else (out * grad).sum()  # Σ g·logp: backward with upstream gradient g
    return {**loss_and_grads(loss, {"hidden": h, "weight": w}), "value": out.detach()}


@functools.lru_cache(maxsize=1)
def _fastgrpo_result(shape, op, mode):
    return _call(_fn(op, "fastgrpo"), shape, op, mode)


@pytest.mark.parametrize(("shape", "op", "mode", "method"), list(_cases()))
def test_linear_logprobs(benchmark, ceilings, shape, op, mode, method):
    N, H, V, dtype = shape
    fn = _fn(op, method)
    want = _fastgrpo_result(shape, op, mode)  # fastgrpo's own case: this call was its warm-up
    err = 0.0 if method == "fastgrpo" else check_same(_call(fn, shape, op, mode), want, dtype, method)
    group = "cross_entropy" if op == "cross_entropy" else "linear_logprobs"
    benchmark.group = f"{group} {mode}{' confident' if op == 'confident' else ''} {N}x{H}x{V} {dtype_name(dtype)}"
    measure(benchmark, lambda: _call(fn, shape, op, mode), device=DEVICE, method=method, ceilings=ceilings,
            flops=(2 if mode == "fwd" else 8) * N * H * V, op=group, shape=f"N={N} H={H} V={V}",
            dtype=dtype_name(dtype), max_abs_err_vs_fastgrpo=err)
