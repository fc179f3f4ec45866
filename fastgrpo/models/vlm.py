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

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ImageInputs:
    """One prompt's images as the processor makes them (:func:`load_processor`)."""

    pixel_values: torch.Tensor  # [patches, C · T · P · P]
    grid_thw: torch.Tensor  # [I, 3] int64: each image's patch grid (temporal, height, width)


class ImagePrompt(list):
    """A prompt's token ids (a ``list[int]``, its image tokens expanded) that knows its images: the data layer makes
    them (``fastgrpo.data.images``), the engine reads their images when ``generate`` is given none, and a packed
    micro-batch its images and M-RoPE positions (:func:`pack_vision`). Concatenation keeps them (``prompt +
    completion`` is the sequence a packed forward trains on, still with its images).

    ``make_images()`` builds the :class:`ImageInputs` (the processor on the row's images) when asked, so a dataset
    holds token ids and image sources, never every row's pixels; ``key`` identifies the images (samples of one
    prompt share them: their tower output is computed once per micro-batch)."""

    def __init__(self, ids, make_images: Callable[[], ImageInputs], grid_thw: torch.Tensor, image_id: int,
                 merge: int, key=None, prompt_len: int | None = None):
        super().__init__(ids)
        self.make_images, self.grid_thw, self.image_id, self.merge = make_images, grid_thw, image_id, merge
        self.key = key if key is not None else id(self)
        self.prompt_len = len(self) if prompt_len is None else min(prompt_len, len(self))
        """The tokens of the prompt: its image tokens are images; any later one (sampled) is text."""

    def _like(self, ids) -> ImagePrompt:
        return ImagePrompt(ids, self.make_images, self.grid_thw, self.image_id, self.merge, self.key,
                           self.prompt_len)

    @property
    def images(self) -> ImageInputs:
        return self.make_images()

    def __getitem__(self, index):  # a prefix keeps the images (the prompt part of a sequence): [:n]
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            return self._like(list.__getitem__(self, index))
        return list.__getitem__(self, index)

    def __add__(self, other):
        return self._like(list(self) + list(other))

    def __reduce__(self):  # pickled (a group sent between ranks) as the plain ids with the same fields
        return ImagePrompt, (list(self), self.make_images, self.grid_thw, self.image_id, self.merge, self.key,
                             self.prompt_len)

    def image_rows(self) -> torch.Tensor:
        """Indices of the prompt's image tokens (int64)."""
        return torch.nonzero(torch.tensor(list(self[: self.prompt_len])) == self.image_id).flatten()

    def rope_positions(self) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, len]`` and ``rope_delta`` (:func:`mrope_positions`)."""
        return mrope_positions(list(self), self.grid_thw, self.image_id, self.merge, self.prompt_len)


def mrope_positions(ids: list[int], grid_thw: torch.Tensor, image_id: int, merge: int,
                    prompt_len: int | None = None) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL's 3-D positions of one sequence (module docstring), written from its rule: a run of text advances
    all three streams by one per token; image ``i``'s ``h' · w'`` tokens (``h' = h / merge``, ``w' = w / merge``,
    row-major) at ``(s, s + row, s + col)`` from the current position ``s``, after which text resumes at
    ``s + max(h', w')``. Image tokens past ``prompt_len`` (sampled ones) are text. Returns ``positions [3, L]``
    (int64) and ``rope_delta = max + 1 - L``."""
    L = len(ids)
    P = L if prompt_len is None else prompt_len
    out = torch.empty(3, L, dtype=torch.long)
    grids = iter(grid_thw.tolist())
    cur, t = 0, 0
    while t < L:
        if ids[t] != image_id or t >= P:
            out[:, t] = cur
            cur, t = cur + 1, t + 1
            continue
        _, h, w = (g // m for g, m in zip(next(grids), (1, merge, merge)))
        rows = torch.arange(h).repeat_interleave(w)  # [h' · w']
        cols = torch.arange(w).repeat(h)
        out[0, t : t + h * w] = cur
        out[1, t : t + h * w] = cur + rows
        out[2, t : t + h * w] = cur + cols
        cur, t = cur + max(h, w), t + h * w
    return out, int(out.max()) + 1 - L if L else 0


@dataclass
class PackedVision:
    """The images of a packed micro-batch's sequences: each distinct prompt's images once, and where their tokens go.

    ``position_ids [3, N]``: M-RoPE positions per token (text-only sequences: their 1-D positions three times).
    ``embeds``: the output of ``tower`` per distinct image set, ``[tokens_k, H]`` each, kept after the first forward
    when that tower is frozen, so the old-policy and policy passes of one step run it once, and the reference pass too
    with LoRA (the policy with its adapters disabled: the same tower, which LoRA never adapts). Exact: the same frozen
    module and inputs. Another model's tower (a reference copy, a teacher), or a trainable one, computes its own."""

    pixel_values: list[torch.Tensor]  # per distinct image set [patches_k, C · T · P · P]
    grid_thw: list[torch.Tensor]  # per distinct image set [I_k, 3]
    owner: list[int]  # per sequence: its image set's index, -1 for a text-only one
    image_rows: torch.Tensor  # [n] int64: the packed rows of the image tokens, in order
    position_ids: torch.Tensor  # [3, N] int64
    embeds: list[torch.Tensor] | None = None
    tower: torch.nn.Module | None = None  # the frozen tower whose output ``embeds`` holds

    def to(self, device) -> PackedVision:
        return PackedVision([p.to(device) for p in self.pixel_values], [g.to(device) for g in self.grid_thw],
                            self.owner, self.image_rows.to(device), self.position_ids.to(device))


def pack_vision(sequences: list) -> PackedVision | None:
    """The :class:`PackedVision` of packed ``sequences`` (token lists, some :class:`ImagePrompt`), or None when none
    has images. Each distinct image set (``ImagePrompt.key``) is processed once."""
    if not any(isinstance(s, ImagePrompt) for s in sequences):
        return None
    keys: dict = {}
    pixels, grids, owner, rows, positions, start = [], [], [], [], [], 0
    for s in sequences:
        if isinstance(s, ImagePrompt) and s.grid_thw.numel():
            if s.key not in keys:
                keys[s.key] = len(pixels)
                im = s.images
                pixels.append(im.pixel_values)
                grids.append(im.grid_thw)
            owner.append(keys[s.key])
            pos_3L, _ = s.rope_positions()
            rows.append(s.image_rows() + start)
        else:
            owner.append(-1)
            pos_3L = torch.arange(len(s)).expand(3, -1)
        positions.append(pos_3L)
        start += len(s)
    rows_n = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    return PackedVision(pixels, grids, owner, rows_n, torch.cat(positions, dim=1))


def frozen_tower(model) -> bool:
    """Whether the vision tower trains (``vision.train_vision_tower``) or not (the default: frozen)."""
    return not any(p.requires_grad for p in vision_tower(model).parameters())


def packed_vlm_hidden_states(model, input_ids_N: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                             vision: PackedVision) -> torch.Tensor:
    """Final hidden states ``[N, H]`` of a packed VLM micro-batch: the token embeddings with the image tokens' rows
    from the vision tower (once per distinct image set; without gradient when the tower is frozen, and then kept in
    ``vision.embeds`` for the step's other passes through the same tower), then the language model on one row with
    the 3-D positions ``[3, 1, N]`` and ``cu_seqlens`` through the ``fastgrpo_varlen`` attention (each sequence
    attends to itself)."""
    lm, tower = text_decoder(model), vision_tower(model)
    frozen = frozen_tower(model)
    embeds = vision.embeds if frozen and vision.tower is tower else None
    if embeds is None:
        with torch.no_grad() if frozen else torch.enable_grad():
            embeds = [image_embeddings(model, p, g) for p, g in zip(vision.pixel_values, vision.grid_thw)]
        if frozen:
            vision.embeds, vision.tower = embeds, tower
    x_NH = lm.embed_tokens(input_ids_N)
    parts = [embeds[k] for k in vision.owner if k >= 0]
    if parts:
        x_NH = x_NH.index_put((vision.image_rows,), torch.cat(parts).to(x_NH.dtype))
    elif not frozen:  # a trainable tower this micro-batch does not run still gets a (zero) gradient: every rank then
        # reduces the same parameters' gradients (DDP's buckets, FSDP2's reduce-scatter of the root's group)
        x_NH = x_NH + 0.0 * sum(p.sum() for p in tower.parameters())
    out = lm(inputs_embeds=x_NH[None], position_ids=vision.position_ids[:, None], cu_seq_lens_q=cu_seqlens,
             cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen, use_cache=False)
    return out.last_hidden_state[0]  # [N, H]


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


def data_dependent_module(model):
    """The module ``fastgrpo.distributed.wrap_model`` keeps whole (``whole=``): a VLM's vision tower, run once per
    distinct image set of a micro-batch (a count that differs between ranks); None for a causal LM."""
    return vision_tower(model) if is_vlm(model) else None


def tower_prefix(model) -> str | None:
    """The vision tower's module name in ``model`` (``"model.visual"``), None for a causal LM."""
    if not is_vlm(model):
        return None
    tower = vision_tower(model)
    return next(n for n, m in model.named_modules() if m is tower)


def image_token_id(model) -> int:
    return int(model.config.image_token_id)


def tower_dims(model) -> dict | None:
    """A VLM's vision tower in the memory plan's terms (``fastgrpo.shapes.ModelShape`` fields): its blocks as layers
    (full multi-head attention, a gated MLP, two RMSNorms: a decoder layer's shape), patches as tokens; its patch side,
    merge and pixel values per patch. None for a causal LM."""
    if not is_vlm(model):
        return None
    v, tower = model.config.vision_config, vision_tower(model)
    return dict(params=sum(p.numel() for p in tower.parameters()), layers=v.depth, hidden=v.hidden_size,
                heads=v.num_heads, kv_heads=v.num_heads, head_dim=v.hidden_size // v.num_heads,
                intermediate=v.intermediate_size, vocab=0, qk_norm=False,
                layer_params=sum(p.numel() for p in tower.blocks[0].parameters()), patch=v.patch_size,
                merge=v.spatial_merge_size, patch_values=v.in_channels * v.temporal_patch_size * v.patch_size**2)


def image_token_range(min_pixels: int, max_pixels: int, patch: int, merge: int) -> tuple[int, int]:
    """Fewest and most image tokens of one image after the merge: the processor resizes it (aspect kept) to multiples
    of ``patch · merge`` px with ``min_pixels <= h · w <= max_pixels`` (Qwen2-VL's ``smart_resize``), and each token
    covers ``(patch · merge)²`` px: ``ceil(min_pixels / f²)`` to ``floor(max_pixels / f²)``, f = patch · merge
    (Qwen2.5-VL's defaults: 4 to 1280). An image the resize has to scale is rounded to whole tokens per side, which
    for an extreme aspect ratio, or ``min_pixels`` close to ``max_pixels``, can land a few tokens outside."""
    f2 = (patch * merge) ** 2
    return -(-min_pixels // f2), max_pixels // f2


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


def add_vision_tokens(tok):
    """The tiny character-level tokenizer (``fastgrpo.models.loading.build_tiny_tokenizer``) with Qwen2.5-VL's vision
    tokens added and a chat template that renders image parts (``TINY_VLM_CHAT_TEMPLATE``); returns it."""
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
