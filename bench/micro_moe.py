"""The Qwen3-MoE sparse block, forward + backward: ``sparse_moe_block`` against transformers' experts implementations.

``moe fwd+bwd T×H×I E/K dtype``: one ``Qwen3MoeSparseMoeBlock`` (router, top-K with ``norm_topk_prob``, experts) on
``hidden [T, H]`` with a random upstream gradient, to the gradients of hidden, the router weight and both expert
weights. Every member runs on the same block's tensors. Members:

- ``fastgrpo``: :func:`fastgrpo.kernels.moe.sparse_moe_block` (Triton grouped GEMMs on GPU, the per-expert torch
  path on CPU);
- ``hf eager``, ``hf batched_mm``, ``hf grouped_mm``: the block's own forward with ``config._experts_implementation``
  set to each of transformers' implementations (5.x: the per-expert loop, ``bmm`` on per-pair weight copies,
  ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` or transformers' loop fallback); batched_mm only where
  its copies of both weights per (token, expert) pair, ``S·3·I·H`` elements, stay under 1 GiB (the smoke sizes);
- ``torch._grouped_mm``: the same router, then sort by expert, ``torch._grouped_mm`` for gate/up and for down,
  SiLU·mul and the weights in between, unpermute by a sum over the K slots (where ``torch._grouped_mm`` exists).

FLOPs: 6·S·H·I forward (gate/up 4·S·H·I, down 2·S·H·I, S = T·K pairs), 18·S·H·I forward + backward, credited to
every member (the router's 2·T·H·E is left out); roofline: the matmul rate. Shapes: CPU 512×512×256, 16 experts,
top 4, fp32; GPU Qwen3-30B-A3B's layer, 8192×2048×768, 128 experts, top 8, bf16; smoke run 64×64×32, 8 experts,
top 2.

    pytest bench/micro_moe.py --benchmark-only --benchmark-columns=median,rounds      # the table, ratios per group
    pytest bench/micro_moe.py --benchmark-disable                                     # smoke: numbers check, untimed
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from common import DEVICE, SMOKE_DTYPE, check_same, dtype_name, loss_and_grads, measure, sizes
from fastgrpo.kernels.moe import moe_router, sparse_moe_block

SHAPES = {"cpu": [(512, 512, 256, 16, 4, torch.float32)], "cuda": [(8192, 2048, 768, 128, 8, torch.bfloat16)],
          "smoke": [(64, 64, 32, 8, 2, SMOKE_DTYPE)]}
BATCHED_MM_MAX_BYTES = 1 << 30  # hf batched_mm runs where its per-pair weight copies stay under this
METHODS = ("fastgrpo", "hf eager", "hf batched_mm", "hf grouped_mm", "torch._grouped_mm")


def _cases():
    for shape in sizes(SHAPES):
        T, H, I, E, K, dtype = shape
        for method in METHODS:
            yield pytest.param(shape, method, id=f"{T}x{H}x{I}-{E}e{K}-{dtype_name(dtype)}-{method}")


@functools.lru_cache(maxsize=1)
def _block(T, H, I, E, K, dtype):
    """The HF block (weights ~N(0, 1/fan_in)), hidden ``[T, H]`` (a leaf) and an upstream gradient."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                         norm_topk_prob=True)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=g) / H**0.5)
        block.experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        block.experts.down_proj.copy_(torch.randn(E, H, I, generator=g) / I**0.5)
    block = block.to(device=DEVICE, dtype=dtype)
    x = torch.randn(T, H, generator=g).to(device=DEVICE, dtype=dtype).requires_grad_()
    grad = torch.randn(T, H, generator=g).to(device=DEVICE, dtype=dtype)
    return block, x, grad


def _grouped_mm_block(x, router_weight, gate_up, down, K):
    """The torch._grouped_mm composition (module docstring)."""
    T, H = x.shape
    _, w_TK, ids_TK = moe_router(x, router_weight, K, norm_topk_prob=True)
    ids_S, order = torch.sort(ids_TK.reshape(-1), stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, ids_S, torch.ones_like(ids_S, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gu = torch._grouped_mm(x[order // K], gate_up.transpose(1, 2), offs=offs)  # [S, 2I]
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs)  # [S, H]
    y = y * w_TK.reshape(-1)[order, None]
    out = torch.zeros(T * K, H, dtype=y.dtype, device=y.device).index_copy(0, order, y)  # back to pair order
    return out.view(T, K, H).sum(1)


def _fn(method, block, K, T):
    if method == "hf batched_mm":
        _, I2, H = block.experts.gate_up_proj.shape
        copies = T * K * 3 * (I2 // 2) * H * block.experts.gate_up_proj.element_size()
        if copies > BATCHED_MM_MAX_BYTES:
            pytest.skip(f"batched_mm gathers both weights per (token, expert) pair: {copies / 2**30:.1f} GiB at this "
                        "shape, forward and again for their gradients")
    if method == "fastgrpo":
        return lambda x: sparse_moe_block(x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj,
                                          top_k=K, norm_topk_prob=True)[0]
    if method == "torch._grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("this torch has no torch._grouped_mm")
        return lambda x: _grouped_mm_block(x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj,
                                           K)
    impl = method.removeprefix("hf ")

    def hf(x):
        block.experts.config._experts_implementation = impl  # read by every forward of the experts
        return block(x[None])[0]

    return hf


def _scaled(result, scale):
    """Each output divided by fastgrpo's largest magnitude of it: the numbers check is then relative to the output's
    scale (the router's gradient sums T tokens' terms that cancel: elementwise, its small entries differ in the last
    digits between two summation orders)."""
    return {k: v.float() / scale[k] for k, v in result.items()}


def _call(fn, block, x, grad):
    out = fn(x)
    params = {"hidden": x, "router": block.gate.weight, "gate_up": block.experts.gate_up_proj,
              "down": block.experts.down_proj}
    return {**loss_and_grads((out.float() * grad.float()).sum(), params), "out": out.detach()}


@functools.lru_cache(maxsize=1)
def _fastgrpo_result(shape):
    block, x, grad = _block(*shape)
    return _call(_fn("fastgrpo", block, shape[4], shape[0]), block, x, grad)


@pytest.mark.parametrize(("shape", "method"), list(_cases()))
def test_moe(benchmark, ceilings, shape, method):
    T, H, I, E, K, dtype = shape
    block, x, grad = _block(*shape)
    fn = _fn(method, block, K, T)
    want = _fastgrpo_result(shape)
    scale = {k: max(v.float().abs().max().item(), 1e-30) for k, v in want.items()}
    err = 0.0 if method == "fastgrpo" else check_same(_scaled(_call(fn, block, x, grad), scale), _scaled(want, scale),
                                                      dtype, method)
    benchmark.group = f"moe fwd+bwd {T}x{H}x{I} {E}e top{K} {dtype_name(dtype)}"
    measure(benchmark, lambda: _call(fn, block, x, grad), device=DEVICE, method=method, ceilings=ceilings,
            flops=18 * T * K * H * I, op="moe", shape=f"T={T} H={H} I={I} E={E} K={K}", dtype=dtype_name(dtype),
            max_rel_err_vs_fastgrpo=err)
