"""Peak memory and time of one training micro-batch with and without ``train.activation_checkpointing``.

Run: ``python bench/bench_activation_checkpointing.py`` (CPU: a ~31M-parameter Qwen2, one packed micro-batch of
4 × 512 tokens; GPU: the 1.5B shape, 8 × 4096 tokens, bf16). One micro-batch = the trainer's packed forward to the
last hidden state, ``fused_linear_grpo_loss`` and backward, in train mode (HF's checkpointing acts only then).
Peak = memory above what was allocated before the call (``common.peak_extra_bytes``: the resident high-water
mark on CPU, the caching allocator's peak on GPU); the gradients (the size of the weights) are included.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import append_rows, median_ms, peak_extra_bytes, print_table
from fastgrpo.kernels import fused_linear_grpo_loss
from transformers import Qwen2Config, Qwen2ForCausalLM

from fastgrpo.algorithms.batch import Sample, pack_microbatches
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.models.attention import enable_packed_attention
from fastgrpo.models.loading import enable_activation_checkpointing

CPU_CONFIG = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
GPU_CONFIG = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=False)


def step(model, mb):
    hidden_NH, weight_VH, bias_V = packed_forward(model, mb.batch.input_ids, mb.batch.position_ids,
                                                  mb.batch.cu_seqlens, mb.batch.max_seqlen)
    loss, _ = fused_linear_grpo_loss(hidden_NH, weight_VH, mb.targets, None, mb.advantages, mb.mask, bias=bias_V,
                                     cu_seqlens=mb.batch.cu_seqlens, per_token_advantages=False)
    loss.backward()
    model.zero_grad(set_to_none=False)  # the gradients stay allocated: every call pays the same
    return loss.detach()


def measure(config: dict, dtype: torch.dtype, device: torch.device, mb, ac: bool) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config)).to(dtype)
    enable_packed_attention(model)
    if ac:
        enable_activation_checkpointing(model)
    model.train()
    step(model, mb)  # gradients allocated, warm
    peak = peak_extra_bytes(lambda: step(model, mb), device)
    ms = median_ms(lambda: step(model, mb), device, warmup=0, rep=1)
    return {"checkpointing": ac, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
            "tokens": mb.batch.input_ids.numel(), "dtype": str(dtype).removeprefix("torch."),
            "peak_MiB": peak / 2**20, "ms": ms, "threads": torch.get_num_threads(), "loadavg_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config, seqs, length = (GPU_CONFIG, 8, 4096) if cuda else (CPU_CONFIG, 4, 512)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, config["vocab_size"], (64,), generator=g).tolist(),
                      torch.randint(0, config["vocab_size"], (length - 64,), generator=g).tolist(),
                      [0.0] * (length - 64), 1.0 - 2.0 * (i % 2)) for i in range(seqs)]
    [mb] = pack_microbatches(samples, seqs * length, device)
    rows = [measure(config, dtype, device, mb, ac) for ac in (False, True)]
    rows[1]["peak_vs_off"] = rows[1]["peak_MiB"] / rows[0]["peak_MiB"]
    print_table(rows, f"one micro-batch, forward + loss + backward, on {device}")
    append_rows("activation_checkpointing", rows, device)


if __name__ == "__main__":
    main()
