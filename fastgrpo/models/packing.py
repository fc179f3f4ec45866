"""Pack variable-length sequences into one row with ``cu_seqlens``; plan token-budget micro-batches.

A packed batch of B sequences with lengths ``L_0 … L_{B-1}`` is one row of ``N = Σ_b L_b`` tokens::

    input_ids     [N]      the sequences concatenated, no padding anywhere
    position_ids  [N]      0, 1, …, L_b − 1 within each sequence (RoPE positions restart per sequence)
    cu_seqlens    [B + 1]  int32 offsets: sequence b occupies tokens [cu_seqlens[b], cu_seqlens[b + 1])
    max_seqlen             max_b L_b (the attention kernel sizes its grid with it)

This is the layout of FlashAttention's varlen API and of transformers' flash-attention keyword arguments
(``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k``); :mod:`fastgrpo.models.attention` feeds it to
Hugging Face models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """B sequences packed into one row of N tokens (see the module docstring for the layout)."""

    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64, restarting at 0 in every sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        """N, the number of packed tokens."""
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences."""
        return self.cu_seqlens.numel() - 1

    @property
    def lengths(self) -> list[int]:
        """``[L_0, …, L_{B-1}]`` as Python ints (reads ``cu_seqlens`` back to the host)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor on ``device``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
        )

    def unpack(self, x_N: torch.Tensor) -> list[torch.Tensor]:
        """Split a packed per-token tensor ``[N, ...]`` back into the B sequences ``[L_b, ...]``."""
        if x_N.shape[0] != self.num_tokens:
            raise ValueError(f"x_N has {x_N.shape[0]} rows, expected the {self.num_tokens} packed tokens")
        return list(torch.split(x_N, self.lengths, dim=0))


def pack(sequences: Sequence[Sequence[int]] | Sequence[torch.Tensor]) -> PackedBatch:
    """Concatenate token sequences (lists of ints or 1-D integer tensors) into a :class:`PackedBatch`.

    Every sequence must hold at least one token. Tensors are packed on the device of the first one; lists on
    the CPU.
    """
    if len(sequences) == 0:
        raise ValueError("sequences is empty: pack needs at least one sequence")
    tensors = []
    for i, s in enumerate(sequences):
        t = s if isinstance(s, torch.Tensor) else torch.as_tensor(list(s), dtype=torch.long, device="cpu")
        if t.dim() != 1:
            raise ValueError(f"sequences[{i}] must be 1-D, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"sequences[{i}] is empty: every packed sequence needs at least one token")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"sequences[{i}] must hold integer token ids, got {t.dtype}")
        tensors.append(t)
    device = tensors[0].device
    lengths = [t.numel() for t in tensors]
    input_ids = torch.cat([t.to(device=device, dtype=torch.long) for t in tensors])  # [N]
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])  # [N]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)  # [B + 1]
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=device), 0)
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max(lengths))


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens`` tokens each.

    First-fit decreasing: sequences are taken longest first (ties by index) and each goes into the first
    micro-batch that still has room, else opens a new one. Deterministic; indices inside a micro-batch are
    sorted ascending, and micro-batches are ordered by their smallest index. Every index appears exactly once.
    Raises ``ValueError`` naming ``max_tokens`` when one sequence alone is longer than the budget.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"lengths[{i}] is negative ({n})")
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens, more than max_tokens={max_tokens}: raise max_tokens "
                             f"(train.max_tokens_per_microbatch) or shorten the sequences")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
