"""Reward functions: the TRL convention ``f(prompts, completions, **dataset_columns) -> list[float]``.

``prompts`` and ``completions`` are the decoded texts (one entry per completion: a prompt is repeated for each of
its G samples), and every other dataset column (``answer`` at least) comes as a keyword argument holding one value
per completion. The reward of a completion is ``Σ_i w_i · f_i``.

Built-ins:
- ``math``: 1 when the last ``\\boxed{...}`` of the completion equals the ground truth per ``math-verify``
  (``verify(parse(gold), parse(pred))``); else 0. Exact fast paths (:func:`fast_verdict`: plain numbers, ``x=15``,
  integer fractions and sums, an empty box) give math-verify's verdict without sympy; each distinct ground truth
  is parsed once, and each distinct (ground truth, answer) pair verified once per process.
- ``format``: 1 when the completion holds a complete ``\\boxed{...}``; else 0.

User functions are named ``"package.module:function"``. Every function is called on chunks of at most
:data:`CHUNK_SIZE` completions, the chunks of each scored batch (a GRPO group) cut at fixed positions, so a score
never depends on how the batches were scheduled. A fault scores 0 for the affected completions and is counted,
never stopping the run: ``reward/<name>/failures`` (the function raised, returned the wrong number of values, or
its module or ``reward.worker_init`` failed), ``reward/<name>/timeouts`` (past ``reward.timeout_s`` per
completion) and ``reward/<name>/nonfinite`` (NaN or ±inf). In the training process (:class:`RewardSet`,
``reward.num_workers=0``) the time limit is a SIGALRM timer on the main thread, which code that never returns to
the interpreter escapes; :class:`fastgrpo.reward_pool.RewardPool` kills the worker instead.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import re
import signal
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from fractions import Fraction

from fastgrpo.config import RewardConfig

BOXED = "\\boxed{"
# math-verify logs a warning on every call whose own timeout is off; ours (time_limit) bounds the call instead
logging.getLogger("math_verify").setLevel(logging.ERROR)


class RewardTimeout(Exception):
    """A reward function ran past its time limit."""


@contextmanager
def time_limit(seconds: float):
    """Raise :class:`RewardTimeout` in the block after ``seconds`` (SIGALRM; only on the main thread, else no
    limit). Yields a dict whose ``"fired"`` is True afterwards when the limit was hit, even when the guarded code
    swallowed the exception (math-verify catches everything)."""
    status = {"fired": False}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield status
        return

    def handler(signum, frame):
        status["fired"] = True
        raise RewardTimeout(f"reward function ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield status
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind(BOXED)
    while start != -1:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED) : i - 1]
        start = text.rfind(BOXED, 0, start)
    return None


# Fast paths of the math reward: forms whose math-verify verdict is certain without sympy. A decimal number (sign
# glued on; thousands commas only on integers), optionally after "=" or "x =", or wrapped in brace-free "{...}";
# \frac / \dfrac / \tfrac of two integers; a chain of integers joined by single + / - signs.
_NUM = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
_NUM_RE = re.compile(_NUM)
_EQ_RE = re.compile(r"(?:[A-Za-z]\s*)?=\s*(" + _NUM + ")")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}")
_SUM_RE = re.compile(r"[+-]?\d+(?:\s*[+-]\s*\d+)+")
_TERM_RE = re.compile(r"([+-]?)\s*(\d+)")
VERDICT_CACHE_SIZE = 1 << 16


@functools.lru_cache(maxsize=VERDICT_CACHE_SIZE)
def _number(text: str) -> Fraction | None:
    """``text`` (stripped) as an exact decimal number (``"12"``, ``"-3.5"``, ``"1,000"``), else None."""
    t = text.strip()
    return Fraction(t.replace(",", "")) if _NUM_RE.fullmatch(t) else None


def _value(pred: str) -> Fraction | None:
    """The exact value of a boxed answer in one of the fast-path forms, else None."""
    t = pred.strip()
    while len(t) >= 2 and t[0] == "{" and t[-1] == "}" and "{" not in t[1:-1] and "}" not in t[1:-1]:
        t = t[1:-1].strip()
    if (n := _number(t)) is not None:
        return n
    if m := _EQ_RE.fullmatch(t):
        return _number(m.group(1))
    if (m := _FRAC_RE.fullmatch(t)) and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    if _SUM_RE.fullmatch(t):
        return Fraction(sum(int(d) * (-1 if sign == "-" else 1) for sign, d in _TERM_RE.findall(t)))
    return None


def fast_verdict(gold: str, pred: str) -> float | None:
    """math-verify's verdict on ``pred`` against ``gold`` when it is certain without sympy, else None.

    1.0 for the same string (stripped) or the same exact value; 0.0 for an empty answer or two different
    integers; None (ask math-verify) otherwise: a ``gold`` that is not a plain number, an answer in no fast-path
    form, or different values of which one is not an integer (math-verify's numeric tolerance decides those).
    Tested against math-verify on tricky and random answers (``tests/test_rewards.py``).
    """
    if pred.strip() == gold.strip():
        return 1.0
    if not pred.strip():
        return 0.0  # math-verify parses nothing from an empty box
    g = _number(gold)
    if g is None:
        return None
    v = _value(pred)
    if v is None:
        return None
    if v == g:
        return 1.0
    return 0.0 if v.denominator == 1 and g.denominator == 1 else None


@functools.lru_cache(maxsize=VERDICT_CACHE_SIZE)
def _parsed_gold(gold: str) -> list:
    """math-verify's parse of a ground truth, once per distinct answer (the G completions of a prompt share it)."""
    from math_verify import parse

    return parse(f"${gold}$", parsing_timeout=None)


_verdicts: dict[tuple[str, str], float] = {}  # math-verify verdicts already computed, (gold, pred) -> 0.0 / 1.0


def clear_caches() -> None:
    """Forget the parsed ground truths and verdicts of this process (benchmarks compare processes from cold)."""
    _parsed_gold.cache_clear()
    _verdicts.clear()


def _verify(gold: str, pred: str, timeout_s: float) -> float:
    """1.0 when ``pred`` equals ``gold``: :func:`fast_verdict` when certain, else math-verify within ``timeout_s``
    (each distinct (gold, pred) pair verified once per process)."""
    fast = fast_verdict(gold, pred)
    if fast is not None:
        return fast
    key = (gold, pred)
    if key in _verdicts:
        return _verdicts[key]
    from math_verify import parse, verify

    with time_limit(timeout_s) as status:
        # math-verify's own timeouts use signal.alarm too: off here, the guard above bounds the whole check
        ok = verify(_parsed_gold(gold), parse(f"{BOXED}{pred}}}", parsing_timeout=None), timeout_seconds=None)
    if status["fired"]:
        raise RewardTimeout(f"math verification ran longer than {timeout_s} s")
    if len(_verdicts) >= VERDICT_CACHE_SIZE:
        _verdicts.clear()
    _verdicts[key] = 1.0 if ok else 0.0
    return _verdicts[key]


def _math_score(completion: str, gold, timeout_s: float) -> float:
    """The ``math`` reward of one completion; raises :class:`RewardTimeout` or math-verify's error."""
    pred = last_boxed(completion)
    return 0.0 if pred is None else _verify(str(gold), pred, timeout_s)


def math_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], *,
                timeout_s: float = 5.0, **_) -> list[float]:
    """1 when the completion's last ``\\boxed{}`` equals the ground truth ``answer`` (string or math-verify).

    A verification that fails or times out gives NaN for that completion alone.
    """
    out = []
    for completion, gold in zip(completions, answer):
        try:
            out.append(_math_score(completion, gold, timeout_s))
        except Exception:  # noqa: BLE001 - one bad verification must not zero the whole batch
            out.append(math.nan)
    return out


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """1 when the completion holds a complete ``\\boxed{...}``."""
    return [0.0 if last_boxed(c) is None else 1.0 for c in completions]


BUILTINS: dict[str, Callable[..., list[float]]] = {"math": math_reward, "format": format_reward}
CHUNK_SIZE = 4  # completions per reward call: a hang costs at most CHUNK_SIZE x reward.timeout_s
FAULTS = ("failures", "timeouts", "nonfinite")  # the counters of reward/<name>/<fault>; each such completion scores 0


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
        _parsed_gold("1")  # imports math-verify and sympy now (seconds), not in the middle of a step
    return fns, errors


def chunk_bounds(n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the reward calls over a batch of ``n`` completions: fixed chunks of :data:`CHUNK_SIZE`."""
    return [(i, min(i + CHUNK_SIZE, n)) for i in range(0, n, CHUNK_SIZE)]


def no_scores(n: int, fault: str) -> tuple[list[float], dict[str, int]]:
    """``n`` zero scores, all counted as ``fault``."""
    return [0.0] * n, {f: n if f == fault else 0 for f in FAULTS}


def score_chunk(fn: Callable | None, prompts: list[str], completions: list[str], columns: dict[str, list],
                timeout_s: float, *, soft_limit: bool = True) -> tuple[list[float], dict[str, int]]:
    """One reward call on a chunk: ``(scores, {fault: count})``, every fault scored 0 (see the module docstring).

    ``fn`` None: a function that could not be loaded (all failures). The ``math`` built-in is timed and counted
    per completion. Other functions get ``len(completions) × timeout_s`` as one SIGALRM limit when ``soft_limit``
    (in the training process); in a worker the pool enforces that budget by killing the process.
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
                scores.append(_math_score(completion, gold, timeout_s))
            except RewardTimeout:
                counts["timeouts"] += 1
                scores.append(0.0)
            except Exception:  # noqa: BLE001 - one bad verification scores 0 for that completion alone
                counts["failures"] += 1
                scores.append(0.0)
        return scores, counts
    with time_limit(timeout_s * max(n, 1)) if soft_limit else nullcontext({"fired": False}) as status:
        try:
            scores = [float(s) for s in fn(prompts, completions, **columns)]
        except Exception:  # noqa: BLE001 - a reward function's fault scores 0 and is counted, never crashes the run
            scores = None
    if status["fired"]:
        return no_scores(n, "timeouts")
    if scores is None or len(scores) != n:
        return no_scores(n, "failures")
    counts["nonfinite"] = sum(not math.isfinite(s) for s in scores)
    return [s if math.isfinite(s) else 0.0 for s in scores], counts


@dataclass
class RewardResult:
    """Weighted total per completion, each function's raw scores (0 where faulty), and its fault counts."""

    total: list[float]
    per_function: dict[str, list[float]]
    faults: dict[str, dict[str, int]] = field(default_factory=dict)
    """name → {"failures", "timeouts", "nonfinite"} → completions."""

    def metrics(self) -> dict[str, float]:
        """``reward/<name>/mean`` and the fault counts ``reward/<name>/<fault>`` (sum them across ranks)."""
        out = {}
        for name, scores in self.per_function.items():
            out[f"reward/{name}/mean"] = sum(scores) / max(len(scores), 1)
            for fault in FAULTS:
                out[f"reward/{name}/{fault}"] = float(self.faults.get(name, {}).get(fault, 0))
        return out


def combine(names: list[str], weights: list[float], per_function: dict[str, list[float]],
            faults: dict[str, dict[str, int]]) -> RewardResult:
    """The :class:`RewardResult` of every function's scores over the same completions: ``Σ_i w_i · f_i``."""
    n = len(per_function[names[0]]) if names else 0
    total = [sum(w * per_function[name][j] for name, w in zip(names, weights)) for j in range(n)]
    return RewardResult(total=total, per_function=per_function, faults=faults)


def add_faults(into: dict[str, int], counts: dict[str, int]) -> None:
    for fault in FAULTS:
        into[fault] = into.get(fault, 0) + counts.get(fault, 0)


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
        faults = {name: dict.fromkeys(FAULTS, 0) for name in self.names}
        for name, fn in zip(self.names, self.functions):
            for a, b in chunk_bounds(len(completions)):
                scores, counts = score_chunk(fn, prompts[a:b], completions[a:b],
                                             {k: v[a:b] for k, v in columns.items()}, self.timeout_s)
                per_function[name] += scores
                add_faults(faults[name], counts)
        return combine(self.names, self.weights, per_function, faults)
