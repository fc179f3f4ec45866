"""fastgrpo's co-located trainer: GRPO (the same model samples, is scored, and is updated, step after step), DPO
and SFT on the same loop.

Launch (torchrun only; one process needs no flags)::

    torchrun fastgrpo/train.py                                      # the `tiny` GRPO demo on CPU: a few minutes
    torchrun --nproc_per_node 2 fastgrpo/train.py --recipe tiny     # two processes (DDP, gloo on CPU)
    torchrun fastgrpo/train.py --recipe tiny train.max_steps=20 grpo.num_generations=4 rollout.max_new_tokens=8
    torchrun fastgrpo/train.py --recipe dapo-tiny                   # DAPO: dynamic sampling, overlong shaping, CPU
    torchrun fastgrpo/train.py --recipe dpo-tiny                    # DPO after a supervised warm-up, CPU
    torchrun fastgrpo/train.py --recipe sft-tiny                    # SFT from scratch, CPU
    torchrun fastgrpo/train.py --recipe distill-tiny                # on-policy distillation (trains its teacher first)
    torchrun --nproc_per_node 8 fastgrpo/train.py --recipe deepscaler-1.5b \\
        model.path=/models/DeepSeek-R1-Distill-Qwen-1.5B data.path=/data/deepscaler.jsonl \\
        data.eval_path=/data/aime24.jsonl
    torchrun --nproc_per_node 8 fastgrpo/train.py --recipe dpo-1.5b model.path=/models/my-sft \\
        data.path=/data/prefs.jsonl data.eval_path=/data/prefs-val.jsonl
    torchrun fastgrpo/train.py --config my.yaml logging.output_dir=runs/mine checkpoint.resume=auto

One GRPO step: each rank takes its share of ``grpo.num_prompts_per_step`` prompts → the generation
engine samples ``grpo.num_generations`` completions per prompt with the policy's own parameters, while the reward
worker processes score each group as it finishes (``fastgrpo/rewards/pool.py``) → group advantages → packed
micro-batches → old / reference log-probs when needed → clipped-surrogate update(s) → one metrics row in
``<run dir>/metrics.jsonl`` → a checkpoint every ``checkpoint.every_steps``. Validation (avg@k on the held-out
prompts) runs at the start, every ``eval.every_steps`` and at the end, logged as ``eval/accuracy``. ``stages`` raise
``rollout.max_new_tokens`` (and may change lr / beta / epsilon_high / the prompt + response budget, and start the
warm-up, AdamW and the KL reference afresh) at a step. The lr of step s is the stage's lr times the linear warm-up
factor, counted in GRPO steps (``config.stage_settings``).
A DPO or SFT step is one optimizer step on ``dpo.batch_size`` pairs / ``sft.batch_size`` rows
(fastgrpo/algorithms/dpo.py,
fastgrpo/algorithms/sft.py). A distillation step is GRPO's rollout with a frozen teacher's loss
(fastgrpo/algorithms/distill.py).
Ctrl-C saves a checkpoint when the model is between steps, then stops.

The loop here (data order, steps, validation, metrics, progress, checkpoints, resume) knows no algorithm: GRPO's
rollout and update live in ``fastgrpo/algorithms/grpo.py`` (:class:`fastgrpo.algorithms.grpo.GRPO`), the supervised
warm-up in
``fastgrpo/algorithms/sft.py``; :class:`Trainer` lists what an algorithm supplies.
"""

from __future__ import annotations

import os
import sys

# Run as a script, Python puts this file's directory (fastgrpo/) first on sys.path, where config.py, data.py and
# metrics.py would shadow unrelated top-level modules of those names: drop it before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402

from fastgrpo.config import load_config  # noqa: E402
from fastgrpo.distributed import destroy  # noqa: E402
from fastgrpo.trainer import Trainer  # noqa: E402


def parse_args(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    parser = argparse.ArgumentParser(description="fastgrpo: GRPO / DPO / SFT training (launch with torchrun)")
    parser.add_argument("--recipe", default=None, help="shipped recipe name (default: tiny)")
    parser.add_argument("--config", default=None, help="YAML config file instead of a recipe")
    parser.add_argument("overrides", nargs="*", help="group.field=value overrides, e.g. train.lr=1e-5")
    args = parser.parse_intermixed_args(argv)
    return args.recipe, args.config, args.overrides


def main(argv: list[str] | None = None) -> dict:
    recipe, config_file, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(recipe, config_file, overrides)
    try:
        return Trainer(cfg).fit()
    finally:
        destroy()


if __name__ == "__main__":
    main()
