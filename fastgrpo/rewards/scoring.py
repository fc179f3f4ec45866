"""Scoring completions with reward functions: resolving names, chunked calls with faults counted, the
weighted sum (:class:`RewardSet` in the training process; :class:`fastgrpo.rewards.pool.RewardPool` in workers).

Every function is called on chunks of at most :data:`CHUNK_SIZE` completions, cut at fixed positions of each
scored batch, so a score never depends on how the batches were scheduled. A call gets ``reward.timeout_s`` in all
(:func:`call_budget`). When the call as a whole fails (it raised, returned the wrong number of scores, ran past its
limit, or its worker died), each of its completions is scored again alone, with ``reward.timeout_s`` of its own:
only a completion that is faulty by itself scores 0 and is counted (the fault rules:
:mod:`fastgrpo.rewards.functions`), so a function that scores each completion independently of the others gives
every completion, faulty neighbours or not, the score it gives it alone.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from fastgrpo.config import RewardConfig
from fastgrpo.rewards.functions import BUILTINS, RewardTimeout, math_reward, math_score, parsed_gold, time_limit

CHUNK_SIZE = 4  # completions per reward call, which gets reward.timeout_s in all (then each alone, if it failed)
FAULTS = ("failures", "timeouts", "nonfinite")  # the counters of reward/<name>/<fault>; each such completion scores 0
COUNTERS = (*FAULTS, "isolated")  # reward/<name>/<counter>; isolated: completions scored again alone

Scores = tuple[list[float], dict[str, int]]  # one score per completion (0 where faulty), and {counter: completions}


def resolve(name: str) -> Callable[..., list[float]]:
    """A built-in name or ``"module:function"`` → the function; a clear ``ValueError`` otherwise."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ValueError(f"reward.functions: {name!r} is neither a built-in ({sorted(BUILTINS)}) nor "
                         "'module:function'")
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - a module that fails at import time (any error) is reported, not raised
        raise ValueError(f"reward.functions: cannot import {module_name!r} for {name!r}: "
                         f"{type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.functions: {module_name!r} has no callable {attr!r}")
    return fn


def function_name(name: str) -> str:
    """The metric name of a reward function: the built-in's name, or the function part of ``module:function``."""
    return name if name in BUILTINS else name.split(":")[-1]


def load_functions(functions: Sequence[str], worker_init: str) -> tuple[list[Callable | None], list[str | None]]:
    """Run ``worker_init`` (``"module:function"``, called with no argument; empty: none), then resolve each name.

    Returns the functions and, per function, the error that made it unusable (None when fine): its import or
    lookup error, or the initializer's error for every function. Never raises: a function that cannot be loaded
    scores 0 and counts as a failure on every completion. The ``math`` built-in's verifier is imported here.
    """
    if worker_init:
        try:
            resolve(worker_init)()
        except Exception as e:  # noqa: BLE001 - the state the functions need is missing: they all fail
            error = f"reward.worker_init {worker_init!r} failed: {type(e).__name__}: {e}"
            return [None] * len(functions), [error] * len(functions)
    fns, errors = [], []
    for name in functions:
        try:
            fns.append(resolve(name))
            errors.append(None)
        except ValueError as e:
            fns.append(None)
            errors.append(str(e))
    if math_reward in fns:
        parsed_gold("1")  # imports math-verify and sympy now (seconds), not in the middle of a step
    return fns, errors


def chunk_bounds(n: int, size: int = CHUNK_SIZE) -> list[tuple[int, int]]:
    """``[start, end)`` of the reward calls over a batch of ``n`` completions: fixed chunks of ``size``."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def chunks(prompts: list[str], completions: list[str], columns: dict[str, list],
           size: int = CHUNK_SIZE) -> list[tuple[int, list[str], list[str], dict[str, list]]]:
    """The reward calls over a batch: ``(start, prompts, completions, columns)`` of each chunk of ``size``."""
    return [(a, prompts[a:b], completions[a:b], {k: v[a:b] for k, v in columns.items()})
            for a, b in chunk_bounds(len(completions), size)]


def call_budget(name: str, n: int, timeout_s: float) -> float:
    """Seconds one call of function ``name`` on ``n`` completions may take: ``timeout_s`` in all, but ``n ×
    timeout_s`` for the ``math`` built-in, which :func:`score_chunk` times per completion itself (its budget stops
    only code that escapes that alarm)."""
    return n * timeout_s if BUILTINS.get(name) is math_reward else timeout_s


def no_scores(n: int, fault: str) -> Scores:
    """``n`` zero scores, all counted as ``fault``."""
    return [0.0] * n, {f: n if f == fault else 0 for f in FAULTS}


def score_chunk(fn: Callable | None, prompts: list[str], completions: list[str], columns: dict[str, list],
                timeout_s: float, *, soft_limit: bool = True) -> Scores | str:
    """One reward call on a chunk: ``(scores, {fault: count})`` with each completion's own faults scored 0, or the
    fault of the call as a whole, to be isolated by scoring its completions alone: "failures" (the function raised
    or returned the wrong number of scores) or "timeouts" (past the SIGALRM limit).

    ``fn`` None: a function that could not be loaded (all failures, no call). The ``math`` built-in is timed and
    counted per completion, ``timeout_s`` each. Other functions get ``timeout_s`` for the whole call as a SIGALRM
    limit when ``soft_limit`` (in the training process); in a worker the pool enforces it by killing the process.
    """
    n = len(completions)
    if fn is None:
        return no_scores(n, "failures")
    counts = dict.fromkeys(FAULTS, 0)
    if fn is math_reward:
        scores = []
        for completion, gold in zip(completions, columns.get("answer", [None] * n)):
            try:
                if gold is None:
                    raise ValueError("the math reward needs an 'answer' column")
                scores.append(math_score(completion, gold, timeout_s))
            except RewardTimeout:
                counts["timeouts"] += 1
                scores.append(0.0)
            except Exception:  # noqa: BLE001 - one bad verification scores 0 for that completion alone
                counts["failures"] += 1
                scores.append(0.0)
        return scores, counts
    with time_limit(timeout_s) if soft_limit else nullcontext({"fired": False}) as status:
        try:
            scores = [float(s) for s in fn(prompts, completions, **columns)]
        except Exception:  # noqa: BLE001 - a reward function's fault scores 0 and is counted, never crashes the run
            scores = None
    if status["fired"]:
        return "timeouts"
    if scores is None or len(scores) != n:
        return "failures"
    counts["nonfinite"] = sum(not math.isfinite(s) for s in scores)
    return [s if math.isfinite(s) else 0.0 for s in scores], counts


def score_isolated(fn: Callable | None, prompts: list[str], completions: list[str], columns: dict[str, list],
                   timeout_s: float) -> Scores:
    """:func:`score_chunk` in this process; when the call as a whole failed, each completion again alone (counted in
    "isolated"), so that only the faulty ones score 0. A single completion's fault is final."""
    result = score_chunk(fn, prompts, completions, columns, timeout_s)
    if not isinstance(result, str):
        return result
    if len(completions) == 1:
        return no_scores(1, result)
    scores, counts = [], {"isolated": len(completions)}
    for _, *one in chunks(prompts, completions, columns, 1):
        s, c = score_isolated(fn, *one, timeout_s)
        scores += s
        add_faults(counts, c)
    return scores, counts


@dataclass
class RewardResult:
    """Weighted total per completion, each function's raw scores (0 where faulty), and its counters."""

    total: list[float]
    per_function: dict[str, list[float]]
    faults: dict[str, dict[str, int]] = field(default_factory=dict)
    """name → :data:`COUNTERS` → completions: scored 0 as "failures", "timeouts" or "nonfinite"; "isolated": scored
    again alone after their chunk's call failed."""

    def metrics(self) -> dict[str, float]:
        """``reward/<name>/mean`` and the counts ``reward/<name>/<counter>`` (sum them across ranks)."""
        out = {}
        for name, scores in self.per_function.items():
            out[f"reward/{name}/mean"] = sum(scores) / max(len(scores), 1)
            for counter in COUNTERS:
                out[f"reward/{name}/{counter}"] = float(self.faults.get(name, {}).get(counter, 0))
        return out


def combine(names: list[str], weights: list[float], per_function: dict[str, list[float]],
            faults: dict[str, dict[str, int]]) -> RewardResult:
    """The :class:`RewardResult` of every function's scores over the same completions: ``Σ_i w_i · f_i``."""
    n = len(per_function[names[0]]) if names else 0
    total = [sum(w * per_function[name][j] for name, w in zip(names, weights)) for j in range(n)]
    return RewardResult(total=total, per_function=per_function, faults=faults)


def add_faults(into: dict[str, int], counts: dict[str, int]) -> None:
    """Add the :data:`COUNTERS` of ``counts`` into ``into``."""
    for counter in COUNTERS:
        into[counter] = into.get(counter, 0) + counts.get(counter, 0)


class RewardSet:
    """The configured reward functions with their weights, scored in this process; never raises for a function's
    fault. ``reward.worker_init`` runs once, here."""

    def __init__(self, cfg: RewardConfig):
        self.names = [function_name(n) for n in cfg.functions]
        self.functions, self.errors = load_functions(cfg.functions, cfg.worker_init)
        self.weights = list(cfg.weights) or [1.0] * len(self.functions)
        self.timeout_s = cfg.timeout_s
        for error in dict.fromkeys(e for e in self.errors if e):
            warnings.warn(f"{error}; its completions score 0 and count in reward/<name>/failures", RuntimeWarning,
                          stacklevel=2)

    def score(self, prompts: Sequence[str], completions: Sequence[str], columns: dict[str, list]) -> RewardResult:
        """Score every completion with every function; ``columns`` holds one value per completion."""
        prompts, completions = list(prompts), list(completions)
        per_function = {name: [] for name in self.names}
        faults = {name: dict.fromkeys(COUNTERS, 0) for name in self.names}
        for name, fn in zip(self.names, self.functions):
            for _, *chunk in chunks(prompts, completions, columns):
                scores, counts = score_isolated(fn, *chunk, self.timeout_s)
                per_function[name] += scores
                add_faults(faults[name], counts)
        return combine(self.names, self.weights, per_function, faults)
