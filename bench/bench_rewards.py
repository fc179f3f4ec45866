"""Reward scoring in the training process vs the worker pool, on the tiny demo: step time and the share hidden.

Run: ``python bench/bench_rewards.py`` (``--steps``, ``--reward-delay-ms``, ``--workers``; ``--quick`` for a
smoke run). For each reward cost (the demo's math reward alone, then with a synthetic ``--reward-delay-ms`` per
completion, standing in for math-verify/sympy on long answers) it trains the ``tiny`` recipe for ``--steps`` GRPO
steps with ``reward.num_workers=0`` (scored after generation, in process) and with each ``--workers`` count, and
reports medians over the steps after the first (which pays the workers' start):

- ``step_s``: ``time/step``; ``gen_s``: ``time/generation`` (with the pool it includes decoding and submitting
  each finished group); ``reward_s``: ``time/reward`` (first submission → last score); ``wait_s``:
  ``time/reward_wait`` (what the step waited for after generation);
- ``hidden``: ``1 − wait_s / reward_s``, the share of the reward time hidden behind generation;
- ``x_step``: the in-process step time / this row's step time.

The reward work and generation share the machine's cores, so on 2 busy cores the overlap shows more in ``hidden``
than in the step time. Rows go to ``bench/results/rewards.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import append_rows, print_table

from fastgrpo.config import load_config
from fastgrpo.metrics import read_jsonl
from fastgrpo.rewards import math_reward

DELAY_ENV = "FASTGRPO_BENCH_REWARD_DELAY_MS"  # read by delayed_math in the workers (spawned: they inherit it)


def delayed_math(prompts, completions, answer, **columns):
    """The math reward plus a sleep of ``$FASTGRPO_BENCH_REWARD_DELAY_MS`` per completion (a slow verifier)."""
    time.sleep(float(os.environ.get(DELAY_ENV, "0")) * 1e-3 * len(completions))
    return math_reward(prompts, completions, answer)


def run(steps: int, workers: int, delay_ms: float, warmup: int) -> dict:
    from fastgrpo.train import Trainer

    os.environ[DELAY_ENV] = str(delay_ms)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("tiny", None, [
            f"train.max_steps={steps}", f"sft.warmup_steps={warmup}", "eval.at_start=false",
            "eval.at_end=false", "eval.every_steps=0", "checkpoint.every_steps=0", "checkpoint.save_final=false",
            "logging.progress_bar=false", f"logging.output_dir={tmp}/run", f"reward.num_workers={workers}",
            f"reward.functions=[{'bench_rewards:delayed_math' if delay_ms else 'math'}]"])
        Trainer(cfg).fit()
        rows = [r for r in read_jsonl(f"{tmp}/run/metrics.jsonl") if "time/step" in r][1:]

    def med(key):
        return statistics.median(r[key] for r in rows)

    reward, wait = med("time/reward"), med("time/reward_wait")
    return {"delay_ms": delay_ms, "workers": workers, "steps": len(rows), "step_s": med("time/step"),
            "gen_s": med("time/generation"), "reward_s": reward, "wait_s": wait,
            "hidden": 1 - wait / reward if reward > 0 else 0.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is not counted)")
    ap.add_argument("--reward-delay-ms", type=float, default=5.0, help="synthetic cost per completion (0: none)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool sizes to compare with in-process")
    ap.add_argument("--warmup", type=int, default=100, help="supervised warm-up steps (the policy learns \\boxed{})")
    ap.add_argument("--quick", action="store_true", help="3 steps, 20 warm-up steps, one pool size")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.workers = 3, 20, args.workers[:1]
    out = []
    for delay in dict.fromkeys([0.0, args.reward_delay_ms]):
        base = None
        for workers in [0, *args.workers]:
            row = run(args.steps, workers, delay, args.warmup)
            base = base or row["step_s"]
            row["x_step"] = base / row["step_s"]
            out.append(row)
            print_table([row])
    print_table(out, "\nreward scoring: in process (workers=0) vs the pool, tiny demo")
    print(f"rows appended to {append_rows('rewards', out, 'cpu')}")


if __name__ == "__main__":
    main()
