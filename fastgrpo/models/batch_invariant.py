"""``numerics.batch_invariant`` on Hugging Face models: what the mode refuses, and the attention it runs.

The mode's ops are ``fastgrpo.kernels.batch_invariant`` (products, RMSNorm's mean, SiLU, the LM head) and
``fastgrpo.kernels.batch_invariant_attention``; the trainer's packed forward runs the Hugging Face modules on them
(``fastgrpo.algorithms.forward.packed_forward``: the ``fastgrpo_varlen`` attention, ``fastgrpo.models.attention``,
takes :func:`invariant_attention` while a forward runs in the mode), the generation engine the same calls in the
same order without the modules (``fastgrpo.engine.batch_invariant``).

CPU and CUDA alike: the same ops on the model's device (the exact products are cuBLAS DGEMMs on CUDA, exact in any
blocking or split-K; ``fastgrpo.kernels.batch_invariant``), the device's own ``exp`` / ``log`` / GEMM checked where
the mode runs (``invariant_ops(device)``). What breaks invariance, refused at start-up (:func:`check_model`) with the
reason:

- an architecture other than dense Llama / Qwen2 / Qwen3 and the mixture-of-experts Qwen3-MoE / Qwen2-MoE (their
  router and experts: ``fastgrpo.kernels.batch_invariant_moe``, the same functions on both sides), an activation
  other than SiLU, sliding-window layers, attention dropout, a rope whose frequencies depend on the
  sequence length (dynamic, longrope: the engine's growing sequence and the trainer's full one would differ);
- another attention implementation than ``fastgrpo_varlen`` (an SDPA or flash kernel we do not own picks its
  reduction order by shape), an MoE model's experts on another implementation than ``fastgrpo_grouped`` (transformers'
  eager loop adds the experts' outputs into the tokens' rows in expert order, its ``grouped_mm`` by shape), a
  ``torch.compile``d model or submodule, wrapped, compiled in place or with a compiled ``forward`` (inductor fuses and
  reorders the reductions and bypasses the mode's ops), fp64 weights (fp64 products are not exact
  on the grids), activation checkpointing whose recompute runs outside the mode (the model's own: the recompute's
  attention saves other tensors than the forward's, and an MoE router could choose other experts; fastgrpo's,
  ``fastgrpo.models.loading.enable_activation_checkpointing``, recomputes on the invariant ops);
- LoRA dropout (the trainer's forward would not be the sampler's): refused by the config (``model.lora.dropout``)
  and, for an adapter loaded with its own ``lora_dropout`` (``model.lora.path``), by the trainer's check.
"""

from __future__ import annotations

import contextlib

import torch

from fastgrpo.kernels.batch_invariant import checkpoint_contexts, invariant_ops, keep_weight_grids
from fastgrpo.kernels.batch_invariant_attention import varlen_attention
from fastgrpo.models.moe import EXPERTS_IMPLEMENTATION, MOE_MODEL_TYPES, is_moe

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", *MOE_MODEL_TYPES)


def check_model(model: torch.nn.Module, attn_implementation: str | None = None) -> None:
    """Refuse a model the batch-invariant mode cannot make invariant (module docstring); ``attn_implementation``:
    the attention the trainer's forward must use (None: the engine's call, which sets its own attention and runs no
    backward, so neither that nor the experts' implementation and the activation checkpointing are checked)."""
    compiled = next((name or "the model" for name, m in model.named_modules() if _compiled(m)), None)
    if compiled is not None:
        raise ValueError(f"numerics.batch_invariant: {compiled} is torch.compile'd (inductor reorders its reductions "
                         "and bypasses the mode's ops); refused")
    param = next(model.parameters())
    if param.device.type not in ("cpu", "cuda"):
        raise ValueError(f"numerics.batch_invariant: a model on {param.device.type} is not supported (cpu, cuda)")
    if param.dtype == torch.float64:
        raise ValueError("numerics.batch_invariant: fp64 weights are not supported (model.dtype float32 or bfloat16)")
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"numerics.batch_invariant: architecture {config.model_type!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    if getattr(config, "hidden_act", None) != "silu":
        raise ValueError(f"numerics.batch_invariant: activation {config.hidden_act!r} is not supported (silu)")
    if has_sliding_window(config):
        raise ValueError("numerics.batch_invariant: sliding-window attention layers are not supported")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"numerics.batch_invariant: attention_dropout={config.attention_dropout} makes the trainer's "
                         "forward differ from the sampler's; set it to 0")
    rope_type = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or "longrope" in rope_type:
        raise ValueError(f"numerics.batch_invariant: rope type {rope_type!r} depends on the sequence length")
    if attn_implementation is not None and config._attn_implementation != attn_implementation:
        raise ValueError(f"numerics.batch_invariant: the model's attention is {config._attn_implementation!r}, not "
                         f"{attn_implementation!r} (whose batch-invariant path the mode runs)")
    experts = getattr(config, "_experts_implementation", None)
    if attn_implementation is not None and is_moe(config) and experts != EXPERTS_IMPLEMENTATION:
        raise ValueError(f"numerics.batch_invariant: the model's experts are {experts!r}, not "
                         f"{EXPERTS_IMPLEMENTATION!r} (whose batch-invariant path the mode runs)")
    recomputed = [m._gradient_checkpointing_func for m in model.modules() if attn_implementation is not None
                  and getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]
    if any(getattr(f, "keywords", {}).get("context_fn") is not checkpoint_contexts for f in recomputed):
        # outside the mode the recompute saves other tensors than the forward (the backward raises) and an MoE
        # router could choose other experts at a near-tie
        raise ValueError("numerics.batch_invariant: the model's activation checkpointing recomputes outside the mode; "
                         "enable it with fastgrpo.models.loading.enable_activation_checkpointing "
                         "(train.activation_checkpointing), whose recompute runs on the invariant ops")
    dropout = next((name for name, m in model.named_modules() if attn_implementation is not None
                    and any(isinstance(d, torch.nn.Dropout) and d.p > 0
                            for d in getattr(getattr(m, "lora_dropout", None), "values", dict)())), None)
    if dropout is not None:  # a loaded adapter's own config (model.lora.path): the config's check cannot see it
        raise ValueError(f"numerics.batch_invariant: the LoRA layer {dropout} applies dropout in training (the "
                         "trainer's forward would not be the sampler's); use an adapter with lora_dropout 0")


def has_sliding_window(config) -> bool:
    """Whether a model's config gives any layer sliding-window attention (which neither the engine nor the mode runs):
    its ``layer_types`` when it has them (a Qwen2 with ``use_sliding_window`` but ``max_window_layers`` at or past its
    layer count has none), else the flag."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(t != "full_attention" for t in layer_types)
    return bool(getattr(config, "use_sliding_window", False))


def _compiled(m: torch.nn.Module) -> bool:
    """``m`` runs through torch.compile: wrapped (``torch.compile(m)``), compiled in place (``m.compile()``) or its
    ``forward`` replaced by a compiled function."""
    return (isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or getattr(m, "_compiled_call_impl", None)
            is not None or hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable"))


@contextlib.contextmanager
def enable_batch_invariant(model: torch.nn.Module, attn_implementation: str):
    """The trainer's switch: the model checked (:func:`check_model`), then, while the returned context is open, the
    invariant ops registered (``fastgrpo.kernels.batch_invariant.invariant_ops``: the host's self-check runs there;
    the packed forward and the log-prob kernels take them) and the model's weight grids kept
    (``keep_weight_grids``: made once per weight version, shared by the engine's call and the training forwards;
    under FSDP2 the parameters are shards, so none are kept here: the engine keeps the gathered weights' for its call,
    and a training product makes its weight's)."""
    check_model(model, attn_implementation)
    with invariant_ops(next(model.parameters()).device), keep_weight_grids(list(model.parameters())):
        yield


def invariant_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, *, causal: bool = True, softmax_scale: float | None = None) -> torch.Tensor:
    """``varlen_attention``'s signature on the batch-invariant attention
    (:func:`fastgrpo.kernels.batch_invariant_attention.varlen_attention`), causal only."""
    if not causal:
        raise ValueError("numerics.batch_invariant: only causal attention is supported")
    scale = softmax_scale if softmax_scale is not None else q_THD.shape[-1] ** -0.5
    return varlen_attention(q_THD, k_THD, v_THD, cu_seqlens, scale)
