"""Multi-turn GRPO rollouts: the ``env`` config group made into an environment pool, chat templates and one
generation batch's trajectories, with their metrics (issue 19).

One generation batch (:func:`rollout_batch`): an :class:`fastgrpo.environments.EnvTurns` over the batch's rows
resets the environments in the reward workers and renders each row's prompt with the tools; the co-located engine
samples ``n`` trajectories per prompt with the handler as its ``turns``: a sample that ends a turn pauses with its KV
pages kept, its tool calls or environment step run in a worker, the observation's template suffix is prefilled
into its own pages and it decodes on. The trajectory's reward is ``env.reward_weight`` × the environment's reward
plus the reward functions on the final transcript (the decoded completion: turns and observations). Advantages
are per trajectory over the GRPO group; the loss mask is 1 on exactly the tokens the policy sampled.

Metrics (per step; every rank logs the same keys; computed in one place, ``EnvTurns.sums`` and
``fastgrpo.environments.turns.env_metrics``): ``env/turns_mean`` and ``env/turns/max``, ``env/tool_calls`` (per
trajectory), ``env/tool_failures/<kind>/sum`` (a kind of :data:`fastgrpo.environments.tools.TOOL_FAULTS`),
``env/failures/<where>/sum`` (reset, step, get_reward, instance_lost, template), ``env/finish/<reason>``
(fractions), ``env/truncated/sum``, ``env/reward_mean``, ``time/env`` and ``time/env_wait``; from the engine's
``last_stats``,
``generation/resume_prefill_tokens/sum`` (the tokens prefilled to resume turns: observations and template suffixes)
next to ``generation/re_prefill_tokens/sum`` (what re-prefilling the whole conversation before each resumed turn
would have cost: what a loop that re-sends the conversation every turn pays).

Memory, for the real run: each paused trajectory keeps its pages (the engine docstring gives the bytes per token);
the handler keeps each conversation's messages as text (~100 KB for 24K tokens). Numerics: the engine's log-probs
at the sampled tokens are the training forward's (the differential harness checks a teacher-forced forward over
the whole sequence to 1e-4); observation tokens have none and no loss.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from fastgrpo.config import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS, Config
from fastgrpo.engine.sampling import SamplingParams


def _load(spec: str, builtins: dict[str, str], field: str):
    """A built-in name or ``"module:attribute"`` → the object; a ``ValueError`` naming ``field`` otherwise."""
    module_name, attr = builtins.get(spec, spec).split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import-time error of the user's module is reported, not raised
        raise ValueError(f"{field}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{field}: {module_name!r} has no callable {attr!r}")
    return obj


def env_objects(cfg: Config):
    """The ``env`` group's factory (one, a dict by name, or None) and tool functions, imported."""
    e = cfg.env
    if e.environments:
        factory = {name: _load(spec, BUILTIN_ENVIRONMENTS, f"env.environments.{name}")
                   for name, spec in e.environments.items()}
    elif e.environment_factory:
        factory = _load(e.environment_factory, BUILTIN_ENVIRONMENTS, "env.environment_factory")
    else:
        factory = None
    return factory, [_load(spec, BUILTIN_TOOLS, f"env.tools[{i}]") for i, spec in enumerate(e.tools)]


def build_environments(cfg: Config, pool, factory, tools):
    """An :class:`fastgrpo.environments.EnvironmentPool` of :func:`env_objects` over the reward ``pool``'s workers
    (built with ``preload=environment_modules(factory, tools)``)."""
    from fastgrpo.environments import EnvironmentPool

    e = cfg.env
    return EnvironmentPool(pool, factory, tools, timeout_s=e.timeout_s or None,
                           max_observation_chars=e.max_observation_chars,
                           max_tool_calls_per_turn=e.max_tool_calls_per_turn)


def build_templates(envs, tokenizer):
    """The chat template of each environment (its tools rendered in the prompt): one, or a dict by name. Raises at
    start-up, naming the template, when it does not preserve the prefix on re-render."""
    from fastgrpo.environments.chat import ChatTemplate

    if envs.multi:
        return {name: ChatTemplate(tokenizer, envs.schemas(name) or None) for name in envs.environments}
    return ChatTemplate(tokenizer, envs.schemas() or None)


def env_rows(rows: list[dict], cfg: Config) -> list[dict]:
    """Dataset rows as the environments see them: ``prompt`` as the chat messages of ``data.prompt_template`` and
    ``data.system_prompt`` (what the single-turn prompt renders), the other columns unchanged."""
    from fastgrpo.data.prompts import prompt_messages

    return [{**r, "prompt": prompt_messages(r["prompt"], cfg.data) if isinstance(r["prompt"], str) else r["prompt"]}
            for r in rows]


def multi_turn_params(params: SamplingParams, cfg: Config, envs) -> SamplingParams:
    """``params`` with the turn limit and the stop strings (``rollout.stop_strings`` and the environment's)."""
    names = list(envs.environments)
    stops = list(cfg.rollout.stop_strings)
    for name in names:
        stops += [s for s in envs.stop_strings(name) if s not in stops]
    return replace(params, max_turns=cfg.rollout.max_turns, stop_strings=tuple(stops))


def generate_trajectories(generate, envs, templates, rows: list[dict], params: SamplingParams):
    """Sample ``params.n`` trajectories per row with ``generate(prompts, params, turns=handler)`` (the trainer's or
    an engine's): ``(prompt ids per row, completions [row][sample], trajectories by (row, sample), the batch's
    env/ sums: EnvTurns.sums)``. The handler's instances are freed whatever happens (``results`` frees them; an
    error, here)."""
    from fastgrpo.environments import EnvTurns

    turns = EnvTurns(envs, templates, rows, params.n)
    try:
        prompts = turns.prompt_ids()
        outs = generate(prompts, params, turns=turns)
        trajectories = turns.results()
    except BaseException:
        turns.close()
        raise
    return prompts, outs, trajectories, turns.sums(outs)
