"""The shared packed forward: the training forward to the last hidden state and the LM head, the module to call
for no-grad forwards, and the no-grad log-probs of a micro-batch's targets."""

from __future__ import annotations

import torch

from fastgrpo.kernels.batch_invariant import forward_scope
from fastgrpo.kernels.linear_logprobs import masked_linear_logprobs
from fastgrpo.models.attention import packed_hidden_states
from fastgrpo.models.loading import lm_head_params
from fastgrpo.models.packing import PackedBatch
from fastgrpo.models.vlm import packed_vlm_hidden_states


def packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen, vision=None, moe_routing=None):
    """The training forward (run as the DDP/FSDP-wrapped model's forward): hidden ``[N, H]``, LM head weight, bias.
    ``vision``: a VLM micro-batch's images and 3-D positions (``fastgrpo.models.vlm.packed_vlm_hidden_states``).
    ``moe_routing``: an MoE model's routing of this forward (``fastgrpo.models.moe.MoERouting``). With
    ``numerics.batch_invariant`` on, on the batch-invariant ops (``fastgrpo.kernels.batch_invariant``)."""
    if vision is not None:
        hidden_NH = packed_vlm_hidden_states(model, input_ids, cu_seqlens, max_seqlen, vision)
        weight_VH, bias_V = lm_head_params(model)
        return hidden_NH, weight_VH, bias_V
    batch = PackedBatch(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    with forward_scope():
        hidden_NH = packed_hidden_states(model, batch, moe_routing)
    weight_VH, bias_V = lm_head_params(model)
    return hidden_NH, weight_VH, bias_V


def forward_packed(model, mb, moe_routing=None):
    """``model``'s packed forward (a module whose call is :func:`packed_forward`) on ``mb.batch``: hidden ``[N, H]``,
    LM head weight, bias. ``mb``: any micro-batch with a ``batch`` (:class:`fastgrpo.models.packing.PackedBatch`)."""
    b = mb.batch
    extra = {} if moe_routing is None else {"moe_routing": moe_routing}
    if getattr(mb, "vision", None) is not None:  # a VLM's images (fastgrpo.models.vlm.PackedVision)
        extra["vision"] = mb.vision
    return model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, **extra)


def no_grad_forward(model):
    """The module to call for no-grad log-prob forwards: the wrapped model itself, except DDP's ``ForwardWrapper``
    inside it (a forward that backward will never follow must not arm DDP's all-reduce).

    Under FSDP2 the call must go through the wrapped model: its forward gathers the sharded weights (the unwrapped
    model would see sharded root weights), so every rank must make it the same number of times.
    """
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def packed_logprobs(model, mb, temperature: float, moe_routing=None) -> torch.Tensor:
    """``[N]`` log-probs of ``mb``'s targets where ``mb.mask`` is nonzero, 0 elsewhere (no grad); ``mb``: a
    :class:`fastgrpo.algorithms.batch.MicroBatch`.

    ``model``: a module whose call is :func:`packed_forward` (a ``ForwardWrapper``, FSDP2-wrapped or not).
    Untrained positions (prompts, masked completions) cost no vocabulary work. ``moe_routing``: as
    :func:`packed_forward`'s (router replay).
    """
    hidden_NH, weight_VH, bias_V = forward_packed(model, mb, moe_routing)
    return masked_linear_logprobs(hidden_NH, weight_VH, mb.targets, mb.mask != 0, bias=bias_V,
                                  temperature=temperature)
