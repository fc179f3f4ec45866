"""The vision tower and the prompt prefill per GRPO step: the engine's group sharing against one prefill per sample.

Run: ``python bench/bench_vlm.py`` (CPU, seconds; ``--device cuda`` on a GPU; ``--smoke``: records nothing).

Workload: one step of ``PROMPTS`` prompts x ``G`` samples on the tiny Qwen2.5-VL (``fastgrpo.models.vlm``), each
prompt one random image of ``SIDE`` x ``SIDE`` px (``(SIDE / 28)²`` image tokens) and a few text tokens, greedy,
``NEW`` new tokens. Both modes run in the same process on the same prompts:

- **shared** (fastgrpo's engine): ``generate(prompts, n=G)``: each prompt is prefilled once, its images through the
  tower once, and its G samples share its pages;
- **per sample** (a request-per-sample server without a prefix or encoder cache): ``generate(prompts repeated G
  times, n=1)``: every sample prefills its own prompt and runs the tower on its own image.

Reported per mode, from the engine's ``last_stats``: vision-tower calls, image tokens the tower produced, prefill
tokens, wall time of the call, and the ratios per sample / shared. Rows go to ``bench/results/vlm.csv``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import append_rows, print_table
from PIL import Image

from fastgrpo.config import ModelConfig
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.models.loading import build_tiny_tokenizer
from fastgrpo.models.vlm import ImageInputs, add_vision_tokens, build_tiny_vlm, load_processor


def prompts_with_images(n: int, side: int, seed: int = 0):
    tok = add_vision_tokens(build_tiny_tokenizer())
    proc = load_processor("tiny-vlm", tok, side * side, side * side)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        parts = [{"type": "image"}, {"type": "text", "text": "how many squares?"}]
        text = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)
        o = proc(text=[text], images=[image], return_tensors="pt")
        out.append((o["input_ids"][0].tolist(), ImageInputs(o["pixel_values"], o["image_grid_thw"])))
    return tok, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, nothing recorded")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.group, args.side, args.new = 2, 2, 56, 2
    tok, items = prompts_with_images(args.prompts, args.side)
    cfg = ModelConfig(path="tiny-vlm", tiny_hidden_size=256, tiny_num_layers=4, tiny_num_heads=4,
                      tiny_num_kv_heads=2, tiny_intermediate_size=1024)
    model = build_tiny_vlm(cfg, tok).to(args.device).eval()
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=args.prompts * args.group)
    prompts, images = [p for p, _ in items], [im for _, im in items]
    G = args.group
    modes = {
        "shared": (prompts, images, G),
        "per_sample": ([p for p in prompts for _ in range(G)], [im for im in images for _ in range(G)], 1),
    }
    rows = []
    for mode, (ps, ims, n) in modes.items():
        params = SamplingParams(n=n, temperature=0.0, max_new_tokens=args.new)
        engine.generate(ps[:1], params, images=ims[:1])  # warm-up (packs, first-call costs)
        start = time.perf_counter()
        engine.generate(ps, params, images=ims)
        wall = time.perf_counter() - start
        s = engine.last_stats
        rows.append(dict(mode=mode, prompts=args.prompts, group=G, image_side=args.side,
                         tower_calls=s["vision_tower_calls"], tower_image_tokens=s["vision_image_tokens"],
                         prefill_tokens=s["prefill_tokens"], wall_s=wall))
    shared, per = rows
    for key in ("tower_calls", "prefill_tokens", "wall_s"):
        per[f"{key}_ratio"] = per[key] / shared[key]
    print_table(rows, f"vision tower and prefill per step, group sharing vs one prefill per sample ({args.device})")
    if not args.smoke:
        print(f"rows appended to {append_rows('vlm', rows, args.device)}")


if __name__ == "__main__":
    main()
