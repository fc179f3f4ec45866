"""The co-located generation engine: batched sampling with the training model's own parameter tensors.

Public names (load on first use, so importing one engine module does not import them all)::

    from fastgrpo.engine import GenerationEngine, SamplingParams

``GenerationEngine(model, ...).generate(prompts, SamplingParams(...), n=G)`` returns one
:class:`Completion` per sample (token ids, the sampling log-probs, the finish reason); multi-turn rollouts pass a
:class:`TurnHandler` (``generate(..., turns=)``) whose answers are :class:`TurnResult`. The modules and how they
work together: ``docs/architecture.md`` ("The engine").
"""

import importlib

_EXPORTS = {"GenerationEngine": "engine", "SamplingParams": "sampling", "Completion": "sampling",
            "TurnHandler": "sampling", "TurnResult": "sampling"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastgrpo.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fastgrpo.engine.{_EXPORTS[name]}"), name)
