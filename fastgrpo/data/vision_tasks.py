"""The built-in vision task (``data.synthetic_task: squares``, the ``vlm-tiny`` recipe): count the coloured squares.

Each image is 56 x 56 px, black, cut into a 2 x 2 grid of 28-px cells (with the tiny model's 14-px patches merged
2 x 2, one image token per cell); each cell holds, with probability 1/2, one filled square of 8-18 px in one of four
colours at a random place inside it. The prompt asks "How many squares?", the answer is the count (0-4) in
``\\boxed{}``. The images are drawn in code from one seed per row (``SYNTHETIC_SPLIT_SEED`` and the row's index):
``data.synthetic_eval_size`` held-out rows first, then ``data.synthetic_train_size`` training rows.
"""

from __future__ import annotations

import random

from fastgrpo.config import DataConfig

SQUARES_PROMPT = "How many squares?"
SQUARES_SIDE, SQUARES_CELL = 56, 28
SQUARES_COLOURS = ((230, 40, 40), (40, 200, 60), (50, 90, 240), (240, 220, 40))


def squares_image(rng: random.Random):
    """One image (PIL, RGB) and its count of squares."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SQUARES_SIDE, SQUARES_SIDE))
    draw = ImageDraw.Draw(image)
    count = 0
    for cy in range(0, SQUARES_SIDE, SQUARES_CELL):
        for cx in range(0, SQUARES_SIDE, SQUARES_CELL):
            if rng.random() < 0.5:
                continue
            side = rng.randint(8, 18)
            x, y = cx + rng.randint(0, SQUARES_CELL - side), cy + rng.randint(0, SQUARES_CELL - side)
            draw.rectangle((x, y, x + side - 1, y + side - 1), fill=rng.choice(SQUARES_COLOURS))
            count += 1
    return image, count


def squares_rows(cfg: DataConfig, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows ``{"prompt", "image", "answer"}`` (module docstring)."""
    rows = []
    for i in range(cfg.synthetic_eval_size + cfg.synthetic_train_size):
        image, count = squares_image(random.Random(seed * 1_000_003 + i))
        rows.append({"prompt": SQUARES_PROMPT, "image": image, "answer": str(count)})
    return rows[cfg.synthetic_eval_size :], rows[: cfg.synthetic_eval_size]
