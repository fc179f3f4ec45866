"""EnvTurns: the engine's turn handler over an :class:`EnvironmentPool` and a chat template.

One ``EnvTurns`` serves one ``engine.generate`` call (the rows of a rollout, ``n`` samples each)::

    turns = EnvTurns(envs, template, rows, n)
    prompts = turns.prompt_ids()                  # resets the environments, renders each row's prompt
    completions = engine.generate(prompts, params, turns=turns)
    trajectories = turns.results()                # per (prompt, sample): reward, counts, times, finish reason

A generation session (async GRPO, ``fastgrpo.algorithms.async_rollout``) takes one handler for its life, built with
no rows: each batch of rows joins with :meth:`EnvTurns.add` (the session's prompt keys and the handler's row indices
both number the prompts in the order they were added), a group's rewards are asked for as the engine finishes it
(:meth:`EnvTurns.end_group`) and its trajectories handed over, their instances freed and forgotten by
:meth:`EnvTurns.take_group`; a paused turn waits across the session's runs and weight updates like any other pause.
The handler then holds only the rows in flight; :meth:`EnvTurns.close` frees their instances when the session ends.

Per turn (:meth:`start`, called by the engine when a sample pauses at a turn boundary): the turn's text becomes the
assistant message, without its end token. The end token is the turn's last sampled token when it is one of the
tokenizer's special tokens (``all_special_ids``), whatever ended the turn there: an EOS or stop token, or a stop
string completed inside the special token's text (``"<|im_start|>"`` in ``<|im_start|>``). Its text is markup, not
content: the environment does not receive it and the conversation's messages do not hold it, while the sampled ids
keep it (log-prob, loss mask 1, as the policy saw it) and the template's end of turn follows it, less its text when
the end of turn begins with it (:meth:`fastgrpo.environments.chat.ChatTemplate.suffix_ids`). Any other token in whose
text a
stop string completed is content like the rest of the turn (its text may run past the match).

A text-step environment gets the text as is; otherwise its tool calls are parsed
(:func:`fastgrpo.environments.tools.parse_tool_calls` in the template's format) and sent to a worker: the one holding
the
trajectory's instance for an ``environment_factory``, any worker for a plain tools list. A turn without a tool
call ends the trajectory ("stop"); a step that says done ends it ("env_done"); a trajectory whose instance is gone
(its reset failed, or its worker died) ends with "error" and scores 0. Otherwise :meth:`ready` hands back the
template's suffix for the new messages (``template.suffix_ids(messages, new_messages)``: the tool or user messages
and the next generation prompt), which the engine prefills into the sample's pages.

Bounds: a tool result or observation is cut to ``max_observation_chars`` in the worker (so a hostile 100K-token
observation costs at most that through the pipe and the tokenizer; counted in ``env/truncated``), with a note saying
how much was cut; a suffix that still does not fit ``max_sequence_tokens`` ends the trajectory in the engine with
"length". Every fault is an error observation or an "error" finish, counted in ``env/failures/<where>/<kind>``: a
text step that raises or times out is answered with an error observation, one whose return breaks the contract
(``step/malformed``, checked in the worker: :class:`fastgrpo.environments.TextStepEnvironment`) ends its trajectory,
as does a template that cannot render an observation (``template``).
A turn's calls run as one worker task: when its worker dies or is killed in it, a plain tools list answers every
call of the turn with the error (the next turn runs on the replacement), and a factory trajectory ends ("error").

Memory and host time, for the real run (128 prompts × 8 on 8 GPUs: 128 trajectories per rank, up to 24K tokens):
the handler keeps each trajectory's messages as text (~4 characters per token, 1 byte per ASCII character: at
most ~100 KB per trajectory, ~13 MB per rank) and the ids before the current turn; the workers hold the factory
instances (the user's) and send back at most ``max_observation_chars`` per result. Each observation costs the
template's renders of the conversation so far (``ChatTemplate.suffix_ids``: milliseconds for 24K tokens) and one
tokenisation of the suffix alone, on the trainer's thread inside :meth:`ready`; tool-call parsing is a regular
expression over the turn.

Counting (item 7 of issue 19, this side): per trajectory, its turns, tool calls, failures by kind, environment
seconds (the summed latency of its worker tasks) and finish reason. The token counts (observation tokens prefilled,
and what re-prefilling every turn's conversation would cost) are the engine's (``engine.last_stats``), which sees
what was actually appended.
"""

from __future__ import annotations

import functools
import itertools
import queue
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

from fastgrpo.engine.sampling import FINISH_REASONS, TurnResult
from fastgrpo.environments.tools import TOOL_FAULTS, ToolCall, ToolResult, error_content, parse_tool_calls

_owners = itertools.count()
READY_POLL_S = 0.5  # ready(block=True) wakes this often (Ctrl-C is seen while it waits)
FAILURE_PLACES = ("reset", "step", "get_reward", "instance_lost", "template")  # where a Trajectory's failures occur


@dataclass
class Trajectory:
    """One sample's conversation with its environment."""

    env: str | None
    """The environment's name (the row's ``environment`` column with a dict of factories; None otherwise)."""
    messages: list[dict]
    """The conversation: the prompt (with reset's text), then the assistant turns and observations. When the engine
    ended the trajectory after the handler answered ("max_turns", or "length" for a suffix that did not fit), the
    last observation is here but was not appended: the Completion's token_ids are what the policy saw."""
    reward: float = 0.0
    """The environment's reward: ``get_reward()`` (factory), the sum of step rewards (text step); 0 on an error."""
    turns: int = 0
    tool_calls: int = 0
    """Tool calls the model made, readable or not."""
    failures: Counter = field(default_factory=Counter)
    """``"<where>/<kind>"`` -> count: tool/<kind> for :data:`fastgrpo.environments.tools.TOOL_FAULTS`, step/<kind>,
    reset/<kind>, get_reward/<kind> (kinds: raised, timeout, worker_died, nonfinite, mismatch; and for a step,
    malformed: its return broke the contract, the trajectory ends), instance_lost, template (the chat template
    could not append the observation after this turn: the trajectory ends)."""
    truncated: int = 0
    """Observations cut to max_observation_chars."""
    env_s: float = 0.0
    """Summed latency of its environment tasks (submission to answer)."""
    finish: str | None = None
    """"stop", "env_done" or "error" when this handler ended it; None: the engine did (its Completion says why)."""


@dataclass
class _Live:
    """The handler's own bookkeeping of a trajectory that is still running."""

    worker: int
    alive: bool = True  # its instance (factory environments) or its reset is good
    state: dict | None = None  # a text-step environment's state (travels with the sample)
    last_ids: list[int] = field(default_factory=list)  # the tokens just before the current turn (parse prefix)
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) of calls not run
    finishing: bool = False  # its finish task was sent
    end_token: int | None = None  # the special token that ended the current turn (None: it ended with content)


class EnvTurns:
    """The engine's TurnHandler for the rows of one rollout (``n`` samples each) over ``pool``, or for those of a
    generation session, added over time (:meth:`add`, :meth:`take_group`: the module docstring).

    ``template``: a :class:`fastgrpo.environments.chat.ChatTemplate` built with ``pool.schemas()``, or a dict of them by
    environment name (a dict of factories exposes each environment's own tools). ``rows``: the dataset rows; the
    prompt is ``row["prompt"]`` (a string or chat messages), reset gets the row (without ``environment`` when the
    factories are a dict, as TRL passes it).
    """

    def __init__(self, pool, template, rows: list[dict], n: int):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.pool, self.n = pool, n
        self.rows: dict[int, dict] = {}  # index -> the row, until its group is taken (take_group) or the handler ends
        self._templates = template if isinstance(template, dict) else None
        self._template = None if isinstance(template, dict) else template
        self._owner = next(_owners)
        self._trajs: dict[tuple[int, int], Trajectory] = {}
        self._live: dict[tuple[int, int], _Live] = {}
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0  # tasks sent to the workers and not answered yet
        self._awaiting: set[tuple[int, int]] = set()  # trajectories whose turn answer is not handed back yet
        self._first_submit = self._last_answer = None
        self._wait_s = 0.0
        self._special: dict[int, set[int]] = {}  # id(tokenizer) -> its special token ids
        self._prompts: list[list[int]] | None = None
        self._added = 0  # rows registered: the next row's index
        self._held: list[tuple[tuple[int, int], TurnResult]] = []  # answers taken while waiting on resets or rewards
        self._finishing: set[tuple[int, int]] = set()  # trajectories whose finish task is not answered yet
        self._orphans: set[tuple[int, int]] = set()  # factory instances of samples failed at reset ("mismatch")
        self._register(rows)

    def _register(self, rows: list[dict]) -> range:
        """Rows checked, then given the next indices (their trajectories created); returns those indices."""
        names = [row.get("environment") if self.pool.multi else None for row in rows]
        for i, name in enumerate(names, start=self._added):
            if name not in self.pool.environments:
                raise ValueError(f"row {i}: environment={name!r} is not among the environments "
                                 f"{list(self.pool.environments)}")
        first = self._added
        for i, (row, name) in enumerate(zip(rows, names), start=first):
            self.rows[i] = dict(row)
            for j in range(self.n):
                self._trajs[(i, j)] = Trajectory(name, self._prompt_messages(row))
                self._live[(i, j)] = _Live(worker=(i * self.n + j) % self.pool.num_workers)
        self._added += len(rows)
        return range(first, self._added)

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _prompt_messages(row: dict) -> list[dict]:
        prompt = row.get("prompt", [{"role": "user", "content": ""}])
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    def template(self, name):
        """The chat template of environment ``name``."""
        return self._template if self._templates is None else self._templates[name]

    def _reset_kwargs(self, row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "environment"} if self.pool.multi else row

    def prompt_ids(self) -> list[list[int]]:
        """Reset every trajectory's environment (in the workers, all at once) and render each row's prompt: the
        token ids to give the engine, one list per row. A row's samples share their prompt: a sample whose reset
        failed, or returned a different text than the row's first good one, ends at its first turn ("error",
        counted as ``reset/<kind>``). Once per handler: later calls return the same prompts."""
        if self._prompts is None:
            self._prompts = self._reset(range(self._added))
        return self._prompts

    def add(self, rows: list[dict]) -> list[list[int]]:
        """Rows that join while the engine runs (a generation session's prompts, whose keys go on from the rows
        before: build the handler with no rows and add each batch in the session's order): given the next indices,
        their environments reset and their prompts rendered as :meth:`prompt_ids` does; one list of ids per row.
        Blocks until their resets are answered; answers for other trajectories that arrive meanwhile are handed to
        the engine by the next :meth:`ready`."""
        return self._reset(self._register(rows))

    def _reset(self, indices: range) -> list[list[int]]:
        """Reset the trajectories of the rows ``indices`` (all at once) and render each row's prompt."""
        pending = set()
        for i in indices:
            for j in range(self.n):
                key, tr = (i, j), self._trajs[(i, j)]
                env = self.pool.environments[tr.env]
                row = self._reset_kwargs(self.rows[i])
                if env.kind == "factory":
                    self._submit(key, "reset", self.pool.reset, (self._owner, *key), tr.env, row,
                                 self._live[key].worker)
                elif env.kind == "step":
                    self._submit(key, "reset", self.pool.step_reset, tr.env, row)
                else:
                    continue
                pending.add(key)
        answers = {}
        while pending:
            item = self._next_arrival(block=True)
            key, kind, answer, fault, latency = item
            if kind != "reset":  # another trajectory's turn or reward (a session's rows added mid-run)
                self._hold(item)
                continue
            self._trajs[key].env_s += latency
            answers[key] = (answer, fault)
            pending.discard(key)
        prompts = []
        for i in indices:
            texts = {}
            for j in range(self.n):
                key = (i, j)
                if key not in answers:
                    continue
                answer, fault = answers[key]
                if fault is None and answer[1] is None:  # (value, fault, message)
                    value = answer[0]
                    text, state = value if self.pool.environments[self._trajs[key].env].kind == "step" else (value,
                                                                                                           None)
                    texts[key] = text
                    self._live[key].state = state
                else:
                    self._fail(key, f"reset/{_kind(fault) if fault else answer[1]}")
            first = next(iter(texts.values()), None)
            for key, text in texts.items():
                if text != first:
                    self._fail(key, "reset/mismatch")
                    self._orphans.add(key)
            messages = self._trajs[(i, 0)].messages
            if first is not None:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + first}
            ids = self.template(self._trajs[(i, 0)].env).prompt_ids(messages)
            for j in range(self.n):
                tr, lv = self._trajs[(i, j)], self._live[(i, j)]
                tr.messages = [dict(m) for m in messages]
                lv.last_ids = ids
            prompts.append(ids)
        self._prompts = prompts
        return prompts

    def _fail(self, key, kind: str) -> None:
        self._trajs[key].failures[kind] += 1
        self._live[key].alive = False

    # ------------------------------------------------------------------ the TurnHandler protocol

    def start(self, key: tuple[int, int], turn_ids: list[int], turn_text: str) -> None:
        """Sample ``key`` ended a turn (see the engine's TurnHandler); its work goes to a worker, or its answer is
        known at once (a turn without tool calls, a dead instance, calls that could not be read)."""
        tr, lv = self._trajs[key], self._live[key]
        env = self.pool.environments[tr.env]
        template = self.template(tr.env)
        tokenizer = template.tok
        if id(tokenizer) not in self._special:
            self._special[id(tokenizer)] = set(tokenizer.all_special_ids)
        text, lv.end_token = turn_text, None
        if turn_ids and turn_ids[-1] in self._special[id(tokenizer)]:  # the end token is not content (module doc)
            lv.end_token = turn_ids[-1]
            text = text.removesuffix(tokenizer.decode([turn_ids[-1]]))
        tr.turns += 1
        tr.messages.append({"role": "assistant", "content": text})
        self._awaiting.add(key)
        if not lv.alive:
            self._arrivals.put((key, "end", "error", None, 0.0))
            return
        if env.kind == "step":
            self._submit(key, "step", self.pool.step, tr.env, text, lv.state)
            return
        fmt = template.tool_call_format()
        prefix = tokenizer.decode(lv.last_ids) if fmt == "parse_response" else ""
        calls, errors = parse_tool_calls(text, fmt, tokenizer, prefix=prefix, tools=env.schemas)
        limit = self.pool.max_tool_calls_per_turn
        lv.errors = [("malformed", e) for e in errors] + [
            ("too_many", f"Tool call {c.name} not run: more than {limit} tool calls in one turn")
            for c in calls[limit:]]
        lv.calls = calls[:limit]
        tr.tool_calls += len(calls) + len(errors)
        if not lv.calls and not lv.errors:
            self._arrivals.put((key, "end", "stop", None, 0.0))
        elif not lv.calls:
            self._arrivals.put((key, "tools", [], None, 0.0))
        elif env.kind == "factory":
            self._submit(key, "tools", self.pool.call_tools, (self._owner, *key), tr.env, lv.calls, lv.worker)
        else:
            self._submit(key, "tools", self.pool.call_tools, None, tr.env, lv.calls, None)

    def ready(self, block: bool) -> list[tuple[tuple[int, int], TurnResult]]:
        """The turn answers available now; ``block``: wait for at least one while any is outstanding."""
        out, self._held = self._held, []
        while True:
            waiting = block and not out and self._awaiting
            start = time.perf_counter()
            item = self._next_arrival(block=bool(waiting))
            if waiting:
                self._wait_s += time.perf_counter() - start
            if item is None:
                return out
            result = self._handle(*item)
            if result is not None:
                out.append(result)

    def results(self) -> dict[tuple[int, int], Trajectory]:
        """Every trajectory, once the generate call is over: the rewards of the trajectories the engine ended are
        collected now (their ``get_reward()`` in their workers, all at once)."""
        for key in self._trajs:
            self._finish(key)
        while self._in_flight or not self._arrivals.empty():
            item = self._next_arrival(block=True)
            if item is not None:
                self._handle(*item)
        self.close()  # a sample dropped at its reset (a text unlike its group's) still holds an instance
        return dict(self._trajs)

    def end_group(self, i: int) -> None:
        """The engine finished every sample of row ``i`` (a session's group): the rewards of those it ended are
        asked for now (their ``get_reward()`` runs in the workers while the engine decodes on), as :meth:`results`
        does for every row; returns at once."""
        for j in range(self.n):
            self._finish((i, j))

    def take_group(self, i: int) -> list[Trajectory]:
        """Row ``i``'s trajectories (its samples in order) once the engine has finished them all: waits for their
        rewards (:meth:`end_group`), then forgets them and frees their instances (an instance dropped at its reset,
        without its reward), so that a session's handler holds only the rows in flight. Answers for other
        trajectories that arrive meanwhile are handed to the engine by the next :meth:`ready`."""
        keys = [(i, j) for j in range(self.n)]
        self.end_group(i)
        while self._finishing.intersection(keys):
            self._hold(self._next_arrival(block=True))
        for key in self._orphans.intersection(keys):
            self._orphans.discard(key)
            self.pool.finish((self._owner, *key), self._trajs[key].env, self._live[key].worker,
                             lambda answer, fault: None, reward=False)
        for key in keys:
            del self._live[key]
        del self.rows[i]
        return [self._trajs.pop(key) for key in keys]

    def lap(self) -> dict[str, float]:
        """``time/env`` and ``time/env_wait`` (:meth:`sums`) since the last lap, and a new lap begins (a session's
        handler serves many steps: each step logs its own)."""
        out = self._times()
        self._first_submit = self._last_answer = None
        self._wait_s = 0.0
        return out

    def close(self) -> None:
        """Free, in every worker, the instances of this handler's trajectories that were not finished (after an
        error in the caller; :meth:`results` calls it too)."""
        if any(self.pool.environments[t.env].kind == "factory" for t in self._trajs.values()):
            self.pool.drop(self._owner)

    # ------------------------------------------------------------------ answers

    def _submit(self, key, kind: str, method, *args) -> None:
        now = time.perf_counter()
        self._first_submit = self._first_submit or now
        method(*args, functools.partial(self._arrive, key, kind, now))
        self._in_flight += 1  # after: a pool that refused the task never answers (only this thread reads it)

    def _arrive(self, key, kind: str, submitted: float, answer, fault) -> None:
        """A worker task answered (on a supervisor thread: only a queue put)."""
        self._arrivals.put((key, kind, answer, fault, time.perf_counter() - submitted, True))

    def _next_arrival(self, block: bool):
        """The next arrival as (key, kind, answer, fault, latency), or None (none now, or none can come)."""
        while True:
            try:
                item = self._arrivals.get(timeout=READY_POLL_S) if block else self._arrivals.get_nowait()
            except queue.Empty:
                if block and self.pool.pool.closed:
                    raise RuntimeError("the reward pool was closed while environment tasks were running") from None
                if block and (self._in_flight or not self._arrivals.empty()):
                    continue
                return None
            if len(item) == 6:  # from a worker
                self._in_flight -= 1
                self._last_answer = time.perf_counter()
                item = item[:5]
            return item

    def _hold(self, item) -> None:
        """Handle an arrival taken outside :meth:`ready`; a turn answer waits there for the engine."""
        result = self._handle(*item)
        if result is not None:
            self._held.append(result)

    def _handle(self, key, kind: str, answer, fault, latency: float):
        tr = self._trajs[key]
        tr.env_s += latency
        if kind == "finish":
            self._finishing.discard(key)
            self._finished(tr, answer, fault)
            return None
        self._awaiting.discard(key)
        if kind == "end":
            return key, self._end(key, answer)
        if kind == "step":
            return key, self._after_step(key, answer, fault)
        return key, self._after_tools(key, answer, fault)

    def _end(self, key, reason: str) -> TurnResult:
        self._trajs[key].finish = reason
        if reason == "error":
            self._trajs[key].reward = 0.0  # a text step's rewards so far included (a factory's: at its finish)
        self._finish(key)
        return TurnResult(append_ids=[], finish=reason)

    def _finish(self, key) -> None:
        """Send a factory trajectory's finish task (its get_reward, then its instance freed) once."""
        tr, lv = self._trajs[key], self._live[key]
        if self.pool.environments[tr.env].kind == "factory" and lv.alive and not lv.finishing:
            lv.finishing = True
            self._finishing.add(key)
            self._submit(key, "finish", self.pool.finish, (self._owner, *key), tr.env, lv.worker)

    def _finished(self, tr: Trajectory, answer, fault) -> None:
        reward, kind, _ = answer if fault is None else (None, _kind(fault), "")
        if kind == "lost":
            tr.failures["instance_lost"] += 1
        elif kind is not None:
            tr.failures[f"get_reward/{kind}"] += 1
        tr.reward = reward if reward is not None and tr.finish != "error" else 0.0

    def _after_tools(self, key, answer: list[ToolResult] | None, fault) -> TurnResult:
        tr, lv = self._trajs[key], self._live[key]
        if fault is not None or answer is None:
            if self.pool.environments[tr.env].kind == "factory":  # the instance died with its worker
                if fault is not None:
                    tr.failures[f"tool/{_kind(fault)}"] += len(lv.calls)
                tr.failures["instance_lost"] += 1
                lv.alive = False
                return self._end(key, "error")
            kind = _kind(fault)
            why = "ran past the time limit" if kind == "timeout" else "crashed its worker"
            answer = [ToolResult(c.name, error_content(f"Tool {c.name} {why}"), kind) for c in lv.calls]
        for r in answer:
            if r.fault:
                tr.failures[f"tool/{r.fault}"] += 1
            tr.truncated += r.truncated
        for kind, _ in lv.errors:
            tr.failures[f"tool/{kind}"] += 1
        new = [{"role": "tool", "name": r.name, "content": r.content} for r in answer] + [
            {"role": "tool", "name": "unknown", "content": error_content(message)} for _, message in lv.errors]
        return self._append(key, new, None)

    def _after_step(self, key, answer, fault) -> TurnResult:
        tr, lv = self._trajs[key], self._live[key]
        if fault is not None or answer[1] is not None:
            kind, message = (_kind(fault), "the environment's worker died or hung") if fault else answer[1:3]
            tr.failures[f"step/{kind}"] += 1
            if kind == "malformed":  # nothing to show the policy: the environment broke its contract
                warnings.warn(f"{message}; the trajectory ends (\"error\") and counts in env/failures/step/malformed",
                              RuntimeWarning, stacklevel=1)  # here: the default filter shows each message once
                return self._end(key, "error")
            return self._append(key, [{"role": "user", "content": error_content(f"environment step failed: "
                                                                                f"{message}")}], None)
        (obs, reward, done, stops, state), _, _, truncated = answer
        tr.reward += reward
        tr.truncated += truncated
        lv.state = state
        if done:
            return self._end(key, "env_done")
        new = [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
        return self._append(key, new, stops)

    def _append(self, key, new: list[dict], stops) -> TurnResult:
        tr, lv = self._trajs[key], self._live[key]
        try:
            ids = self.template(tr.env).suffix_ids(tr.messages, new, end_token=lv.end_token)
        except ValueError:  # the template re-rendered the conversation (the sampled text broke its prefix), or
            # cannot render the new messages (a role it refuses)
            tr.failures["template"] += 1
            return self._end(key, "error")
        tr.messages.extend(new)
        lv.last_ids = ids
        return TurnResult(append_ids=ids, stop_strings=stops)

    # ------------------------------------------------------------------ metrics

    def sums(self, completions) -> dict[str, float]:
        """This call's sums of the ``env/`` metrics (the one place they are computed; :func:`env_metrics` makes
        them the logged values), from the engine's ``completions`` (``[prompt][sample]``: turns and finish reasons
        as the engine counts them) and this handler's trajectories (tool calls, truncations, rewards, failures):
        :func:`trajectory_sums`, with ``time/env`` (first task sent → last answer) and ``time/env_wait`` (time
        :meth:`ready` blocked)."""
        trajs = [[self._trajs[(i, j)] for j in range(len(group))] for i, group in enumerate(completions)]
        return {**trajectory_sums(completions, trajs), **self._times()}

    def _times(self) -> dict[str, float]:
        return {"time/env": (self._last_answer - self._first_submit) if self._first_submit and self._last_answer
                else 0.0, "time/env_wait": self._wait_s}

    def metrics(self, completions) -> dict[str, float]:
        """The logged ``env/`` metrics of this call alone: :func:`env_metrics` of :meth:`sums`."""
        return env_metrics(self.sums(completions), sum(len(group) for group in completions))


def trajectory_sums(completions, trajectories) -> dict[str, float]:
    """The ``env/`` sums (:meth:`EnvTurns.sums`, less the times) of the ``completions`` and their ``trajectories``
    (both ``[prompt][sample]``; a session's groups as :meth:`EnvTurns.take_group` hands them over). The keys are
    fixed (every rank logs the same ones): sums over trajectories and ``env/turns/max``."""
    trajs = [t for group in trajectories for t in group]
    flat = [c for group in completions for c in group]
    sums = {"env/turns/sum": float(sum(c.num_turns for c in flat)),
            "env/turns/max": float(max((c.num_turns for c in flat), default=0)),
            "env/tool_calls/sum": float(sum(t.tool_calls for t in trajs)),
            "env/truncated/sum": float(sum(t.truncated for t in trajs)),
            "env/reward/sum": float(sum(t.reward for t in trajs))}
    for kind in TOOL_FAULTS:
        sums[f"env/tool_failures/{kind}/sum"] = float(sum(t.failures.get(f"tool/{kind}", 0) for t in trajs))
    for place in FAILURE_PLACES:
        sums[f"env/failures/{place}/sum"] = float(sum(n for t in trajs for k, n in t.failures.items()
                                                      if k == place or k.startswith(place + "/")))
    for reason in FINISH_REASONS:
        sums[f"env/finish/{reason}/sum"] = float(sum(c.finish_reason == reason for c in flat))
    return sums


def env_metrics(totals: dict[str, float], n: int) -> dict[str, float]:
    """The ``env/`` metrics from :meth:`EnvTurns.sums` (added over a step's generation batches) of ``n``
    trajectories: ``env/turns_mean``, ``env/turns/max``, ``env/tool_calls`` and ``env/reward_mean`` (per
    trajectory), ``env/truncated/sum``, ``env/tool_failures/<kind>/sum`` (a kind of
    :data:`fastgrpo.environments.tools.TOOL_FAULTS`), ``env/failures/<where>/sum`` (a place of
    :data:`FAILURE_PLACES`), ``env/finish/<reason>`` (fractions of ``n``), ``time/env`` and ``time/env_wait``."""
    out = {"env/turns_mean": totals["env/turns/sum"] / n, "env/turns/max": totals["env/turns/max"],
           "env/tool_calls": totals["env/tool_calls/sum"] / n, "env/reward_mean": totals["env/reward/sum"] / n,
           "env/truncated/sum": totals["env/truncated/sum"], "time/env": totals["time/env"],
           "time/env_wait": totals["time/env_wait"]}
    out.update({k: v for k, v in totals.items() if k.startswith(("env/tool_failures/", "env/failures/"))})
    out.update({f"env/finish/{r}": totals[f"env/finish/{r}/sum"] / n for r in FINISH_REASONS})
    return out


def _kind(fault: str) -> str:
    """The pool's fault names ("timeouts": past the hard limit, "failures": the worker died) as failure kinds."""
    return {"timeouts": "timeout", "failures": "worker_died"}.get(fault, fault)
