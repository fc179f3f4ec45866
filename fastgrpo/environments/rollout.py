"""Multi-turn GRPO rollouts: the ``env`` config group made into an environment pool, chat templates and one
generation batch's trajectories, with their metrics (issue 19).

One generation batch (:func:`rollout_batch`): an :class:`fastgrpo.environments.EnvTurns` over the batch's rows
resets the environments in the reward workers and renders each row's prompt with the tools; the co-located engine
samples ``n`` trajectories per prompt with the handler as its ``turns``: a sample that ends a turn pauses with its KV
pages kept, its tool calls or environment step run in a worker, the observation's template suffix is prefilled
into its own pages and it decodes on. The trajectory's reward is ``env.reward_weight`` × the environment's reward
plus the reward functions on the final transcript (the decoded completion: turns and observations). Advantages
are per trajectory over the GRPO group; the loss mask is 1 on exactly the tokens the policy sampled.

Metrics (per step; every rank logs the same keys): ``env/turns_mean`` and ``env/turns/max``, ``env/tool_calls``
(per trajectory), ``env/tool_failures/<kind>`` (summed, a kind of :data:`fastgrpo.environments.tools.TOOL_FAULTS`),
``env/failures/<where>`` (reset, step, get_reward, instance_lost, template), ``env/finish/<reason>`` (fractions),
``env/truncated``, ``env/reward_mean``, ``time/env`` and ``time/env_wait``; from the engine's ``last_stats``,
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
from fastgrpo.environments.tools import TOOL_FAULTS

FINISH_REASONS = ("stop", "length", "max_turns", "env_done", "error")
FAILURE_PLACES = ("reset", "step", "get_reward", "instance_lost", "template")


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
    an engine's): ``(prompt ids per row, completions [row][sample], trajectories by (row, sample), the handler's
    metrics)``. The handler's instances are freed whatever happens (``results`` frees them; an error, here)."""
    from fastgrpo.environments import EnvTurns

    turns = EnvTurns(envs, templates, rows, params.n)
    try:
        prompts = turns.prompt_ids()
        outs = generate(prompts, params, turns=turns)
        trajectories = turns.results()
    except BaseException:
        turns.close()
        raise
    reasons = {(i, j): c.finish_reason for i, group in enumerate(outs) for j, c in enumerate(group)}
    return prompts, outs, trajectories, turns.metrics(reasons)


def trajectory_sums(outs, trajectories, handler_metrics: dict[str, float]) -> dict[str, float]:
    """One generation batch's sums for the step's ``env/`` metrics (fixed keys: every rank logs the same ones)."""
    trajs = [trajectories[(i, j)] for i, group in enumerate(outs) for j in range(len(group))]
    completions = [c for group in outs for c in group]
    sums = {"env/turns/sum": float(sum(c.num_turns for c in completions)),
            "env/turns/max": float(max((c.num_turns for c in completions), default=0)),
            "env/tool_calls/sum": float(sum(t.tool_calls for t in trajs)),
            "env/truncated/sum": float(sum(t.truncated for t in trajs)),
            "env/reward/sum": float(sum(t.reward for t in trajs)),
            "time/env": handler_metrics["time/env"], "time/env_wait": handler_metrics["time/env_wait"]}
    for kind in TOOL_FAULTS:
        sums[f"env/tool_failures/{kind}/sum"] = float(sum(t.failures.get(f"tool/{kind}", 0) for t in trajs))
    for place in FAILURE_PLACES:
        sums[f"env/failures/{place}/sum"] = float(sum(n for t in trajs for k, n in t.failures.items()
                                                      if k == place or k.startswith(place + "/")))
    for reason in FINISH_REASONS:
        sums[f"env/finish/{reason}/sum"] = float(sum(c.finish_reason == reason for c in completions))
    return sums


def step_metrics(totals: dict[str, float], n: int) -> dict[str, float]:
    """The step's ``env/`` metrics from the summed batch ``totals`` of ``n`` trajectories (this rank's)."""
    out = {"env/turns_mean": totals["env/turns/sum"] / n, "env/turns/max": totals["env/turns/max"],
           "env/tool_calls": totals["env/tool_calls/sum"] / n, "env/reward_mean": totals["env/reward/sum"] / n,
           "env/truncated/sum": totals["env/truncated/sum"]}
    out.update({k: v for k, v in totals.items() if k.startswith(("env/tool_failures/", "env/failures/"))})
    out.update({f"env/finish/{r}": totals[f"env/finish/{r}/sum"] / n for r in FINISH_REASONS})
    return out
