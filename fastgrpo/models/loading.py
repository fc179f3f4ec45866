"""Policy models: any local Hugging Face causal LM, or the built-in tiny model for the demo.

The training forward never runs the LM head as a module: :func:`fastgrpo.models.attention.packed_hidden_states` gives
the final hidden states ``[N, H]`` of a packed batch and :func:`lm_head_params` hands the head's weight ``[V, H]`` (tied
to the embedding or not) and bias to the fused loss kernels.

The built-in tiny model is a Qwen2 architecture built from a config (random weights), with a character-level
tokenizer built locally with ``tokenizers`` (printable ASCII, one token per character) plus ``\\boxed{`` and
Qwen's tool tags as single tokens, wrapped as a ``PreTrainedTokenizerFast`` with eos/pad tokens and a small chat
template, so it saves and loads with ``save_pretrained`` / ``from_pretrained`` like any HF model.

The tiny chat template is Qwen-shaped, so that a tool-calling conversation on the tiny model goes through the
same parser, template suffix and loss mask as on a Qwen model: role markers ``<|system|>``, ``<|user|>``,
``<|assistant|>``, ``<|tool|>``; an assistant turn ends with ``<|endoftext|>`` (the EOS, as Qwen's ``<|im_end|>``
ends its turns); ``tools`` are listed inside ``<tools></tools>`` in the system turn, one signature per line
(``add(a: integer, b: integer)``: Qwen writes each JSON schema whole, ~330 characters for the adder, which would
be three quarters of every tool-tiny sequence and of its training cost); assistant
``tool_calls`` render as Qwen's ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a tool
message as ``<|tool|><tool_response>\\n...\\n</tool_response>``. Without tools and tool messages, a prompt renders
as before (``<|user|>1+2=<|assistant|>``).
"""

from __future__ import annotations

import dataclasses
import os
import string
from pathlib import Path

import torch

from fastgrpo.config import LoRAConfig, ModelConfig
from fastgrpo.distributed import barrier, is_main_process
from fastgrpo.kernels.batch_invariant import checkpoint_contexts
from fastgrpo.models.attention import enable_packed_attention
from fastgrpo.models.lora import adapter_base, apply_lora, is_adapter_dir
from fastgrpo.models.moe import check_moe, enable_moe, freeze_routers, is_moe, tiny_moe_model
from fastgrpo.models.saving import save_model
from fastgrpo.models.vlm import (
    TINY_VLM,
    VLM_MODEL_TYPES,
    add_vision_tokens,
    build_tiny_vlm,
    check_vision_model,
    is_vlm,
    load_processor,
    vision_tower,
)

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
BOXED_TOKEN = "\\boxed{"
TINY_ALPHABET = string.digits + string.ascii_lowercase + " +-*/=?:,.()[]{}\\\n"
# Appended after the ids above, so that those do not move: the tool role,
# Qwen's tool tags as single tokens (Qwen2.5/Qwen3 have them as added tokens too), and the rest of printable ASCII
# (JSON, tool schemas and their descriptions).
TOOL_ROLE_TOKEN = "<|tool|>"
TOOL_TAG_TOKENS = ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TINY_ALPHABET_MORE = "".join(c for c in string.printable if c not in TINY_ALPHABET and c not in "\r\x0b\x0c")
# Multi-turn conversations with a tool block in the system turn run past 256 positions. RoPE has no learned
# table, so the limit costs neither parameters nor time: it only bounds prompt + completion in the engine.
TINY_MAX_POSITIONS = 1024
# The tiny model's chat template (module docstring): every character is a token, so it adds no extra text.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '<tools>' }}{% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{% set ps = f['parameters']['properties'] if f['parameters'] is defined and "
    "f['parameters']['properties'] is defined else {} %}"
    "{{ '\\n' + f['name'] + '(' }}{% for k, v in ps.items() %}"
    "{{ (', ' if not loop.first else '') + k + ': ' + v['type'] }}{% endfor %}{{ ')' }}{% endfor %}"
    "{{ '\\n</tools>' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|system|>' + messages[0]['content'] }}{% endif %}"
    "{% for m in messages %}"
    "{% set content = m['content'] if m['content'] is string else '' %}"
    "{% if m['role'] == 'assistant' %}{{ '<|assistant|>' + content }}"
    "{% for call in m['tool_calls'] or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|endoftext|>' }}"
    "{% elif m['role'] == 'tool' %}{{ '<|tool|><tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{% elif not (m['role'] == 'system' and loop.first) %}{{ '<|' + m['role'] + '|>' + content }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one token per character of ``TINY_ALPHABET`` and
    ``TINY_ALPHABET_MORE``, plus ``<|endoftext|>`` (eos and pad), ``<|unk|>``, the chat role markers, ``\\boxed{``
    and the tool tags (module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS]
    order = [*specials, BOXED_TOKEN, *TINY_ALPHABET, TOOL_ROLE_TOKEN, *TOOL_TAG_TOKENS, *TINY_ALPHABET_MORE]
    vocab = {tok: i for i, tok in enumerate(order)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.add_special_tokens([*specials, TOOL_ROLE_TOKEN])
    tok.add_tokens([BOXED_TOKEN, *TOOL_TAG_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN, chat_template=TINY_CHAT_TEMPLATE)


def build_tiny_model(cfg: ModelConfig, tokenizer, *, seed: int = 0):
    """A randomly initialised Qwen2 causal LM sized by ``cfg.tiny_*`` for ``tokenizer``'s vocabulary (tied head); a
    Qwen3-MoE or Qwen2-MoE one with ``model.moe.tiny_num_experts`` > 0 (:func:`fastgrpo.models.moe.tiny_moe_model`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.tiny_hidden_size,
        intermediate_size=cfg.tiny_intermediate_size,
        num_hidden_layers=cfg.tiny_num_layers,
        num_attention_heads=cfg.tiny_num_heads,
        num_key_value_heads=cfg.tiny_num_kv_heads,
        initializer_range=cfg.tiny_initializer_range,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the model's weights depend only on seed, not on the caller's RNG
        torch.manual_seed(seed)
        model = tiny_moe_model(cfg, common) if cfg.moe.tiny_num_experts else Qwen2ForCausalLM(Qwen2Config(**common))
    return model


def load_model(cfg: ModelConfig, device: torch.device, *, seed: int = 0, base_dir: str | os.PathLike | None = None):
    """``(model, tokenizer)`` on ``device`` in ``cfg.dtype``, with the packed attention enabled.

    ``cfg.path == "tiny"`` builds the built-in model; otherwise ``cfg.path`` must be a local directory holding a
    Hugging Face causal LM and its tokenizer (Qwen2/2.5/3, Llama, ...), or a PEFT adapter (a LoRA checkpoint of
    fastgrpo's): its ``base_model_name_or_path`` is loaded and the adapter applied, as ``model.lora.path``.
    ``cfg.lora``: PEFT LoRA adapters on the frozen base (:func:`fastgrpo.models.lora.apply_lora`); their
    ``base_model_name_or_path`` is ``cfg.path``, or for the tiny model ``base_dir``, where the main process saves
    the base once (HF format, with the tokenizer) when it is not there yet.
    """
    dtype = DTYPES[cfg.dtype]
    lora_cfg = cfg.lora
    if cfg.path != "tiny" and is_adapter_dir(cfg.path):
        lora_cfg = dataclasses.replace(lora_cfg or LoRAConfig(), path=cfg.path)
        cfg = dataclasses.replace(cfg, path=adapter_base(cfg.path), lora=lora_cfg)
    if cfg.path == TINY_VLM:  # the built-in Qwen2.5-VL (fastgrpo.models.vlm)
        tokenizer = add_vision_tokens(build_tiny_tokenizer())
        model = build_tiny_vlm(cfg, tokenizer, seed=seed).to(dtype)
        base_path = TINY_VLM
    elif cfg.path == "tiny":
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(cfg, tokenizer, seed=seed).to(dtype)
        base_path = "tiny"
        if lora_cfg is not None and base_dir is not None:
            base_path = str(Path(base_dir).resolve())
            if is_main_process() and not (Path(base_dir) / "config.json").is_file():
                save_model(model, Path(base_dir), None)
                tokenizer.save_pretrained(base_dir)
            barrier()
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        path = Path(cfg.path)
        if not path.is_dir():
            raise ValueError(f"model.path {cfg.path!r} is not a directory (a local Hugging Face model, or 'tiny')")
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path {cfg.path!r} has no config.json: not a Hugging Face model directory")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        check_vision_model(config)  # a vision-language type we cannot run stops here, by name
        auto = AutoModelForImageTextToText if config.model_type in VLM_MODEL_TYPES else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        base_path = str(path.resolve())
    check_moe(model, dataclasses.replace(cfg, lora=lora_cfg))
    if is_vlm(model):  # the processor renders its prompts; the tower frozen unless model.vision says otherwise
        tokenizer.processor = load_processor(cfg.path, tokenizer, cfg.vision.min_pixels, cfg.vision.max_pixels)
        vision_tower(model).requires_grad_(cfg.vision.train_vision_tower)
    if lora_cfg is not None:
        model = apply_lora(model, lora_cfg, base_path)
    enable_packed_attention(model)
    enable_moe(model)
    if cfg.moe.freeze_router and is_moe(model):
        freeze_routers(model)
    return model.to(device), tokenizer


def enable_activation_checkpointing(model) -> None:
    """Recompute every decoder layer's activations in backward instead of keeping them (HF's per-layer
    checkpointing, non-reentrant ``torch.utils.checkpoint``).

    Saved per layer and token: the layer's input ``[H]`` alone instead of ~all its intermediates (~109 KiB per
    token per layer in bf16 for the 1.5B model, 3 KiB with checkpointing), for one more forward per update.
    It acts only in training mode with gradients enabled (the trainer's updates run under ``model.train()``); the
    checkpoint wraps the layer's ``forward``, so FSDP2's gather hooks stay outside it and the packed attention
    (``fastgrpo_varlen``) is recomputed like any other op. Dropout is 0 in these models, so the recompute is exact.
    With ``numerics.batch_invariant`` the recompute runs on the invariant ops as the forward did
    (``fastgrpo.kernels.batch_invariant.checkpoint_contexts``): the same values, the same saved tensors.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.activation_checkpointing: {type(model).__name__} does not support it")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                        "context_fn": checkpoint_contexts})


def lm_head_params(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's ``weight [V, H]`` (the embedding itself when tied) and ``bias [V]`` or None."""
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's eos and the generation config's eos id(s)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model's generation_config no eos_token_id")
    return sorted(ids)


def set_cpu_threads(num_threads: int, world_size: int) -> int:
    """Set torch's intra-op threads on CPU: ``num_threads``, or (0) the visible cores shared by the processes."""
    if num_threads == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        num_threads = max(1, cores // max(world_size, 1))
    torch.set_num_threads(num_threads)
    return num_threads
