"""Vision-language policies (Qwen2.5-VL): which models run, their pieces, the built-in tiny one, the processor, and
the packed training forward with images.

A Qwen2.5-VL model is ``model.model.visual`` (the vision tower: patches of 14 px, 2 x 2 patches merged into one
token of the language model's width) and ``model.model.language_model`` (a Qwen2 decoder whose rotary embedding
takes 3-D positions, M-RoPE) under one LM head. A prompt's image becomes ``t · h · w / merge²`` image tokens
(``<|image_pad|>``) in the token ids; the tower's output replaces their embeddings. Positions
(``get_rope_index``): text tokens advance all three position streams (temporal, height, width) together; the tokens
of an image take ``(start, start + row, start + column)`` and the text after it resumes at ``start + max(h, w) /
merge``, so a sequence's largest position is below its length: ``rope_delta = max position + 1 - length`` (<= 0),
and a token generated at cache index ``i`` sits at position ``i + rope_delta`` in all three streams (HF's
``rope_deltas``). Each rotary frequency band reads one stream (``mrope_section``: [16, 24, 24] of the 64 for the 3B).

Memory at the real scale (Qwen2.5-VL-3B, bf16): a 480 x 320 CLEVR image is 34 x 22 patches of 14 px (after the
processor's resize to multiples of 28), 748 patches, 187 image tokens; its ``pixel_values`` are 748 x 1176 fp32 (3.4
MiB) and its embeddings 187 x 2048 bf16 (0.7 MiB), next to 36 KiB of K/V per token (36 layers x 2 x 2 kv heads x 128
x 2 B): 6.6 MiB of K/V for the image's tokens. The tower is 0.67B parameters (1.3 GiB in bf16), frozen by default.

Only the model types in ``VLM_MODEL_TYPES`` run; any other model with a ``vision_config`` is refused at load with
its name (:func:`check_vision_model`).
"""

from __future__ import annotations

import torch

VLM_MODEL_TYPES = ("qwen2_5_vl",)
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
TINY_VLM = "tiny-vlm"  # model.path of the built-in tiny vision-language model
# the built-in tiny model's image side: images are resized by the processor to multiples of patch x merge = 28 px
TINY_PATCH, TINY_MERGE = 14, 2
# The tiny chat template of fastgrpo.models.loading, with image parts: an {"type": "image"} part renders as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands <|image_pad|> to the image's tokens), a text part
# as its text, a string content as itself.
TINY_VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def is_vlm(model) -> bool:
    """Whether ``model`` (unwrapped, PEFT's base model included) is a vision-language model this package runs."""
    return getattr(getattr(model, "config", None), "model_type", None) in VLM_MODEL_TYPES


def check_vision_model(config) -> None:
    """Refuse a vision-language model type that is not in ``VLM_MODEL_TYPES``, by name."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is not None and model_type not in VLM_MODEL_TYPES:
        raise ValueError(f"model: vision-language model type {model_type!r} is not supported (supported: "
                         f"{', '.join(VLM_MODEL_TYPES)})")


def text_config(model):
    """The language model's config (a VLM's ``text_config``; a causal LM's own config)."""
    config = model.config
    return config.text_config if is_vlm(model) else config


def text_decoder(model):
    """The decoder whose layers, embedding, final norm and rotary embedding the engine reads: ``model.model`` of a
    causal LM, ``model.model.language_model`` of a VLM."""
    return model.model.language_model if is_vlm(model) else model.model


def vision_tower(model):
    """A VLM's vision tower (``model.model.visual``)."""
    return model.model.visual


def image_token_id(model) -> int:
    return int(model.config.image_token_id)


def image_tokens(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Image tokens per image of ``grid_thw [I, 3]`` (patches t · h · w over merge²)."""
    return (grid_thw.prod(-1) // (merge * merge)).tolist()


def image_embeddings(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The vision tower on one batch of images: ``[tokens, H]`` (every image's merged tokens, in order), in the
    language model's dtype. ``pixel_values [patches, C · T · P · P]`` and ``grid_thw [I, 3]`` as the processor makes
    them. Cost: the tower's blocks over every patch (window attention in most blocks, full attention per image in
    ``fullatt_block_indexes``)."""
    out = model.model.get_image_features(pixel_values, grid_thw)
    return torch.cat(out.pooler_output, dim=0).to(text_decoder(model).embed_tokens.weight.dtype)  # [tokens, H]


def rope_positions(model, input_ids: list[int], grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ``[3, L]`` (int64, CPU) of one sequence and its ``rope_delta`` (max position + 1 - L), by the
    model's own ``get_rope_index`` (module docstring); text only: ``arange(L)`` three times and 0."""
    ids = torch.tensor([input_ids])  # [1, L]
    if grid_thw is None or grid_thw.numel() == 0:
        return torch.arange(len(input_ids)).expand(3, -1).clone(), 0
    types = (ids == image_token_id(model)).long()  # [1, L]: 1 at image tokens (mm_token_type_ids)
    pos, delta = model.model.get_rope_index(ids, types, image_grid_thw=grid_thw.cpu())
    return pos[:, 0], int(delta.item())  # [3, L]


# ---------------------------------------------------------------------------------------------- the tiny model


def build_tiny_vlm_tokenizer():
    """The tiny character-level tokenizer (``fastgrpo.models.loading``) with Qwen2.5-VL's vision tokens added and a
    chat template that renders image parts (``TINY_VLM_CHAT_TEMPLATE``)."""
    from fastgrpo.models.loading import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    tok.chat_template = TINY_VLM_CHAT_TEMPLATE
    return tok


def tiny_vlm_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 256, initializer_range: float = 0.02,
                    vision_hidden_size: int = 32, vision_depth: int = 2, max_positions: int = 1024):
    """A small Qwen2.5-VL config for ``tokenizer``'s vocabulary: a vision tower of ``vision_depth`` blocks of width
    ``vision_hidden_size`` (patches of 14 px, 2 x 2 merged, the last block with full attention, the others within
    112-px windows), M-RoPE sections in the 3B's proportions (1/4, 3/8, 3/8 of the frequencies)."""
    from transformers import Qwen2_5_VLConfig

    half = hidden_size // num_heads // 2
    sections = [half // 4, 3 * half // 8]
    sections.append(half - sum(sections))
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_positions, initializer_range=initializer_range,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
            num_heads=2, out_hidden_size=hidden_size, patch_size=TINY_PATCH, spatial_merge_size=TINY_MERGE,
            temporal_patch_size=2, window_size=112, fullatt_block_indexes=[vision_depth - 1],
            initializer_range=initializer_range,
        ),
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD), vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END), tie_word_embeddings=True,
    )  # fmt: skip


def build_tiny_vlm(cfg, tokenizer, *, seed: int = 0):
    """A randomly initialised Qwen2.5-VL sized by ``cfg.tiny_*`` (a ``ModelConfig``; the vision tower by
    :func:`tiny_vlm_config`'s defaults), its weights a function of ``seed`` alone."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = tiny_vlm_config(
        tokenizer, hidden_size=cfg.tiny_hidden_size, num_layers=cfg.tiny_num_layers, num_heads=cfg.tiny_num_heads,
        num_kv_heads=cfg.tiny_num_kv_heads, intermediate_size=cfg.tiny_intermediate_size,
        initializer_range=cfg.tiny_initializer_range,
    )  # fmt: skip
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return Qwen2_5_VLForConditionalGeneration(config)


# ---------------------------------------------------------------------------------------------- the processor


def image_text_processor(image_processor, tokenizer):
    """A Qwen2.5-VL processor of images and text (no video: its processor needs torchvision): ``proc(text=,
    images=)`` expands each ``<|image_pad|>`` to the image's tokens and returns ``input_ids``, ``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``, as ``AutoProcessor`` loads it for a checkpoint."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageTextProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def tiny_image_processor(min_pixels: int, max_pixels: int):
    """Qwen2-VL's image processor (its PIL backend) for the tiny model: patches of 14 px, 2 x 2 merged; images
    resized (aspect kept) to multiples of 28 px with ``min_pixels <= h · w <= max_pixels``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=TINY_PATCH,
                                    merge_size=TINY_MERGE, temporal_patch_size=2)


def load_processor(path: str, tokenizer, min_pixels: int, max_pixels: int):
    """The processor of the model at ``path`` (``"tiny-vlm"``: Qwen2-VL's image processor and the tiny tokenizer):
    ``AutoProcessor`` where it loads (torchvision installed), else the checkpoint's image processor with
    :func:`image_text_processor`; ``min_pixels`` / ``max_pixels`` bound every image's resize."""
    if path == TINY_VLM:
        return image_text_processor(tiny_image_processor(min_pixels, max_pixels), tokenizer)
    from transformers import AutoImageProcessor, AutoProcessor

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    try:
        return AutoProcessor.from_pretrained(path, size=size)
    except (ImportError, ValueError, AttributeError):  # the video processor needs torchvision
        return image_text_processor(AutoImageProcessor.from_pretrained(path, size=size, backend="pil"), tokenizer)
