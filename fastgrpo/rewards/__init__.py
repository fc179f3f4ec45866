"""Rewards: the built-in reward functions and how completions are scored.

- :mod:`fastgrpo.rewards.functions`: the TRL-convention functions ``f(prompts, completions, **columns)``
  (``math_reward``, ``format_reward``) and their helpers.
- :mod:`fastgrpo.rewards.scoring`: names resolved to functions, chunked calls with faults counted (a failed call's
  completions scored again alone), the weighted sum (:class:`RewardSet`, in the training process).
- :mod:`fastgrpo.rewards.pool`: :class:`~fastgrpo.rewards.pool.RewardPool`, the same scoring in worker processes,
  with :mod:`fastgrpo.rewards.processes` (the trainer's handles on the server and workers) and
  :mod:`fastgrpo.rewards.worker` (the code that runs in them).

Everything below is importable from ``fastgrpo.rewards``; the package imports neither torch nor Triton, so a
reward worker (or a user's reward module) stays light.
"""

from fastgrpo.rewards.functions import (
    BOXED,
    BUILTINS,
    VERDICT_CACHE_SIZE,
    RewardTimeout,
    clear_caches,
    fast_verdict,
    format_reward,
    last_boxed,
    math_reward,
    math_score,
    parsed_gold,
    time_limit,
)
from fastgrpo.rewards.scoring import (
    CHUNK_SIZE,
    COUNTERS,
    FAULTS,
    RewardResult,
    RewardSet,
    add_faults,
    call_budget,
    chunk_bounds,
    chunks,
    combine,
    function_name,
    load_functions,
    no_scores,
    resolve,
    score_chunk,
    score_isolated,
)

__all__ = [
    "BOXED", "BUILTINS", "CHUNK_SIZE", "COUNTERS", "FAULTS", "VERDICT_CACHE_SIZE", "RewardResult", "RewardSet",
    "RewardTimeout", "add_faults", "call_budget", "chunk_bounds", "chunks", "clear_caches", "combine", "fast_verdict",
    "format_reward", "function_name", "last_boxed", "load_functions", "math_reward", "math_score", "no_scores",
    "parsed_gold", "resolve", "score_chunk", "score_isolated", "time_limit",
]
