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
never depends on how the batches were scheduled. A call gets ``reward.timeout_s`` in all (``math`` times each
completion itself, ``reward.timeout_s`` each); when it fails as a whole, each of its completions is scored again
alone, with ``reward.timeout_s`` of its own (``reward/<name>/isolated``). A completion's own fault scores 0 for it
and is counted, never stopping the run: ``reward/<name>/failures`` (the function raised or returned the wrong
number of values on it alone, or its module or ``reward.worker_init`` failed), ``reward/<name>/timeouts`` (past
``reward.timeout_s`` alone) and ``reward/<name>/nonfinite`` (NaN or ±inf). In the training process
(:class:`RewardSet`, ``reward.num_workers=0``) the time limit is a SIGALRM timer on the main thread, which code that
never returns to the interpreter escapes; :class:`fastgrpo.rewards.pool.RewardPool` kills the worker instead.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from fractions import Fraction

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
def parsed_gold(gold: str) -> list:
    """math-verify's parse of a ground truth, once per distinct answer (the G completions of a prompt share it)."""
    from math_verify import parse

    return parse(f"${gold}$", parsing_timeout=None)


_verdicts: dict[tuple[str, str], float] = {}  # math-verify verdicts already computed, (gold, pred) -> 0.0 / 1.0


def clear_caches() -> None:
    """Forget the parsed ground truths and verdicts of this process (benchmarks compare processes from cold)."""
    parsed_gold.cache_clear()
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
        ok = verify(parsed_gold(gold), parse(f"{BOXED}{pred}}}", parsing_timeout=None), timeout_seconds=None)
    if status["fired"]:
        raise RewardTimeout(f"math verification ran longer than {timeout_s} s")
    if len(_verdicts) >= VERDICT_CACHE_SIZE:
        _verdicts.clear()
    _verdicts[key] = 1.0 if ok else 0.0
    return _verdicts[key]


def math_score(completion: str, gold, timeout_s: float) -> float:
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
            out.append(math_score(completion, gold, timeout_s))
        except Exception:  # noqa: BLE001 - one bad verification must not zero the whole batch
            out.append(math.nan)
    return out


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """1 when the completion holds a complete ``\\boxed{...}``."""
    return [0.0 if last_boxed(c) is None else 1.0 for c in completions]


BUILTINS: dict[str, Callable[..., list[float]]] = {"math": math_reward, "format": format_reward}
