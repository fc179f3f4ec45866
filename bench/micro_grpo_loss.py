"""GRPO losses: ``grpo_loss`` on log-probs and ``fused_linear_grpo_loss`` from the last hidden state.

``grpo_loss <mode> <config> B×T``: inputs as a trainer has them (fp32 ``logprobs`` requiring grad, ``old`` and
``ref`` log-probs, a bool completion mask, per-sequence advantages). Configs: token-level ``dapo`` with β = 0.04
and clip-higher (ε_high = 0.28, DAPO/DeepScaleR), sequence-level ``grpo`` with β = 0.04 (GSPO: the kernel reads
each sequence twice), both with the KL defaults (``kl_weight="ratio"``: TRL 1.16's ``use_bias_correction_kl=True``;
k3, no KL clamps). ``fwd`` is a training forward (grad enabled); ``fwd+bwd`` adds the gradient. Members, all
fastgrpo's own code: ``fastgrpo`` (Triton on GPU, chunked torch on CPU), ``eager`` (``grpo_loss_ref``),
``torch.compile`` of it (token level fwd+bwd only: one compile, to bound the GPU check's time). Bytes moved: what
the fused kernels must move (token level: forward reads logp, old, ref (4 B each) and mask (1 B) per token, backward
reads them again and writes the fp32 gradient; sequence level: two forward passes); roofline: the copy bandwidth.

``fused_linear_grpo_loss fwd+bwd S×T×H×V``: DAPO, β = 0.04, ε_high = 0.28, token level, from ``hidden [S, T, H]``
and the LM head ``[V, H]`` to the loss and the gradients of hidden and weight, with plain k3 on every member:
``kl_weight="none"`` for fastgrpo and the reference (TRL's ``use_bias_correction_kl=False``), Liger's
``use_bias_correction_kl=False`` (its default). Liger's KL is plain k3; fastgrpo's default ``kl_weight="ratio"``
(k3 times the ratio) is another loss, β·k3·(r − 1) per token away (1.5e-4 relative here, above the check's 1e-4).
Members: ``fastgrpo``, ``eager`` (logits → fp32 log-softmax → gather → ``grpo_loss_ref``), Liger-Kernel's
``LigerFusedLinearGRPOLoss`` as Liger runs it by default (``liger``: its chunk loop under ``torch.compile``) and
uncompiled (``liger eager``), when liger-kernel is importable. Useful FLOPs: four K×H×V matmuls over the K completion
tokens (forward, recompute, two gradients: 8·K·H·V; prompt and padding rows are no useful work), credited to every
member; roofline: the matmul rate. Shapes: CPU 8×512×256×32000 fp32 (the issue's 4096 × 256 × 32000; with
``-m slow`` also 8×512×256×151936, Qwen's vocabulary, fastgrpo and eager only); GPU 8×1024×1536×151936 bf16; smoke
run 2×128×64×1000.

Why fastgrpo's time is close to eager's at the CPU shape, while its memory is a twentieth (measured on 2 cores of an
AMD EPYC, AVX2, at a 1-minute load of 3-6 from other work on the machine):

- Work. fastgrpo runs four products over the K completion rows, eager three over all N rows (6·N·H·V): with
  K/N = 0.50 here that is 0.67x eager's FLOPs. Skipping the prompt and padding rows pays for the backward's
  recompute and little more. At H = 256 both sides are matmul-bound; eager's passes over its 0.5 GB of logits
  (log-softmax forward and backward, the gather's zero-filled gradient) are about 30% of its time (profile, 1 thread).
- Matmul rate. Eager's products are three big MKL GEMMs ([4096, 256] × [256, 32000] and its two gradients);
  fastgrpo's are 256 products of 2048-token × 1024-vocabulary chunks, between 256 passes over an 8 MB chunk. On one
  thread the chunk products run at the big GEMMs' rate (36 vs 34 GFLOP/s, interleaved) and a whole call takes half
  of eager's (4.26 vs 8.58 s, paired 2.1x). On the default two threads they scale worse (18 vs 30 GFLOP/s): each
  small parallel op ends with its two threads meeting, and a busy machine stretches every such wait. The call is
  then 0.95x (interleaved with eager) to 1.43x (this group's rows) eager's speed; 1.10x in the issue's quieter run.
- Larger vocabulary or longer sequences do not change the time ratio: both sides' products and eager's passes over
  the logits grow with N·V alike (1.02x at V = 151936: 43.8 vs 44.6 s). They change the memory: eager's grows with
  N·V (7.1 GB at V = 151936), fastgrpo's with V·H (its weight gradient: 0.30 GB). What sets the time ratio is the
  completion share K/N, and H (a larger H makes both sides more matmul-bound: the ratio tends to 6·N / 8·K).
"""

from __future__ import annotations

import functools

import pytest
import torch
from common import (
    DEVICE,
    SMOKE_DTYPE,
    check_same,
    dtype_name,
    eager_logprobs,
    head_inputs,
    loss_and_grads,
    measure,
    members,
    sizes,
)
from fastgrpo.kernels import fused_linear_grpo_loss, grpo_loss
from fastgrpo.kernels.reference import grpo_loss_ref

CONFIGS = {
    "dapo/token": dict(loss_type="dapo", importance_sampling_level="token", beta=0.04, epsilon_high=0.28),
    "grpo/sequence": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
}
# the fused-linear group: plain k3 on every member (Liger's KL; fastgrpo's default kl_weight="ratio" is another loss)
LINEAR_CONFIG = dict(CONFIGS["dapo/token"], kl_weight="none")
LOSS_SHAPES = {"cpu": [(64, 4096)], "cuda": [(256, 8192)], "smoke": [(4, 256)]}
LINEAR_SHAPES = {"cpu": [(8, 512, 256, 32000, torch.float32)], "cuda": [(8, 1024, 1536, 151936, torch.bfloat16)],
                 "smoke": [(2, 128, 64, 1000, SMOKE_DTYPE)]}
# -m slow: the CPU shape at Qwen's vocabulary, fastgrpo and eager only (Liger's calls would take minutes)
LARGER_LINEAR_SHAPES = {"cpu": [(8, 512, 256, 151936, torch.float32)], "cuda": [], "smoke": []}


@functools.lru_cache(maxsize=1)
def _loss_inputs(B, T):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logp = -torch.rand(B, T, device=DEVICE, generator=g) * 3  # [B, T]
    old = logp + 0.3 * torch.randn(B, T, device=DEVICE, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, device=DEVICE, generator=g)
    adv = torch.randn(B, device=DEVICE, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), device=DEVICE, generator=g)
    mask = torch.arange(T, device=DEVICE)[None, :] < lengths[:, None]  # [B, T] bool
    return logp.requires_grad_(), old, ref, adv, mask


def _bytes_moved(B, T, level, mode):
    """Bytes the fused kernels must move for fp32 logp/old/ref and a bool mask."""
    if level == "sequence":  # fwd: (logp, old, mask) then (logp, ref, mask); bwd: logp, ref, mask, write grad
        fwd, bwd = 9 + 9, 9 + 4
    else:  # fwd: logp, old, ref, mask; bwd: the same, write grad
        fwd, bwd = 13, 13 + 4
    return B * T * (fwd if mode == "fwd" else fwd + bwd)


def _loss_cases():
    for B, T in sizes(LOSS_SHAPES):
        for config in CONFIGS:
            for mode in ("fwd", "fwd+bwd"):
                for method in members(("fastgrpo", "eager", "torch.compile"), compiled=("torch.compile",)):
                    if method == "torch.compile" and (config != "dapo/token" or mode == "fwd"):
                        continue
                    yield pytest.param((B, T), config, mode, method, id=f"{mode}-{config}-{B}x{T}-{method}")


def _loss_fn(method, config):
    fn = grpo_loss if method == "fastgrpo" else grpo_loss_ref

    def loss(logp, old, ref, adv, mask):
        return fn(logp, old, adv, mask, ref_logprobs=ref, **CONFIGS[config])[0]

    return torch.compile(loss, dynamic=False) if method == "torch.compile" else loss


def _loss_call(fn, shape, mode):
    logp, old, ref, adv, mask = _loss_inputs(*shape)
    loss = fn(logp, old, ref, adv, mask)
    return {"loss": loss.detach()} if mode == "fwd" else loss_and_grads(loss, {"logprobs": logp})


@functools.lru_cache(maxsize=1)
def _loss_fastgrpo(shape, config, mode):
    return _loss_call(_loss_fn("fastgrpo", config), shape, mode)


@pytest.mark.parametrize(("shape", "config", "mode", "method"), list(_loss_cases()))
def test_grpo_loss(benchmark, ceilings, shape, config, mode, method):
    fn = _loss_fn(method, config)
    want = _loss_fastgrpo(shape, config, mode)  # fastgrpo's own case: this call was its warm-up
    err = 0.0 if method == "fastgrpo" else check_same(_loss_call(fn, shape, mode), want, torch.float32, method)
    B, T = shape
    benchmark.group = f"grpo_loss {mode} {config} {B}x{T}"
    measure(benchmark, lambda: _loss_call(fn, shape, mode), device=DEVICE, method=method, ceilings=ceilings,
            bytes_moved=_bytes_moved(B, T, CONFIGS[config]["importance_sampling_level"], mode), op="grpo_loss",
            shape=f"B={B} T={T}", config=config, max_abs_err_vs_fastgrpo=err)


def _linear_cases():
    for shapes, methods, marks in ((sizes(LINEAR_SHAPES), ("fastgrpo", "eager", "liger", "liger eager"), ()),
                                   (sizes(LARGER_LINEAR_SHAPES), ("fastgrpo", "eager"), pytest.mark.slow)):
        for S, T, H, V, dtype in shapes:
            for method in members(methods, compiled=("liger",)):
                yield pytest.param((S, T, H, V, dtype), method, marks=marks,
                                   id=f"fwd+bwd-{S}x{T}x{H}x{V}-{dtype_name(dtype)}-{method}")


@functools.lru_cache(maxsize=1)
def _old_ref_adv(shape):
    """Old and reference log-probs near the policy's own (ratios near 1, some clipped), advantages [S]."""
    hidden, weight, targets, _ = head_inputs(*shape)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    with torch.no_grad():
        base = eager_logprobs(hidden, weight, targets)  # [S, T]
    old = base + 0.3 * torch.randn(base.shape, device=DEVICE, generator=g)
    ref = base + 0.3 * torch.randn(base.shape, device=DEVICE, generator=g)
    return old, ref, torch.randn(base.shape[0], device=DEVICE, generator=g)


def _linear_fn(method):
    """fn(hidden, weight, targets, mask, old, ref, adv) -> loss (DAPO, β = 0.04, ε_high = 0.28, plain k3)."""
    cfg = LINEAR_CONFIG
    if method == "fastgrpo":
        return lambda h, w, y, m, old, ref, adv: fused_linear_grpo_loss(h, w, y, old, adv, m, ref_logprobs=ref,
                                                                         **cfg)[0]
    if method == "eager":
        return lambda h, w, y, m, old, ref, adv: grpo_loss_ref(eager_logprobs(h, w, y), old, adv, m,
                                                               ref_logprobs=ref, **cfg)[0]
    liger = pytest.importorskip("liger_kernel.chunked_loss",
                                reason="liger-kernel is not installed (pip install -e '.[bench]')")
    module = liger.LigerFusedLinearGRPOLoss(beta=cfg["beta"], epsilon_low=0.2, epsilon_high=cfg["epsilon_high"],
                                            loss_type=cfg["loss_type"],
                                            importance_sampling_level=cfg["importance_sampling_level"],
                                            use_bias_correction_kl=False, compiled=method == "liger")
    return lambda h, w, y, m, old, ref, adv: module(h, w, y, m.long(), adv, ref_per_token_logps=ref,
                                                    old_per_token_logps=old)[0]


def _linear_call(fn, shape):
    hidden, weight, targets, mask = head_inputs(*shape)
    loss = fn(hidden, weight, targets, mask, *_old_ref_adv(shape))
    return loss_and_grads(loss, {"hidden": hidden, "weight": weight})


@functools.lru_cache(maxsize=1)
def _linear_fastgrpo(shape):
    return _linear_call(_linear_fn("fastgrpo"), shape)


@pytest.mark.parametrize(("shape", "method"), list(_linear_cases()))
def test_fused_linear_grpo_loss(benchmark, ceilings, shape, method):
    S, T, H, V, dtype = shape
    fn = _linear_fn(method)
    want = _linear_fastgrpo(shape)  # fastgrpo's own case: this call was its warm-up
    err = 0.0 if method == "fastgrpo" else check_same(_linear_call(fn, shape), want, dtype, method)
    benchmark.group = f"fused_linear_grpo_loss fwd+bwd {S}x{T}x{H}x{V} {dtype_name(dtype)}"
    completion_tokens = int(head_inputs(*shape)[3].sum())
    measure(benchmark, lambda: _linear_call(fn, shape), device=DEVICE, method=method, ceilings=ceilings,
            flops=8 * completion_tokens * H * V,
            op="fused_linear_grpo_loss", shape=f"S={S} T={T} H={H} V={V}",
            completion_tokens=completion_tokens, dtype=dtype_name(dtype), config="dapo/token kl_weight=none",
            max_abs_err_vs_fastgrpo=err)
