"""What an algorithm needs done before the trainer builds it.

An algorithm class may define ``prerequisites(cfg) -> list[RecipeRun]``: runs of shipped recipes that the trainer
completes, in this process and on every rank together, before it builds the algorithm (distillation's
``distill.teacher_recipe`` trains its teacher this way). An algorithm never builds or runs a trainer itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecipeRun:
    """Run ``spec`` (a shipped recipe name, then optional ``group.field=value`` overrides, shell-quoted) to its last
    step with ``output_dir`` as its run directory (a run interrupted earlier there is resumed); ``why`` names the
    config field that asked for it."""

    spec: str
    output_dir: str
    why: str


def no_prerequisites(cfg) -> list[RecipeRun]:
    """The default: nothing to run first."""
    return []
