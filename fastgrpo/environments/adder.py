"""The adder: the tool of the ``tool-tiny`` demo, as a plain tool and as a TRL ``environment_factory``.

``tools=[add]`` is TRL's plain tools list; :class:`AdderEnvironment` is the same tool on TRL 1.16's
``environment_factory`` contract (a no-argument class, ``reset(**row)``, the tool as a public method, and a
``get_reward()`` from the instance's own record of the calls).
"""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of a and b.
    """
    return a + b


class AdderEnvironment:
    """One rollout of an addition question: ``reset`` keeps the row's ``answer``; ``get_reward`` is 1.0 when a call
    of the ``add`` tool returned it (the tool was used, and used right), else 0.0."""

    def __init__(self):
        self.answer: int | None = None
        self.results: list[int] = []

    def reset(self, answer=None, **row) -> str | None:
        self.answer = None if answer is None else int(answer)
        self.results = []
        return None  # the question is the row's prompt already

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of a and b.
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return float(self.answer is not None and self.answer in self.results)
