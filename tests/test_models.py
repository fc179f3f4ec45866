"""Models: the tiny tokenizer and model, HF save/load round trip, the packed training forward's log-probs
against unpacked per-sequence Hugging Face forwards, and ``model.lora.use_rslora`` from the config to PEFT's scaling
and the saved adapter."""

import pytest
import torch
from fastgrpo.kernels.reference import linear_logprobs_ref

from fastgrpo.algorithms.batch import Sample, make_microbatch
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.config import ModelConfig
from fastgrpo.models.loading import (
    BOXED_TOKEN,
    EOS_TOKEN,
    ROLE_TOKENS,
    TINY_ALPHABET,
    TINY_MAX_POSITIONS,
    UNK_TOKEN,
    build_tiny_tokenizer,
    eos_token_ids,
    lm_head_params,
    load_model,
)

CPU = torch.device("cpu")


def test_tiny_tokenizer_is_character_level_with_boxed_token(tmp_path):
    tok = build_tiny_tokenizer()
    ids = tok("\\boxed{12}", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.decode(ids) == "\\boxed{12}"
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>1+2=<|assistant|>"
    assert tok.eos_token_id == tok.pad_token_id
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("7+8=")["input_ids"] == tok("7+8=")["input_ids"] and again.chat_template == tok.chat_template


def test_tiny_tokenizer_keeps_the_old_ids_and_covers_printable_ascii():
    """The tokens added for tool calls come after the original ones, which keep their ids; every printable ASCII
    character (JSON, schemas, descriptions) is one known token."""
    tok = build_tiny_tokenizer()
    old = [EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS, BOXED_TOKEN, *TINY_ALPHABET]
    assert tok.convert_tokens_to_ids(old) == list(range(len(old)))
    printable = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    ids = tok(printable, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(printable) and tok.unk_token_id not in ids and tok.decode(ids) == printable


def test_tiny_template_renders_tools_and_tool_turns_in_qwens_shape():
    """A whole tool-calling conversation: the tool schemas in the system turn, the assistant's tool call in Qwen's
    format (tags as single tokens), the tool result as a tool turn, EOS after each assistant turn; every character
    of it is a known token and the text round-trips."""
    tok = build_tiny_tokenizer()
    schema = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "tool", "name": "add", "content": "3"}, {"role": "tool", "name": "add", "content": "3"},
                {"role": "assistant", "content": "\\boxed{3}"}]
    text = tok.apply_chat_template(messages, tools=[schema], tokenize=False)
    one_call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert text == ('<|system|>Use the tool.\n\n<tools>\nadd(a: integer, b: integer)\n</tools><|user|>1+2='
                    '<|assistant|>' + one_call + "\n"
                    + one_call + "<|endoftext|>" + "<|tool|><tool_response>\n3\n</tool_response>" * 2
                    + "<|assistant|>\\boxed{3}<|endoftext|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids[-5:]) == ["<|assistant|>", BOXED_TOKEN, "3", "}", EOS_TOKEN]
    for tag in ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<|tool|>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    assert tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True) == \
        "<|user|>1+2=<|assistant|>"  # without tools, prompts render as before


def test_tiny_model_saves_and_loads_as_a_hf_model(tmp_path):
    model, tok = load_model(ModelConfig(), CPU, seed=3)
    weight, bias = lm_head_params(model)
    assert weight is model.get_input_embeddings().weight and bias is None  # tied head
    assert eos_token_ids(model, tok) == [tok.eos_token_id]
    assert model.config.max_position_embeddings == TINY_MAX_POSITIONS == 1024  # multi-turn conversations
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, _ = load_model(ModelConfig(path=str(tmp_path)), CPU)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    same, _ = load_model(ModelConfig(), CPU, seed=3)
    torch.testing.assert_close(same.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="model.path .* is not a directory"):
        load_model(ModelConfig(path=str(tmp_path / "nope")), CPU)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model.path .* has no config.json"):
        load_model(ModelConfig(path=str(tmp_path / "empty")), CPU)


def test_bfloat16_model():
    model, _ = load_model(ModelConfig(dtype="bfloat16"), CPU)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_packed_forward_logprobs_equal_unpacked_forwards():
    model, _ = load_model(ModelConfig(), CPU, seed=1)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(5, 60, (p,), generator=g).tolist(),
                      torch.randint(5, 60, (c,), generator=g).tolist(), [0.0] * c, 0.0)
               for p, c in [(3, 4), (1, 1), (9, 2), (5, 7)]]
    mb = make_microbatch(samples, CPU)
    b = mb.batch
    with torch.no_grad():
        hidden, weight, bias = packed_forward(model, b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)
        packed = linear_logprobs_ref(hidden, weight, mb.targets)  # [N]
        for s, lp in zip(samples, b.unpack(packed)):
            logits = model(torch.tensor([s.tokens])).logits[0].float()  # [L, V]
            alone = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
            torch.testing.assert_close(lp[:-1], alone, rtol=1e-5, atol=1e-6)  # fp32, summation order only


def test_rslora_set_in_the_config_reaches_peft_and_the_saved_adapter(tmp_path):
    """``model.lora.use_rslora=true`` with r=4, alpha=8: every adapted projection scales its update by
    alpha / sqrt(r) = 4.0 (vanilla LoRA: alpha / r = 2.0), in the forward too; the checkpoint's adapter_config.json
    says use_rslora, and the adapter loaded back from it scales the same."""
    import json

    from peft.tuners.lora import LoraLayer

    from fastgrpo.checkpoint import save_checkpoint
    from fastgrpo.config import LORA_TARGETS, load_config

    cfg = load_config(overrides=["model.lora.use_rslora=true", "model.lora.r=4", "model.lora.alpha=8"]).model
    model, tok = load_model(cfg, CPU, base_dir=tmp_path / "base")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == cfg.tiny_num_layers * len(LORA_TARGETS)
    assert all(m.scaling == {"default": 4.0} for m in layers)
    proj = layers[0]
    with torch.no_grad():
        proj.lora_B["default"].weight.normal_()  # B = 0 at the start: give the update a value
        x = torch.randn(3, proj.in_features)
        base = torch.nn.functional.linear(x, proj.base_layer.weight, proj.base_layer.bias)
        update = x @ proj.lora_A["default"].weight.T @ proj.lora_B["default"].weight.T
        # fp32 rounding of outputs up to ~13 (fp32 ulp there ~1e-6; measured 5e-7); a scale of 2.0 is off by ~6
        torch.testing.assert_close(proj(x), base + 4.0 * update, rtol=0, atol=1e-5)
    path = save_checkpoint(tmp_path / "run", 1, model=model, tokenizer=tok)
    saved = json.loads((path / "adapter_config.json").read_text())
    assert (saved["use_rslora"], saved["r"], saved["lora_alpha"]) == (True, 4, 8)
    again, _ = load_model(ModelConfig(path=str(path)), CPU)
    assert all(m.scaling == {"default": 4.0} for m in again.modules() if isinstance(m, LoraLayer))
