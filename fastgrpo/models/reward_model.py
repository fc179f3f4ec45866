"""Reward models: Hugging Face ``AutoModelForSequenceClassification`` with one label, scored by the packed forward.

A reward model is the policy's architecture with a scalar head (``score``: ``[1, H]``, no bias) in place of the LM
head. Its score of a sequence is the head applied to the final hidden state of the sequence's **last token that is
not the padding token** (``config.pad_token_id``; a sequence made only of padding tokens: its first token): exactly
the token Hugging Face's ``*ForSequenceClassification.forward`` pools, which takes the rightmost token different
from ``pad_token_id`` in each padded row. With the tiny model's tokenizer (and TRL's RewardTrainer default) the
padding token is the EOS, so a response that ends with EOS is scored at the token before it, in training and in
Hugging Face's forward alike.

The forward here is padding-free: B sequences packed into one row of N tokens (:mod:`fastgrpo.models.packing`), the
decoder run by :func:`fastgrpo.models.attention.packed_hidden_states`, and the head applied to the B pooled rows only
(``B·H`` multiply-adds, not ``N·H``)::

    hidden_NH = decoder(packed row)          [N, H]
    last_B    = pooled_positions(...)        [B]   indices into the N tokens
    scores_B  = hidden_NH[last_B] @ w_H      [B]   fp32

A checkpoint of this model saved with ``save_pretrained`` (``fastgrpo.models.saving``) holds ``num_labels: 1``,
``pad_token_id`` and ``score.weight``: ``AutoModelForSequenceClassification.from_pretrained(dir)`` loads it as is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastgrpo.config import ModelConfig
from fastgrpo.models.attention import enable_packed_attention, packed_hidden_states
from fastgrpo.models.loading import DTYPES, build_tiny_model, build_tiny_tokenizer
from fastgrpo.models.packing import PackedBatch


def pooled_positions(input_ids_N: torch.Tensor, cu_seqlens: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """``[B]`` int64: in each packed sequence, the index (into the N tokens) of its last token that is not
    ``pad_token_id``, or of its first token when every token is padding (Hugging Face's pooling rule); with
    ``pad_token_id`` None, its last token."""
    lengths_B = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    starts_B = cu_seqlens[:-1].long()  # [B]
    if pad_token_id is None:
        return starts_B + lengths_B - 1
    seq_N = torch.repeat_interleave(torch.arange(len(lengths_B), device=input_ids_N.device), lengths_B)  # [N]
    pos_N = torch.arange(input_ids_N.numel(), device=input_ids_N.device) - starts_B[seq_N]  # [N] position in its seq
    keep_N = torch.where(input_ids_N != pad_token_id, pos_N, 0)  # [N] non-pad tokens keep their position, pads 0
    last_B = torch.zeros_like(starts_B).scatter_reduce(0, seq_N, keep_N, "amax")  # [B]
    return starts_B + last_B


def packed_scores(model, input_ids, position_ids, cu_seqlens, max_seqlen) -> torch.Tensor:
    """The reward model's packed forward (run as the DDP / FSDP2-wrapped model's forward): ``[B]`` fp32 scores of
    the packed sequences (module docstring)."""
    batch = PackedBatch(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    hidden_NH = packed_hidden_states(model, batch)
    last_B = pooled_positions(input_ids, cu_seqlens, model.config.pad_token_id)
    return model.score(hidden_NH[last_B]).squeeze(-1).float()  # [B]


def build_reward_model(cfg: ModelConfig, device: torch.device, *, seed: int = 0):
    """``(model, tokenizer)``: the reward model to train (``algorithm: rm``) in ``cfg.dtype`` on ``device``, the packed
    attention enabled. ``cfg.path == "tiny"``: the built-in tiny model's backbone (the same weights as the tiny policy
    of this seed) with a new head; else ``cfg.path``'s model as ``AutoModelForSequenceClassification`` with one label
    (a causal LM's head is dropped and a score head initialised; a reward model's is kept)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2ForSequenceClassification

    dtype = DTYPES[cfg.dtype]
    if cfg.path == "tiny":
        tokenizer = build_tiny_tokenizer()
        lm = build_tiny_model(cfg, tokenizer, seed=seed)
        config = lm.config
        config.num_labels = 1
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # the head depends only on seed, as the backbone does
            torch.manual_seed(seed + 1)
            model = Qwen2ForSequenceClassification(config)
        model.model.load_state_dict(lm.model.state_dict())
        model = model.to(dtype)
    else:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path {cfg.path!r} has no config.json: not a Hugging Face model directory")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id  # the pooled token's rule, saved in config.json
    enable_packed_attention(model)
    return model.to(device), tokenizer


def load_reward_model(path: str | Path, dtype: str, device: torch.device, *, trust_remote_code: bool = False):
    """``(model, tokenizer)``: a trained reward model (a directory ``AutoModelForSequenceClassification`` loads, with
    one label) in ``dtype``, frozen, in eval mode, the packed attention enabled."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype],
                                                               trust_remote_code=trust_remote_code)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {str(path)!r} has num_labels={model.config.num_labels}: a reward model "
                         "scores with one label")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    enable_packed_attention(model)
    model.requires_grad_(False).eval()
    return model.to(device), tokenizer
