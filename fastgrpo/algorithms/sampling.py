"""The one place the config becomes :class:`~fastgrpo.engine.engine.SamplingParams`: a rollout's (GRPO,
distillation) and a validation's (``fastgrpo.eval``, the trainer's avg@k), single-turn; the multi-turn limits (turns,
stop strings) are added on top by ``fastgrpo.environments.rollout.multi_turn_params``.

The length budgets are the stage's (``fastgrpo.config.stage_settings``): ``max_new_tokens`` and
``max_sequence_tokens`` (0: the model's context). The completion-length rule itself is the engine's, one for every
turn (``SamplingParams.response_limit``).
"""

from __future__ import annotations

from fastgrpo.config import Config
from fastgrpo.engine.engine import SamplingParams

SEED_STRIDE = 1_000_003
"""Separates the per-(step, rank) sampling seeds of rollouts: ``(train.seed · SEED_STRIDE + step) · 1024 + rank``."""


def sampling_params(cfg: Config, settings: dict, *, n: int, seed: int, validation: bool = False) -> SamplingParams:
    """``n`` samples per prompt, seeded ``seed``, with the budgets of ``settings`` (a :func:`stage_settings` dict).

    A rollout samples as ``rollout.temperature`` / ``top_p`` / ``top_k`` say; a validation (``validation=True``) as
    ``eval.temperature`` / ``eval.top_p`` (no top-k), at most ``eval.max_new_tokens`` tokens (0: the stage's
    ``max_new_tokens``), within the stage's ``max_sequence_tokens`` too (as NeMo-RL validates)."""
    if validation:
        e = cfg.eval
        temperature, top_p, top_k = e.temperature, e.top_p, 0
        max_new_tokens = e.max_new_tokens or settings["max_new_tokens"]
    else:
        r = cfg.rollout
        temperature, top_p, top_k, max_new_tokens = r.temperature, r.top_p, r.top_k, settings["max_new_tokens"]
    return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          max_sequence_tokens=settings["max_sequence_tokens"] or None, seed=seed)
