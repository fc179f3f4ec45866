"""The ``fastgrpo_varlen`` attention implementation for Hugging Face models, and the packed training forward.

Importing this module registers ``"fastgrpo_varlen"`` with transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (the mask builder), so ``from_pretrained(..., attn_implementation=
"fastgrpo_varlen")``, ``model.set_attn_implementation("fastgrpo_varlen")`` or :func:`enable_packed_attention`
selects it.

A packed forward is one row of N tokens holding B sequences: per-sequence ``position_ids`` (RoPE restarts at 0)
and ``cu_seqlens`` passed as transformers' flash-attention keyword arguments (``cu_seq_lens_q``,
``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``). Every attention layer then runs
:func:`fastgrpo.kernels.varlen_attention.varlen_attention` on ``[N, H, D]`` — no mask, no padding — so each
sequence sees only itself and the result equals running every sequence alone. CUDA tensors go through the Triton
kernel; CPU tensors through its per-sequence SDPA path (also under ``TRITON_INTERPRET=1``, which is for the
kernel's own tests). :func:`packed_hidden_states`
does all of this for a :class:`~fastgrpo.models.packing.PackedBatch`.

Calls that are not packed training forwards still work: without ``cu_seq_lens_*`` the offsets come from
``position_ids`` (a new sequence wherever the position restarts at 0) or, failing that, every batch row is one
sequence; with a padding mask or a KV cache (generation, query length ≠ key length) the layer falls back to
transformers' SDPA with the mask that ``sdpa_mask`` builds.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from fastgrpo.kernels import batch_invariant
from fastgrpo.kernels.varlen_attention import varlen_attention_torch, varlen_attention_unchecked
from fastgrpo.models.batch_invariant import invariant_attention
from fastgrpo.models.packing import PackedBatch

ATTN_IMPLEMENTATION = "fastgrpo_varlen"


def _varlen_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, **kwargs):
    """No mask for full-length forwards (the offsets carry the structure); SDPA's mask for padding or a cache."""
    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


def _offsets_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` [B' + 1] int32 and the longest length from ``[B, S]`` positions (new sequence at each 0)."""
    starts_BS = position_ids == 0  # [B, S]
    starts_BS[:, 0] = True  # every batch row starts a sequence
    starts = torch.nonzero(starts_BS.flatten()).flatten()  # [B'] token offsets, one host sync (fallback path)
    total = position_ids.numel()
    cu = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)  # [B' + 1]
    return cu, int((cu[1:] - cu[:-1]).max())


def fastgrpo_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, S, D]
    key: torch.Tensor,  # [B, Hkv, S, D]
    value: torch.Tensor,  # [B, Hkv, S, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    max_length_k: int | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``[B, H, S, D]`` in, ``[B, S, Hq, D]`` out (like the flash-attention one)."""
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if dropout != 0.0:
        raise ValueError(f"{ATTN_IMPLEMENTATION} has no attention dropout; got dropout={dropout} (set the config's "
                         "attention_dropout to 0)")
    if sliding_window is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} has no sliding-window attention; got sliding_window={sliding_window}")
    B, Hq, S, D = query.shape
    if cu_seq_lens_q is not None:
        if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
            raise ValueError("cu_seq_lens_k must be the same tensor as cu_seq_lens_q (self-attention over one row)")
        if B != 1:
            raise ValueError(f"a packed forward is one row; got batch size {B} with cu_seq_lens_q")
        cu_seqlens = cu_seq_lens_q.to(torch.int32)
        max_seqlen = int(max_length_q) if max_length_q is not None else S
    elif position_ids is not None:
        cu_seqlens, max_seqlen = _offsets_from_positions(position_ids.expand(B, S))
    else:
        cu_seqlens = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=query.device)  # [B + 1]
        max_seqlen = S
    q = query.transpose(1, 2).reshape(B * S, Hq, D)  # [N, Hq, D]
    k = key.transpose(1, 2).reshape(B * S, key.shape[1], D)  # [N, Hkv, D]
    v = value.transpose(1, 2).reshape(B * S, value.shape[1], D)  # [N, Hkv, D]
    causal = getattr(module, "is_causal", True)
    attend = varlen_attention_unchecked if query.is_cuda else varlen_attention_torch  # CPU: torch path, see there
    if batch_invariant.active():  # numerics.batch_invariant: the attention the engine runs too
        attend = invariant_attention
    out = attend(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scaling)
    return out.view(B, S, Hq, D), None


AttentionInterface.register(ATTN_IMPLEMENTATION, fastgrpo_varlen_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _varlen_mask)


def enable_packed_attention(model) -> None:
    """Switch a loaded Hugging Face model (and its sub-models) to the ``fastgrpo_varlen`` attention."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def packed_hidden_states(model, batch: PackedBatch, moe_routing=None) -> torch.Tensor:
    """Final hidden states ``[N, H]`` of a packed batch (after the final norm; the LM head is never run).

    Runs the base model (``model.get_decoder()``) on one row ``[1, N]`` with the batch's per-sequence positions
    and ``cu_seqlens``. With the ``fastgrpo_varlen`` attention every sequence attends only to itself, so the
    result equals the per-sequence forwards (up to float rounding). Other implementations get the same inputs:
    flash-attention reads the offsets, SDPA/eager build a block-diagonal mask from the positions (N² memory).

    Under DDP or FSDP, call this inside the forward of the wrapped module (a small ``nn.Module`` holding the
    model), not on the unwrapped model: the wrapper's forward hooks must run. Activation checkpointing
    (``model.activation_checkpointing_enable()``) works unchanged. ``moe_routing``: a mixture-of-experts model's
    :class:`fastgrpo.models.moe.MoERouting` (router replay, the router logits of the load-balancing loss), passed to
    the layers as a keyword.
    """
    decoder = model.get_decoder()
    cu = batch.cu_seqlens
    extra = {} if moe_routing is None else {"moe_routing": moe_routing}
    out = decoder(
        input_ids=batch.input_ids.unsqueeze(0),  # [1, N]
        position_ids=batch.position_ids.unsqueeze(0),  # [1, N]
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        use_cache=False,
        **extra,
    )
    return out.last_hidden_state[0]  # [N, H]
