"""Environments in the reward worker processes: the tasks a worker runs, and the trainer's handle on them.

The trainer side (:class:`EnvironmentPool`) normalises what the user passed (TRL's ``environment_factory``, a dict
of them, a ``tools`` list, :class:`TextStepEnvironment` classes), renders the tool schemas, and sends each piece of
work to a worker of a :class:`fastgrpo.rewards.pool.RewardPool` through :meth:`RewardPool.run`: the same processes,
hard time limits, kills, respawns and counters as reward chunks. The worker side is the ``_task_*`` functions below
(module-level, sent by name) and the per-worker state they keep:

- ``environment_factory`` instances live in the worker that ran their ``reset``, in a table keyed by trajectory;
  every later task of that trajectory is pinned to that worker. A worker that dies (a hard timeout, a crash, a
  tool calling ``os._exit``) takes its instances with it; the replacement has an empty table, so the trajectory's
  next task answers "lost" and the trajectory ends (finish reason "error", reward 0, counted). Nothing is
  recreated silently. An instance whose trajectory ended is kept for the next ``reset`` (TRL's "construct once,
  reset often").
- A :class:`TextStepEnvironment` is stateless in the worker (one instance per worker and class): its state travels
  with the sample (pickled to the worker with each step and back with the answer), so a step may run on any worker
  and a respawned worker loses nothing. A step that fails leaves the state as it was before it.

Time limits: each reset, tool call, step and ``get_reward`` gets ``timeout_s`` (``reward.timeout_s`` unless given)
as a SIGALRM limit on the worker's main thread; the pool's hard limit (the soft one plus :data:`GRACE_S`; for a turn's
k tool calls 2·k·``timeout_s`` plus it, async calls having 2 × ``timeout_s`` together) kills the worker when code
escapes the soft limit (a C extension, a blocked signal).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastgrpo.environments.tools import ToolCall, ToolResult, cancel_pending, run_tool_calls, tool_schemas, truncate
from fastgrpo.rewards import RewardTimeout, time_limit

GRACE_S = 1.0  # the hard limit of a task = its soft limits + this; then the worker is killed
MAX_OBSERVATION_CHARS = 16_384  # default cut of one tool result / step observation (~4K tokens of English)
MAX_TOOL_CALLS_PER_TURN = 8  # default: calls past this in one turn are answered "too_many" without running
RESERVED = ("reset", "get_reward")  # an environment's public methods other than these are its tools (TRL 1.16)


class TextStepEnvironment(ABC):
    """The text-step contract (NeMo-RL-like), for games and simulators whose whole state fits a picklable dict.

    The class is constructed with no argument once per worker; it keeps nothing between calls. ``reset(**row)``
    returns the text appended to the row's last user message (or None) and the initial state.
    ``step(turn_text, state)`` gets the assistant's turn (its text without its end token: see ``EnvTurns``), updates
    ``state`` in place, and returns ``(observation, reward, done, next_stop_strings)``: the observation as text
    (sent as a user message) or as a non-empty list of chat messages (dicts with a string ``role`` and a ``content``
    that is a string or a list of text parts ``{"type": "text", "text": str}``, joined as one text, as OpenAI's and
    Hugging Face's message formats allow; other keys, such as a tool message's ``name``, are passed to the chat
    template); the turn's reward, a finite number (the trajectory's environment reward is the sum over its turns);
    True to end the trajectory (finish reason "env_done"); the sample's stop strings from now on, a list or tuple
    of non-empty strings, or None to keep them. ``stop_strings`` are the ones of the first turn (the rollout's
    ``SamplingParams.stop_strings``), checked the same way when the pool is built.

    A step that raises or times out gets an error observation and the trajectory goes on; a step whose return
    breaks the contract above (any other content, such as None or an image part; a message without a string role
    or without content; an empty or non-string stop string, or a bare string as stop strings, which would be its
    characters; a reward that is not a finite number) is counted as ``step/malformed`` and ends its trajectory
    ("error", reward 0): there is nothing to show the policy, and the rest of the batch goes on.
    """

    stop_strings: tuple[str, ...] = ()

    def reset(self, **row) -> tuple[str | None, dict]:
        """The text appended to the last user message (None: nothing) and the initial state."""
        return None, {}

    @abstractmethod
    def step(self, turn_text: str, state: dict) -> tuple[str | list[dict], float, bool, Sequence[str] | None]:
        """One turn: ``(observation, reward, done, next_stop_strings)``; ``state`` is updated in place."""


# ---------------------------------------------------------------------- in a worker

_instances: dict[tuple, tuple[object, object]] = {}  # trajectory key -> (factory key, environment instance)
_free: dict[object, list] = {}  # factory key -> instances whose trajectory ended, reset again before a new one
_steppers: dict[type, TextStepEnvironment] = {}  # one instance per TextStepEnvironment class
_loop: asyncio.AbstractEventLoop | None = None  # the worker's event loop, for async tools, reset and get_reward


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    return _loop


def _resolved(value, timeout_s: float):
    """``value``, awaited on the worker's loop when it is awaitable (an async reset or get_reward); interrupted by
    the soft limit, the tasks it left are cancelled."""
    if not inspect.isawaitable(value):
        return value
    loop = _event_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(value, timeout_s))
    except BaseException:
        cancel_pending(loop, timeout_s)
        raise


def _factory_key(factory) -> object:
    return factory if isinstance(factory, type) else pickle.dumps(factory)


def tool_methods(instance) -> dict[str, Callable]:
    """An environment instance's tools as TRL 1.16 finds them: the functions of its class (sync or async) whose
    names neither start with ``_`` nor are ``reset`` / ``get_reward``, bound to the instance."""
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED}


def _guarded(fn: Callable, timeout_s: float):
    """``(value, None, "")`` or ``(None, fault, message)`` for ``fn()`` under the soft limit (fault: "timeout",
    "raised")."""
    with time_limit(timeout_s) as status:
        try:
            out = (fn(), None, "")
        except (RewardTimeout, asyncio.TimeoutError, TimeoutError) as e:
            out = (None, "timeout", f"ran longer than {timeout_s} s" if isinstance(e, RewardTimeout) else str(e))
        except Exception as e:  # noqa: BLE001 - an environment's fault is counted, never the run's
            out = (None, "raised", f"{type(e).__name__}: {e}")
    if status["fired"]:
        return None, "timeout", f"ran longer than {timeout_s} s"
    return out


def _task_reset(key: tuple, factory, row: dict, timeout_s: float) -> tuple[str | None, str | None, str]:
    """A new trajectory's instance, reset with its row and kept in this worker: ``(text, fault, message)``."""

    def run():
        free = _free.get(_factory_key(factory))
        instance = free.pop() if free else factory()
        text = _resolved(instance.reset(**row), timeout_s)
        if text is not None and not isinstance(text, str):
            raise TypeError(f"reset() must return a string or None, got {type(text).__name__}")
        _instances[key] = (_factory_key(factory), instance)
        return text

    return _guarded(run, timeout_s)


def _task_tools(key: tuple | None, tools: list[Callable], calls: list[ToolCall], timeout_s: float,
                max_chars: int) -> list[ToolResult] | None:
    """The turn's tool calls, against the standalone ``tools`` and (``key`` not None) the trajectory's instance;
    None when that instance is not in this worker (it died with a previous worker)."""
    table = {fn.__name__: fn for fn in tools}
    if key is not None:
        entry = _instances.get(key)
        if entry is None:
            return None
        table.update(tool_methods(entry[1]))
    return run_tool_calls(calls, table, timeout_s, max_chars, _event_loop())


def _task_finish(key: tuple, want_reward: bool, timeout_s: float) -> tuple[float | None, str | None, str]:
    """The trajectory ended: its ``get_reward()`` (when wanted), then its instance is freed for reuse;
    ``(reward, fault, message)`` with fault "lost" when the instance is not in this worker."""
    entry = _instances.pop(key, None)
    if entry is None:
        return None, "lost", "the environment instance died with its worker"
    fkey, instance = entry
    out = (None, None, "")
    if want_reward:
        reward, fault, message = _guarded(lambda: float(_resolved(instance.get_reward(), timeout_s)), timeout_s)
        if fault is None and not math.isfinite(reward):
            reward, fault, message = None, "nonfinite", f"get_reward() returned {reward}"
        out = (reward, fault, message)
    _free.setdefault(fkey, []).append(instance)
    return out


def _task_drop(owner: int) -> int:
    """Free every instance of the trajectories of ``owner`` (an EnvTurns that is closing); how many there were."""
    keys = [k for k in _instances if k[0] == owner]
    for k in keys:
        fkey, instance = _instances.pop(k)
        _free.setdefault(fkey, []).append(instance)
    return len(keys)


def _stepper(cls: type) -> TextStepEnvironment:
    if cls not in _steppers:
        _steppers[cls] = cls()
    return _steppers[cls]


def _task_step_reset(cls: type, row: dict, timeout_s: float) -> tuple[tuple | None, str | None, str]:
    """``((text, state), fault, message)`` of a :class:`TextStepEnvironment`'s reset."""

    def run():
        text, state = _stepper(cls).reset(**row)
        if text is not None and not isinstance(text, str):
            raise TypeError(f"reset() must return (str | None, state), got a {type(text).__name__} text")
        pickle.dumps(state)  # it travels with the sample: an unpicklable state fails here, counted
        return text, state

    return _guarded(run, timeout_s)


def _checked_stop_strings(value, what: str) -> tuple[str, ...]:
    """``value``, a list or tuple of non-empty strings, as a tuple; ``ValueError`` naming ``what`` otherwise (a bare
    string would be taken as its characters, and an empty one matches everywhere)."""
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{what} must be a list or tuple of non-empty strings, got {type(value).__name__} "
                         f"{value!r:.80}")
    return tuple(value)


def _content_text(content, where: str) -> str:
    """A message's content as one text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")
    for p in content:
        if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
            got = f"type {p.get('type')!r:.40}" if isinstance(p, dict) else type(p).__name__
            raise ValueError(f"{where}: a content part must be {{'type': 'text', 'text': str}}, got {got}")
    return "".join(p["text"] for p in content)


def _observation(obs) -> str | list[dict]:
    """A step's observation checked (:class:`TextStepEnvironment`): the text, or the messages with text contents."""
    if isinstance(obs, str):
        return obs
    if not isinstance(obs, list) or not obs:
        got = "an empty list" if isinstance(obs, list) else f"a {type(obs).__name__}"
        raise ValueError(f"the observation is {got}, not a string or a non-empty list of messages")
    out = []
    for i, m in enumerate(obs):
        where = f"observation message {i}"
        if not isinstance(m, dict):
            raise ValueError(f"{where} is a {type(m).__name__}, not a dict")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where} needs a non-empty string 'role', got {m.get('role')!r:.40}")
        if "content" not in m:
            raise ValueError(f"{where} has no 'content'")
        out.append({**m, "content": _content_text(m["content"], where)})
    return out


def _step_answer(value) -> tuple[str | list[dict], float, bool, tuple[str, ...] | None]:
    """A step's return checked against the contract (:class:`TextStepEnvironment`), its contents as texts;
    ``ValueError`` saying what breaks it."""
    if not isinstance(value, tuple | list) or len(value) != 4:
        got = f"{len(value)} values" if isinstance(value, tuple | list) else f"a {type(value).__name__}"
        raise ValueError(f"{got}, not (observation, reward, done, next_stop_strings)")
    obs, reward, done, stops = value
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"the reward is a {type(reward).__name__}, not a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"the reward is not finite: {reward}")
    stops = None if stops is None else _checked_stop_strings(stops, "next_stop_strings")
    return _observation(obs), reward, bool(done), stops


def _cut_observation(obs: str | list[dict], max_chars: int) -> tuple[str | list[dict], bool]:
    """The observation with each text cut to ``max_chars`` (:func:`fastgrpo.environments.tools.truncate`), and whether
    any was."""
    if isinstance(obs, str):
        return truncate(obs, max_chars)
    cut = [truncate(m["content"], max_chars) for m in obs]
    return [{**m, "content": c} for m, (c, _) in zip(obs, cut)], any(was for _, was in cut)


def _task_step(cls: type, turn_text: str, state: dict, timeout_s: float, max_chars: int) -> tuple:
    """One step: ``((observation, reward, done, stop_strings, state), fault, message, truncated)``, fault
    "raised", "timeout" or "malformed" (a return that breaks the contract: :func:`_step_answer`'s message); on a
    fault the state is not sent back (the sample keeps the one from before the step)."""

    def run():
        value = _stepper(cls).step(turn_text, state)
        pickle.dumps(state)
        return value

    value, fault, message = _guarded(run, timeout_s)
    if fault is not None:
        return None, fault, message, False
    try:
        obs, reward, done, stops = _step_answer(value)
    except ValueError as e:
        return None, "malformed", f"step() returned a malformed value: {e}", False
    obs, truncated = _cut_observation(obs, max_chars)
    return (obs, reward, done, stops, state), None, "", truncated


# ---------------------------------------------------------------------- in the trainer

@dataclass
class Environment:
    """One environment as the pool runs it: its kind ("tools": a plain tools list; "factory": TRL's
    environment_factory; "step": a TextStepEnvironment class), what builds it, the standalone tools, the schemas
    the chat template renders, and whether it owns a reward (get_reward)."""

    kind: str
    factory: object = None
    tools: list[Callable] = field(default_factory=list)
    schemas: list[dict] = field(default_factory=list)
    has_reward: bool = False


def _check_picklable(obj, what: str) -> None:
    try:
        pickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - lambdas, local classes, bound objects: all fail the same way
        raise ValueError(f"{what} must be importable by the workers (a module-level class or function, or a "
                         f"functools.partial of one): {type(e).__name__}: {e}") from None


def _environment(name, factory, tools: list[Callable]) -> Environment:
    what = "environment_factory" + ("" if name is None else f"[{name!r}]")
    if factory is None:
        return Environment("tools", None, tools, tool_schemas(tools))
    _check_picklable(factory, what)
    if isinstance(factory, type) and issubclass(factory, TextStepEnvironment):
        _checked_stop_strings(factory.stop_strings, f"{what}: {factory.__name__}.stop_strings")
        return Environment("step", factory)
    probe = factory()  # as TRL does: one instance, to find its tools (its class's methods) and check it
    if not callable(getattr(probe, "reset", None)):
        raise ValueError(f"{what}: the environment must define a callable reset (TRL's environment_factory contract)")
    methods = list(tool_methods(probe).values())
    return Environment("factory", factory, tools, tool_schemas(tools + methods),
                       has_reward=callable(getattr(probe, "get_reward", None)))


def environment_modules(environment_factory=None, tools: Sequence[Callable] = ()) -> list[str]:
    """The modules a worker needs for these environments: pass them as ``RewardPool(..., preload=...)`` so the
    worker server imports them once, before it forks (otherwise each worker imports them at its first task)."""
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    objs = [f for f in factories if f is not None] + list(tools)
    modules = ["fastgrpo.environments.tools", __name__]
    for obj in objs:
        module = getattr(obj, "__module__", None) or getattr(getattr(obj, "func", None), "__module__", None)
        if module and module not in modules:
            modules.append(module)
    return modules


class EnvironmentPool:
    """Environments and tools run in the workers of ``pool`` (a :class:`fastgrpo.rewards.pool.RewardPool` with at
    least one worker), with its time limits, kills and respawns.

    ``environment_factory``: TRL 1.16's contract (a no-argument callable returning an instance with
    ``reset(**row) -> str | None``, tools as public methods, an optional ``get_reward() -> float``; any of them may
    be async), a :class:`TextStepEnvironment` subclass, or a dict of these chosen per row by its ``environment``
    column. ``tools``: functions (sync or async) every tool-calling environment also exposes (a text-step one
    reads the turn's text instead); alone, they are TRL's ``tools=[...]``. Factories and tools must be importable
    by the workers (module-level).
    ``timeout_s``: the soft limit of one call (default ``reward.timeout_s``); ``max_observation_chars``: one tool
    result or observation is cut there (counted); ``max_tool_calls_per_turn``: calls beyond it are not run.
    """

    def __init__(self, pool, environment_factory=None, tools: Sequence[Callable] = (), *,
                 timeout_s: float | None = None, max_observation_chars: int = MAX_OBSERVATION_CHARS,
                 max_tool_calls_per_turn: int = MAX_TOOL_CALLS_PER_TURN):
        if pool.num_workers < 1:
            raise ValueError("EnvironmentPool needs reward worker processes (reward.num_workers >= 1)")
        if environment_factory is None and not tools:
            raise ValueError("EnvironmentPool needs an environment_factory or tools")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_observation_chars < 1 or max_tool_calls_per_turn < 1:
            raise ValueError("max_observation_chars and max_tool_calls_per_turn must be >= 1")
        tools = list(tools)
        for t in tools:
            _check_picklable(t, f"tool {getattr(t, '__name__', t)!r}")
        self.pool = pool
        self.timeout_s = timeout_s or pool.cfg.timeout_s
        self.max_observation_chars = max_observation_chars
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.multi = isinstance(environment_factory, dict)
        factories = environment_factory if self.multi else {None: environment_factory}
        if self.multi and not factories:
            raise ValueError("environment_factory: an empty dict")
        self.environments = {name: _environment(name, f, tools) for name, f in factories.items()}

    @property
    def num_workers(self) -> int:
        return self.pool.num_workers

    def schemas(self, name=None) -> list[dict]:
        """The tool schemas of environment ``name`` (None: the single one), for ``ChatTemplate(tokenizer, tools)``."""
        return self.environments[name].schemas

    def stop_strings(self, name=None) -> tuple[str, ...]:
        """The first turn's stop strings of environment ``name``: a TextStepEnvironment's ``stop_strings``, else
        none (for ``SamplingParams.stop_strings``)."""
        env = self.environments[name]
        return tuple(env.factory.stop_strings) if env.kind == "step" else ()

    def _run(self, fn, args, budget_s, done, worker=None) -> None:
        self.pool.run(fn, args, budget_s + GRACE_S, done, worker=worker)

    def reset(self, key: tuple, name, row: dict, worker: int, done) -> None:
        """A factory environment's instance for trajectory ``key``, on ``worker``; ``done((text, fault, msg), f)``."""
        self._run(_task_reset, (key, self.environments[name].factory, row, self.timeout_s), self.timeout_s, done,
                  worker)

    def call_tools(self, key: tuple | None, name, calls: list[ToolCall], worker: int | None, done) -> None:
        """A turn's calls (``key``/``worker`` None: standalone tools, any worker); ``done(results | None, f)``."""
        env = self.environments[name]
        self._run(_task_tools, (key if env.kind == "factory" else None, env.tools, calls, self.timeout_s,
                                self.max_observation_chars), 2 * len(calls) * self.timeout_s, done, worker)

    def finish(self, key: tuple, name, worker: int, done, *, reward: bool = True) -> None:
        """Trajectory ``key`` ended: its reward (if the environment has one and ``reward``), its instance freed."""
        env = self.environments[name]
        self._run(_task_finish, (key, reward and env.has_reward, self.timeout_s), self.timeout_s, done, worker)

    def step_reset(self, name, row: dict, done) -> None:
        self._run(_task_step_reset, (self.environments[name].factory, row, self.timeout_s), self.timeout_s, done)

    def step(self, name, turn_text: str, state: dict, done) -> None:
        self._run(_task_step, (self.environments[name].factory, turn_text, state, self.timeout_s,
                               self.max_observation_chars), self.timeout_s, done)

    def drop(self, owner: int) -> None:
        """Free every instance of ``owner``'s trajectories in every worker (without their rewards)."""
        for w in range(self.num_workers):
            self._run(_task_drop, (owner,), self.timeout_s, lambda answer, fault: None, w)
