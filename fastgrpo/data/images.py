"""Prompts with images (vision-language models), in TRL's dataset conventions.

A row's images are its ``image`` column (one) or ``images`` column (a list); each image is a path (absolute, or
relative to the data file's folder), a PIL image, raw bytes, or a dict ``{"bytes": ..., "path": ...}`` (how Parquet
and Hugging Face ``datasets`` store an ``Image`` feature). The prompt (``data.prompt_field``) is a string or a
conversation (a list of ``{"role", "content"}`` messages whose content is a string or a list of parts ``{"type":
"image"}`` / ``{"type": "text", "text": ...}``). As TRL's ``prepare_multimodal_messages``: when no message has image
parts, one ``{"type": "image"}`` part per image goes before the text of the first user message. The processor
(``fastgrpo.models.vlm.load_processor``: ``AutoProcessor``-style, with ``vision.min_pixels`` / ``vision.max_pixels``)
renders the conversation with the chat template and expands each image's placeholder to its tokens.

Every row is checked at start-up, and a bad one stops the run naming the row and the field: a missing file, bytes
that do not decode as an image, a count of image parts different from the count of images. Each row's prompt ids
(an :class:`~fastgrpo.models.vlm.ImagePrompt`) are computed then; its pixels are made again from its images whenever
a step samples it (a dataset holds the images' sources, not every row's ``pixel_values``: 3.4 MiB of fp32 per
480 x 320 image). The image columns are not handed to the reward functions (a pickled image per completion would
cross to the reward workers for nothing the verifiers read).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from fastgrpo.models.vlm import ImageInputs, ImagePrompt

IMAGE_COLUMNS = ("image", "images")


def row_images(row: dict, where: str) -> list:
    """The image values of ``row`` (TRL's ``image`` or ``images`` column), as stored."""
    if "images" in row:
        value = row["images"]
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} field 'images' must be a list of images, got {type(value).__name__}")
        return list(value)
    if "image" in row:
        return [] if row["image"] is None else [row["image"]]
    return []


def open_image(value, where: str, base: Path | None):
    """A PIL image (RGB) from a path, a PIL image, bytes or ``{"bytes", "path"}``; ``ValueError`` naming ``where``
    (the row and field) when the file is missing or does not decode."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        source, name = io.BytesIO(value), "its bytes"
    elif isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise ValueError(f"{where}: image file {str(path)!r} does not exist")
        source, name = path, repr(str(path))
    else:
        raise ValueError(f"{where} must be an image path, a PIL image, bytes or {{'bytes', 'path'}}, got "
                         f"{type(value).__name__}")
    try:
        image = Image.open(source)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{where}: {name} cannot be decoded as an image ({e})") from None
    return image.convert("RGB")


def vlm_messages(prompt, n_images: int, cfg, where: str) -> list[dict]:
    """The conversation of a row: ``data.system_prompt`` and the question in ``data.prompt_template`` for a string
    prompt, the row's own messages otherwise; image parts placed as TRL does (module docstring) and counted."""
    if isinstance(prompt, str):
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        messages.append({"role": "user", "content": cfg.prompt_template.format(prompt=prompt)})
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"{where} must be a string or a list of {{'role', 'content'}} messages")
    parts = sum(1 for m in messages if isinstance(m.get("content"), list)
                for c in m["content"] if isinstance(c, dict) and c.get("type") == "image")
    if parts == 0 and n_images:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise ValueError(f"{where} has no user message to put its {n_images} images in")
        content = messages[first]["content"]
        text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        messages[first] = {**messages[first], "content": [{"type": "image"}] * n_images + text}
    elif parts != n_images:
        raise ValueError(f"{where} has {parts} image parts ({{'type': 'image'}}) for {n_images} images")
    return messages


def vlm_prompt(row: dict, i: int, processor, cfg, source: str, base: Path | None) -> ImagePrompt:
    """Row ``i``'s prompt ids with its images (checked: module docstring)."""
    where = f"{source}: row {i}"
    values = row_images(row, where)
    images = [open_image(v, f"{where} field {'images' if 'images' in row else 'image'!r}", base) for v in values]
    messages = vlm_messages(row["prompt"], len(images), cfg, f"{where} field {cfg.prompt_field!r} (data.prompt_field)")
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    grid = out["image_grid_thw"] if images else torch.zeros(0, 3, dtype=torch.long)
    image_processor = processor.image_processor

    def make_images() -> ImageInputs:  # the pixels again from the row's images (not kept)
        if not images:
            return None
        px = image_processor(images=images, return_tensors="pt")
        return ImageInputs(px["pixel_values"], px["image_grid_thw"])

    return ImagePrompt(ids, make_images, grid, processor.image_token_id, image_processor.merge_size)
