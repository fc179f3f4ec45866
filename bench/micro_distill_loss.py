"""On-policy distillation loss: ``fused_linear_distill_loss`` from two hidden states and two LM heads, fwd+bwd.

``fused_linear_distill_loss fwd+bwd S×T×H×V``: TRL's generalized JSD at β = 0.5 (GKD's default) and temperature 0.9
(``GKDConfig``'s default), token mean over a completion mask (a prompt of T/8 tokens, a completion of random
length ≥ T/4, then padding: ``common.head_inputs``), from the student's ``hidden [S, T, H]`` and head ``[V, H]``
(leaves that require grad) and a frozen teacher of the same size (its hidden state correlated with the student's),
to the loss and the gradients of the student's hidden state and head. Members:

- ``fastgrpo``: ``fused_linear_distill_loss`` (Triton on GPU, chunked torch on CPU; masked-out rows skipped).
- ``eager``: TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` on the full logits (``hidden @ weightᵀ`` in the compute
  dtype, upcast to fp32 as a trainer's loss does; the teacher's under ``no_grad``), ``labels`` −100 outside the mask,
  ``reduction="batchmean"`` (= the token mean). At the GPU shape each fp32 logits tensor is 10 GB and the function
  keeps several: an out-of-memory error is recorded as a row of ``bench/results/distill_loss.csv`` and the case is
  skipped, not a crash.
- ``torch.compile``: the same eager function compiled (CPU only: at the GPU shape it needs the same logits and its
  compile alone would take most of the step's bounded time in ``gpu_check.sh``).
- ``liger``: on CPU ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`` as Liger runs it by default (its chunk loop
  under ``torch.compile``; ``weight_hard_loss=0``, ``weight_soft_loss=1``: the JSD alone, summed over kept tokens
  and divided by their count) and ``liger eager`` uncompiled; on GPU the Triton ``LigerFusedLinearJSD`` (``jsd_beta``,
  the same mean). Both follow TRL's β convention (β weighs the teacher in the mixture; 0 is KL(teacher ‖ student)),
  checked against fastgrpo's numbers before timing like every member.

Useful FLOPs: the four K×H×V products over the K completion tokens (both models' logits forward, the student's two
gradient products: ``8·K·H·V``; prompt and padding rows, recomputes and the JSD's second forward pass are no useful
work), credited to every member; roofline: the matmul rate. Peak extra memory is measured on a separate call.
Shapes: CPU 8×512×256×32000 fp32 (4,096 tokens, the issue's); GPU 16×1024×1536×151936 bf16 (16K tokens, Qwen's head);
smoke run 2×128×64×1000.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from common import (
    DEVICE,
    SMOKE_DTYPE,
    append_rows,
    check_same,
    dtype_name,
    head_inputs,
    loss_and_grads,
    measure,
    members,
    sizes,
)
from fastgrpo.kernels import fused_linear_distill_loss

BETA, TEMPERATURE = 0.5, 0.9
SHAPES = {"cpu": [(8, 512, 256, 32000, torch.float32)], "cuda": [(16, 1024, 1536, 151936, torch.bfloat16)],
          "smoke": [(2, 128, 64, 1000, SMOKE_DTYPE)]}
METHODS = {"cpu": ("fastgrpo", "eager", "torch.compile", "liger", "liger eager"),
           "cuda": ("fastgrpo", "eager", "liger")}
GPU_ROUNDS = 10  # bounds the step in gpu_check.sh (a fastgrpo call is ~0.1 s there, Liger's a few times that)


@functools.lru_cache(maxsize=1)
def _teacher(shape):
    """The teacher's ``hidden [S, T, H]`` and head ``[V, H]`` (constants), correlated with the student's."""
    S, T, H, V, dtype = shape
    hidden, weight, _, _ = head_inputs(*shape)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    with torch.no_grad():
        t_hidden = (0.7 * hidden.float() + 0.7 * torch.randn(S, T, H, device=DEVICE, generator=g)).to(dtype)
        t_weight = (0.8 * weight.float() + 0.6 * torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype)
    return t_hidden, t_weight


def _eager(h, w, th, tw, m):
    from trl.experimental.gkd import GKDTrainer

    with torch.no_grad():
        teacher_logits = (th @ tw.t()).float()  # [S, T, V]
    labels = torch.where(m, 0, -100)  # only the mask is read
    return GKDTrainer.generalized_jsd_loss((h @ w.t()).float(), teacher_logits, labels=labels, beta=BETA,
                                           temperature=TEMPERATURE, reduction="batchmean")


def _method_fn(method):
    """fn(hidden, weight, teacher_hidden, teacher_weight, mask) -> loss."""
    if method == "fastgrpo":
        return lambda h, w, th, tw, m: fused_linear_distill_loss(h, w, th, tw, m, beta=BETA, temperature=TEMPERATURE,
                                                                 loss_type="bnpo")[0]
    if method in ("eager", "torch.compile"):
        pytest.importorskip("trl.experimental.gkd", reason="trl is not installed (pip install -e '.[bench]')")
        return _eager if method == "eager" else torch.compile(_eager, dynamic=False)
    if DEVICE == "cuda":
        liger = pytest.importorskip("liger_kernel.transformers",
                                    reason="liger-kernel is not installed (pip install -e '.[bench]')")
        module = liger.LigerFusedLinearJSD(jsd_beta=BETA, temperature=TEMPERATURE)
    else:
        liger = pytest.importorskip("liger_kernel.chunked_loss",
                                    reason="liger-kernel is not installed (pip install -e '.[bench]')")
        module = liger.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA,
                                               temperature=TEMPERATURE, compiled=method == "liger")

    def liger_loss(h, w, th, tw, m):
        H = h.shape[-1]
        labels = torch.where(m, 0, -100).reshape(-1)
        return module(h.reshape(-1, H), w, th.reshape(-1, th.shape[-1]), tw, labels)

    return liger_loss


def _call(fn, shape):
    hidden, weight, _, mask = head_inputs(*shape)
    loss = fn(hidden, weight, *_teacher(shape), mask)
    return loss_and_grads(loss, {"hidden": hidden, "weight": weight})


@functools.lru_cache(maxsize=1)
def _fastgrpo(shape):
    return _call(_method_fn("fastgrpo"), shape)


def _cases():
    for S, T, H, V, dtype in sizes(SHAPES):
        for method in members(METHODS[DEVICE], compiled=("torch.compile", "liger") if DEVICE == "cpu" else ()):
            yield pytest.param((S, T, H, V, dtype), method, id=f"fwd+bwd-{S}x{T}x{H}x{V}-{dtype_name(dtype)}-{method}")


@pytest.mark.parametrize(("shape", "method"), list(_cases()))
def test_fused_linear_distill_loss(benchmark, ceilings, shape, method):
    S, T, H, V, dtype = shape
    fn = _method_fn(method)
    want = _fastgrpo(shape)  # fastgrpo's own case: this call was its warm-up
    err = 0.0
    if method != "fastgrpo":
        try:
            err = check_same(_call(fn, shape), want, dtype, method)
        except torch.OutOfMemoryError as exc:  # a row, not a crash
            gc.collect()
            torch.cuda.empty_cache()
            append_rows("distill_loss", [{"method": method, "shape": f"S={S} T={T} H={H} V={V}",
                                          "dtype": dtype_name(dtype), "status": "out of memory",
                                          "error": str(exc).splitlines()[0][:200]}], DEVICE)
            pytest.skip(f"{method}: out of memory at S={S} T={T} H={H} V={V} (row in bench/results/distill_loss.csv)")
    benchmark.group = f"fused_linear_distill_loss fwd+bwd {S}x{T}x{H}x{V} {dtype_name(dtype)}"
    completion_tokens = int(head_inputs(*shape)[3].sum())
    measure(benchmark, lambda: _call(fn, shape), device=DEVICE, method=method, ceilings=ceilings,
            flops=8 * completion_tokens * H * V, rounds=GPU_ROUNDS if DEVICE == "cuda" else None,
            op="fused_linear_distill_loss", shape=f"S={S} T={T} H={H} V={V}", completion_tokens=completion_tokens,
            dtype=dtype_name(dtype), config=f"jsd beta={BETA} T={TEMPERATURE}", max_abs_err_vs_fastgrpo=err)
