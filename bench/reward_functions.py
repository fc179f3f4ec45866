"""Reward functions of ``bench_rewards.py``, in a module of their own: a worker that imports them imports
:mod:`fastgrpo.rewards` and nothing heavier (no torch), as a user's reward module would."""

from __future__ import annotations

import os
import time

from fastgrpo.rewards import math_reward

DELAY_ENV = "FASTGRPO_BENCH_REWARD_DELAY_MS"  # read in the workers: they have the environment the pool started with
CRASH = "CRASH"  # a completion holding it kills the worker that scores it


def delayed_math(prompts, completions, answer, **columns):
    """The math reward plus a sleep of ``$FASTGRPO_BENCH_REWARD_DELAY_MS`` per completion (a slow verifier)."""
    time.sleep(float(os.environ.get(DELAY_ENV, "0")) * 1e-3 * len(completions))
    return math_reward(prompts, completions, answer)


def crash(prompts, completions, **columns):
    """1 per completion; a chunk with a :data:`CRASH` completion ends its process (``os._exit``) instead."""
    if any(CRASH in c for c in completions):
        os._exit(3)
    return [1.0] * len(completions)
