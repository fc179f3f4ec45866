"""Reward scoring in the training process vs the worker pool, on the tiny demo: step time and the share hidden.

Run: ``python bench/bench_rewards.py`` (``--steps``, ``--reward-delay-ms``, ``--workers``; ``--quick`` for a
smoke run). For each reward cost (the demo's math reward alone, then with a synthetic ``--reward-delay-ms`` per
completion, standing in for math-verify/sympy on long answers) it builds one ``tiny``-recipe trainer with
``reward.num_workers=0`` (scored after generation, in process) and one per ``--workers`` count, gives each the same
supervised warm-up, then runs their GRPO steps round-robin (step 1 of each, step 2 of each, ...), so the load of a
shared machine drifts alike for all. Same seeds: every trainer samples and scores the same completions
(``same_rewards`` checks that their ``reward/mean`` agree at every step). Medians over the steps after the first
(which pays the workers' start):

- ``step_s``: ``time/step``; ``gen_s``: ``time/generation`` (with the pool it includes decoding and submitting
  each finished group); ``reward_s``: ``time/reward`` (first submission → last score); ``wait_s``:
  ``time/reward_wait`` (what the step waited for after generation);
- ``hidden``: ``1 − wait_s / reward_s``, the share of the reward time hidden behind generation;
- ``x_step``: the in-process step time / this row's step time.

Groups reach the pool as they finish: with the demo's settings all 256 sequences decode in one wave and end
together after ~8 tokens, leaving little to overlap; ``--max-batch-size 32`` decodes in 8 waves, as a long
rollout whose groups finish at different times would.

The reward work and generation share the machine's cores. Rows go to ``bench/results/rewards.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import append_rows, print_table

from fastgrpo.config import load_config
from fastgrpo.rewards import clear_caches, math_reward

DELAY_ENV = "FASTGRPO_BENCH_REWARD_DELAY_MS"  # read by delayed_math in the workers (spawned: they inherit it)


def delayed_math(prompts, completions, answer, **columns):
    """The math reward plus a sleep of ``$FASTGRPO_BENCH_REWARD_DELAY_MS`` per completion (a slow verifier)."""
    time.sleep(float(os.environ.get(DELAY_ENV, "0")) * 1e-3 * len(completions))
    return math_reward(prompts, completions, answer)


def compare(steps: int, workers: list[int], delay_ms: float, warmup: int, max_batch_size: int) -> list[dict]:
    """One row per worker count (0 first): medians over steps 2.. of trainers stepped round-robin."""
    from fastgrpo.metrics import MetricsLogger
    from fastgrpo.sft import sft_warmup
    from fastgrpo.train import Trainer

    os.environ[DELAY_ENV] = str(delay_ms)  # before the workers spawn: they inherit the environment
    clear_caches()  # the in-process trainer starts as cold as the new workers (its verdicts of the last run are gone)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        try:
            for w in workers:
                trainers[w] = Trainer(load_config("tiny", None, [
                    f"sft.warmup_steps={warmup}", "logging.progress_bar=false", f"logging.output_dir={tmp}/{w}",
                    f"reward.num_workers={w}", f"rollout.max_batch_size={max_batch_size}",
                    f"reward.functions=[{'bench_rewards:delayed_math' if delay_ms else 'math'}]"]))
                sft_warmup(trainers[w], *trainers[w].algorithm.warmup_examples())
                trainers[w].algorithm.begin()
            logger = MetricsLogger(tmp, enabled=False)
            logs = {w: [] for w in workers}
            for _ in range(steps):
                for w, trainer in trainers.items():
                    logs[w].append(trainer.train_step(logger))
        finally:
            for trainer in trainers.values():
                trainer.close()
    same = all(a["reward/mean"] == b["reward/mean"] for w in workers for a, b in zip(logs[w], logs[workers[0]]))
    keys = ("time/step", "time/generation", "time/reward", "time/reward_wait")
    med = {w: {k: statistics.median(m[k] for m in logs[w][1:]) for k in keys} for w in workers}
    rows = []
    for w in workers:
        t = med[w]
        rows.append({"delay_ms": delay_ms, "batch": max_batch_size, "workers": w, "steps": steps - 1,
                     "step_s": t["time/step"], "gen_s": t["time/generation"], "reward_s": t["time/reward"],
                     "wait_s": t["time/reward_wait"],
                     "hidden": 1 - t["time/reward_wait"] / t["time/reward"] if t["time/reward"] > 0 else 0.0,
                     "x_step": med[workers[0]]["time/step"] / t["time/step"], "same_rewards": same})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is not counted)")
    ap.add_argument("--reward-delay-ms", type=float, default=5.0, help="synthetic cost per completion (0: none)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool sizes to compare with in-process")
    ap.add_argument("--warmup", type=int, default=100, help="supervised warm-up steps (the policy learns \\boxed{})")
    ap.add_argument("--max-batch-size", type=int, default=256, help="rollout.max_batch_size: sequences decoded at "
                    "once (the demo's 256 decodes the step's 32 x 8 in one wave: its groups all finish at the end)")
    ap.add_argument("--quick", action="store_true", help="3 steps, 20 warm-up steps, one pool size")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.workers = 3, 20, args.workers[:1]
    out = []
    for delay in dict.fromkeys([0.0, args.reward_delay_ms]):
        rows = compare(args.steps, [0, *args.workers], delay, args.warmup, args.max_batch_size)
        print_table(rows)
        out += rows
    print_table(out, "\nreward scoring: in process (workers=0) vs the pool, tiny demo")
    print(f"rows appended to {append_rows('rewards', out, 'cpu')}")


if __name__ == "__main__":
    main()
