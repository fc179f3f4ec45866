"""The packed HF forward (``fastgrpo_varlen``) against each sequence run alone: hidden states, logits, gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fastgrpo.models.attention import (
    ATTN_IMPLEMENTATION,
    enable_packed_attention,
    fastgrpo_varlen_attention_forward,
    packed_hidden_states,
)
from fastgrpo.models.packing import pack

VOCAB = 97
LENGTHS = [5, 1, 23, 17, 5]  # mixed, with a length-1 sequence and two of equal length


def _config(arch):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)


def _model(arch, attn=ATTN_IMPLEMENTATION):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(arch), attn_implementation=attn, dtype=torch.float32)


def _sequences():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_forward_matches_per_sequence(arch):
    seqs = _sequences()
    batch = pack(seqs)
    g = torch.Generator().manual_seed(2)
    upstream_NV = torch.randn(batch.num_tokens, VOCAB, generator=g)

    model = _model(arch)
    hidden_NH = packed_hidden_states(model, batch)
    logits_NV = model.get_output_embeddings()(hidden_NH)
    (logits_NV * upstream_NV).sum().backward()
    packed_grads = _grads(model)

    ref = _model(arch, attn="sdpa")  # same seed → same weights; each sequence alone, no packing
    ref_hidden, ref_logits = [], []
    for s, up in zip(seqs, batch.unpack(upstream_NV)):
        out = ref(input_ids=s[None], output_hidden_states=True)
        (out.logits[0] * up).sum().backward()
        ref_hidden.append(out.hidden_states[-1][0])
        ref_logits.append(out.logits[0])
    ref_grads = _grads(ref)

    torch.testing.assert_close(hidden_NH, torch.cat(ref_hidden), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits_NV, torch.cat(ref_logits), atol=2e-5, rtol=1e-4)
    assert packed_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


def test_packed_forward_with_activation_checkpointing():
    batch = pack(_sequences())
    model = _model("llama")
    model.train()
    hidden = packed_hidden_states(model, batch)
    hidden.square().sum().backward()
    plain = _grads(model)
    model.zero_grad()
    model.activation_checkpointing_enable()
    torch.testing.assert_close(packed_hidden_states(model, batch), hidden, atol=0, rtol=0)
    packed_hidden_states(model, batch).square().sum().backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_packed_positions_without_offsets_and_row_batches():
    """Without cu_seq_lens the offsets come from position_ids; unpacked rows are one sequence each."""
    seqs = _sequences()
    batch = pack(seqs)
    model = _model("qwen2")
    ref = packed_hidden_states(model, batch)
    with torch.no_grad():
        from_positions = model.get_decoder()(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None])
        rows = model.get_decoder()(input_ids=torch.stack([seqs[0], seqs[4]]))
        alone = model.get_decoder()(input_ids=seqs[4][None])
    torch.testing.assert_close(from_positions.last_hidden_state[0], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows.last_hidden_state[1], alone.last_hidden_state[0], atol=1e-5, rtol=1e-5)


def test_generation_with_padding_and_cache_matches_sdpa():
    """Padded, cached generation falls back to SDPA with its mask: same tokens as the sdpa model."""
    model, ref = _model("llama"), _model("llama", attn="sdpa")
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_enable_packed_attention_switches_implementation():
    model = _model("qwen2", attn="sdpa")
    enable_packed_attention(model)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_attention_function_rejects_unsupported_options():
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="dropout"):
        fastgrpo_varlen_attention_forward(module, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        fastgrpo_varlen_attention_forward(module, q, kv, kv, None, sliding_window=2)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        fastgrpo_varlen_attention_forward(module, q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())
    with pytest.raises(ValueError, match="one row"):
        fastgrpo_varlen_attention_forward(module, q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1),
                                          kv.expand(2, -1, -1, -1), None, cu_seq_lens_q=cu)


@pytest.mark.gpu
def test_packed_forward_on_gpu_uses_the_kernel():
    """On CUDA the packed forward runs the Triton kernel; it must still match the per-sequence SDPA forwards."""
    seqs = [s.cuda() for s in _sequences()]
    batch = pack(seqs)
    model, ref = _model("qwen2").cuda(), _model("qwen2", attn="sdpa").cuda()
    with torch.no_grad():
        hidden_NH = packed_hidden_states(model, batch)
        alone = torch.cat([ref.get_decoder()(input_ids=s[None]).last_hidden_state[0] for s in seqs])
    torch.testing.assert_close(hidden_NH, alone, atol=1e-4, rtol=1e-4)
