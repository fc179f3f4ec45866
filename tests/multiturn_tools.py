"""Tools for tests/test_multiturn.py, importable by the reward workers (module level): a well-behaved one and
hostile ones (raises, hangs past its limit, kills its worker, floods its observation)."""

import os
import time


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def explode(x: int) -> int:
    """Raise an error.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"explode({x})")


def hang(x: int) -> int:
    """Sleep far past any time limit.

    Args:
        x: Anything.
    """
    time.sleep(120)
    return x


def die(x: int) -> int:
    """Kill the worker process that runs it.

    Args:
        x: Anything.
    """
    os._exit(3)


def flood(x: int) -> str:
    """Return a 400,000-character observation (~100K tokens of a BPE tokenizer).

    Args:
        x: Anything.
    """
    return "y" * 400_000
