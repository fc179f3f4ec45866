"""Multi-turn environments and tools for GRPO rollouts (issue 19), run in the reward worker processes.

Two contracts (examples in the README, "Multi-turn: environments and tools"):

- TRL 1.16's ``environment_factory``: a no-argument callable (usually a class) whose instances have
  ``reset(**row) -> str | None`` (the text is appended to the row's last user message), public methods that are the
  model's tools, and optionally ``get_reward() -> float``; any of them may be async. A dict of factories is chosen
  per row by its ``environment`` column. A plain ``tools=[functions]`` list works alone or next to them. Schemas come
  from ``transformers.utils.get_json_schema``.
- The text-step contract (:class:`TextStepEnvironment`, NeMo-RL-like): ``step(turn_text, state) -> (observation,
  reward, done, next_stop_strings)`` with a picklable state that travels with the sample.

Layout: :mod:`.core` (the worker tasks and :class:`EnvironmentPool`), :mod:`.tools` (tool calls: parsed, described,
run), :mod:`.chat` (chat templates: a conversation's prompt ids and the ids after each turn), :mod:`.turns`
(:class:`EnvTurns`, the engine's turn handler, and :class:`Trajectory`), :mod:`.rollout` (the ``env`` config group
made into one generation batch's trajectories), and the built-ins :mod:`.adder`, :mod:`.sliding_puzzle` and
:mod:`.python_code`. Names load on first use, so a worker that imports :mod:`.core` does not import torch (which
:mod:`.turns` brings for the engine's ``TurnResult``).
"""

import importlib

_EXPORTS = {"EnvironmentPool": "core", "TextStepEnvironment": "core", "environment_modules": "core",
            "EnvTurns": "turns", "Trajectory": "turns"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastgrpo.environments' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fastgrpo.environments.{_EXPORTS[name]}"), name)
