"""Environments in the reward workers, driven through EnvTurns as the engine drives it (start / ready): TRL 1.16's
environment_factory contract (stateful instances pinned to their worker, async tools, get_reward, reset's text in
the prompt), a dict of factories routed by the ``environment`` column, a plain tools list, the text-step contract
(state that survives the death of every worker), and hostile environments: a tool or step that raises, hangs past
its soft limit, hangs past the hard one, kills its worker (os._exit, SIGKILL), returns a 100K-token observation, or
a model that emits malformed calls. Each is counted and bounded, and the run goes on.

One pool (2 workers, 0.3 s per call) is shared by the module: its server starts once (about a second here). The
conversations go through the tiny model's tokenizer and chat template (``fastgrpo.environments.chat.ChatTemplate``), so
every
appended suffix is the real one and a whole trajectory's ids are checked against the template's rendering.
"""

import re
import string
import textwrap
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgrpo.config import RewardConfig
from fastgrpo.data.puzzle_boards import generate, neighbours, optimal_moves, render, solved
from fastgrpo.engine.sampling import Completion
from fastgrpo.environments import EnvironmentPool, EnvTurns, environment_modules
from fastgrpo.environments.adder import AdderEnvironment, add
from fastgrpo.environments.chat import ChatTemplate
from fastgrpo.environments.core import GRACE_S
from fastgrpo.environments.sliding_puzzle import SlidingPuzzle
from fastgrpo.models.loading import build_tiny_tokenizer
from fastgrpo.rewards.pool import RewardPool

TIMEOUT_S = 0.3
MAX_CHARS = 1000
USER_MODULE = '''
    import asyncio, os, signal, time, zlib

    from fastgrpo.environments.core import TextStepEnvironment


    class Counter:
        """A stateful environment: the counter lives in the worker that ran reset."""

        def __init__(self):
            self.n = 0

        def reset(self, start=0, **row):
            self.n = int(start)
            return f" Start at {self.n}; columns {sorted(row)}."

        def incr(self, by: int) -> int:
            """Add to the counter.

            Args:
                by: The amount.
            """
            self.n += by
            return self.n

        async def double(self, x: int) -> int:
            """Double a number, asynchronously.

            Args:
                x: The number.
            """
            await asyncio.sleep(0.05)
            return 2 * x

        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return float(self.n)


    class Hostile:
        """Tools that misbehave in every way a tool can."""

        def reset(self, mode="", **row):
            if mode == "raise":
                raise RuntimeError("reset failed")
            if mode == "hang":
                time.sleep(60)
            return None

        def ok(self) -> str:
            """Answer."""
            return "fine"

        def boom(self) -> str:
            """Raise."""
            raise RuntimeError("boom")

        def nap(self) -> str:
            """Sleep past the soft limit."""
            time.sleep(60)
            return "awake"

        def stuck(self) -> str:
            """Block the soft limit's signal, then hang: only the pool's hard limit stops it."""
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)
            return "unreachable"

        def die(self) -> str:
            """Exit the worker."""
            os._exit(3)

        def sigkill(self) -> str:
            """SIGKILL the worker."""
            os.kill(os.getpid(), signal.SIGKILL)
            return "unreachable"

        def flood(self) -> str:
            """About 100K tokens."""
            return "word " * 100_000

        def get_reward(self) -> float:
            return 1.0


    class Chaos(TextStepEnvironment):
        """Misbehaves as a hash of the turn's text says (the engine's tiny random model picks the text)."""

        def reset(self, **row):
            return None, {"steps": 0}

        def step(self, turn_text, state):
            kind = zlib.crc32(turn_text.encode()) % 6
            if kind == 0:
                raise RuntimeError("chaos")
            if kind == 1:
                time.sleep(60)
            if kind == 2:
                os._exit(2)
            state["steps"] += 1
            if kind == 3:
                return "y" * 100_000, 0.5, False, None  # 100K tokens of the character tokenizer
            if kind == 4:
                return "bye", 1.0, True, None
            return f"ok {state['steps']}", 0.25, False, None


    def wedge() -> str:
        """Hang where the soft limit cannot reach."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
        return "unreachable"


    def crash() -> str:
        """Exit the worker."""
        os._exit(5)


    class Lazy:
        """An async get_reward that may never finish."""

        def reset(self, slow=False, **row):
            self.slow = slow

        async def get_reward(self) -> float:
            if self.slow:
                await asyncio.sleep(60)
            await asyncio.sleep(0)
            return 2.0


    class Moody:
        def reset(self, **row):
            return f" I am {os.getpid()}"


    class Steps(TextStepEnvironment):
        """A text-step environment that misbehaves on request; its state counts the steps that completed."""

        stop_strings = ("STOP",)

        def reset(self, **row):
            return " go", {"steps": 0}

        def step(self, turn_text, state):
            state["steps"] += 1  # before any fault: a failed step must not keep it
            if "RAISE" in turn_text:
                raise ValueError("step failed")
            if "HANG" in turn_text:
                time.sleep(60)
            if "STUCK" in turn_text:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                time.sleep(60)
            if "DIE" in turn_text:
                os._exit(1)
            if "FLOOD" in turn_text:
                return "x " * 100_000, 0.25, False, None
            if "DONE" in turn_text:
                return "bye", 1.0, True, None
            return f"step {state['steps']}", 0.5, False, ["STOP", "END"]


    class Made:
        """Counts the instances its worker has made (reset says how many): a freed instance is reused."""

        made = 0

        def __init__(self):
            Made.made += 1

        def reset(self, **row):
            return f" made {Made.made}"

        def ping(self) -> str:
            """Answer."""
            return "pong"

        def get_reward(self) -> float:
            return 1.0
'''


TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


def templates(envs: EnvironmentPool):
    """The tiny model's chat template with each environment's tools (a dict of them for a dict of factories)."""
    t = {name: ChatTemplate(TOKENIZER, tools=envs.schemas(name) or None) for name in envs.environments}
    return t if envs.multi else t[None]


def tool_reply(*contents: str, eos: bool = True) -> str:
    """The suffix after a turn answered by tool messages (the tiny template's rendering)."""
    return ("" if eos else "<|endoftext|>") + "".join(
        f"<|tool|><tool_response>\n{c}\n</tool_response>" for c in contents) + "<|assistant|>"


def user_reply(text: str, eos: bool = True) -> str:
    return ("" if eos else "<|endoftext|>") + f"<|user|>{text}<|assistant|>"


def call(name, **arguments) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module")
def envs_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs")
    (path / "env_user.py").write_text(textwrap.dedent(USER_MODULE))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(path))  # before the pool: its server takes the trainer's sys.path
        import env_user

        yield env_user


@pytest.fixture(scope="module")
def pool(envs_module):
    factories = {"count": envs_module.Counter, "hostile": envs_module.Hostile, "steps": envs_module.Steps,
                 "adder": AdderEnvironment, "puzzle": SlidingPuzzle}
    p = RewardPool(RewardConfig(functions=["format"], timeout_s=TIMEOUT_S), 2,
                   preload=environment_modules(factories, [add]))
    yield p
    p.close()


def environments(pool, factory, tools=(), **kw):
    return EnvironmentPool(pool, factory, tools, **{"max_observation_chars": MAX_CHARS, **kw})


class Driver:
    """Plays the engine: each ``turn`` starts a sample's turn (its text + EOS sampled) and blocks for its answer,
    keeping every sample's token sequence (prompt, then turns and appended ids) and its finish reason."""

    def __init__(self, turns: EnvTurns):
        self.turns, self.tok = turns, TOKENIZER
        self.seq = {}
        self.finish = {}
        self.prompt_len = {}
        self.num_turns = Counter()
        for i, ids in enumerate(turns.prompt_ids()):
            for j in range(turns.n):
                self.seq[(i, j)] = list(ids)
                self.prompt_len[(i, j)] = len(ids)

    def turn(self, key, text: str, eos: bool = True):
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + ([EOS] if eos else [])
        self.turns.start(key, ids, self.tok.decode(ids))
        self.seq[key] += ids
        self.num_turns[key] += 1
        while True:
            got = dict(self.turns.ready(block=True))
            if key in got:
                break
        result = got[key]
        if result.finish is not None:
            self.finish[key] = result.finish
        else:
            self.seq[key] += result.append_ids
        return result

    def completions(self, engine_reasons: dict | None = None) -> list[list[Completion]]:
        """The engine's output for these trajectories: the handler's finish, else ``engine_reasons[key]`` (the
        engine ended it), with the turns this driver sampled."""
        out = []
        for i in range(len(self.turns.prompt_ids())):
            group = []
            for j in range(self.turns.n):
                ids = self.seq[(i, j)][self.prompt_len[(i, j)]:]
                reason = self.finish.get((i, j)) or (engine_reasons or {})[(i, j)]
                group.append(Completion(ids, [0.0] * len(ids), reason, num_turns=self.num_turns[(i, j)]))
            out.append(group)
        return out


def test_trl_environment_factory_keeps_state_on_its_worker(pool, envs_module):
    """Counter's state persists across turns (instance on its worker), async tools and get_reward, reset's text
    appended to the last user message, several calls per turn; the sequence is exactly the template's rendering
    of the conversation (observation tokens = the suffixes)."""
    envs = environments(pool, envs_module.Counter)
    assert [s["function"]["name"] for s in envs.schemas()] == ["double", "incr"]  # reset, get_reward: not tools
    rows = [{"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "count"}], "start": 5},
            {"prompt": "again", "start": 1}]
    turns = EnvTurns(envs, templates(envs), rows, n=2)
    d = Driver(turns)
    prompt = TOKENIZER.decode(d.seq[(0, 0)])
    assert prompt.startswith("<|system|>sys\n\n<tools>\n") and "\nincr(by: integer)" in prompt
    assert prompt.endswith("</tools><|user|>count Start at 5; columns ['prompt'].<|assistant|>")
    r = d.turn((0, 0), "let me " + call("incr", by=2) + call("double", x=21))
    assert r.finish is None and r.stop_strings is None
    assert TOKENIZER.decode(r.append_ids) == tool_reply("7", "42")
    d.turn((0, 0), call("incr", by=3))
    d.turn((0, 1), call("incr", by=100))
    assert d.turn((0, 0), "done").finish == "stop"
    d.turn((1, 0), call("double", x=1) + call("incr", by=1))
    res = turns.results()  # (0, 1) and (1, *) were ended by "the engine": their rewards are collected here
    assert {k: t.reward for k, t in res.items()} == {(0, 0): 10.0, (0, 1): 105.0, (1, 0): 2.0, (1, 1): 1.0}
    assert {k: t.finish for k, t in res.items()} == {(0, 0): "stop", (0, 1): None, (1, 0): None, (1, 1): None}
    t = res[(0, 0)]
    assert (t.turns, t.tool_calls, sum(t.failures.values()), t.truncated) == (3, 3, 0, 0)
    template = turns.template(None)
    for key, tr in res.items():
        if tr.finish is None:
            tr.messages.append({"role": "assistant", "content": ""})  # the engine ended it: close the last turn
            d.seq[key].append(EOS)
        assert d.seq[key] == template.ids(template.render(tr.messages, False)), key  # the same ids, token by token
    m = turns.metrics(d.completions({(0, 1): "length", (1, 0): "max_turns", (1, 1): "length"}))
    assert (m["env/finish/stop"], m["env/finish/length"], m["env/finish/max_turns"]) == (0.25, 0.5, 0.25)
    assert m["env/finish/error"] == m["env/finish/env_done"] == 0
    assert m["env/turns/max"] == 3 and m["env/turns_mean"] == (3 + 1 + 1 + 0) / 4
    assert m["env/tool_calls"] == 6 / 4 and m["env/reward_mean"] == 118 / 4 and m["env/truncated/sum"] == 0
    failures = {k: v for k, v in m.items() if k.startswith(("env/failures/", "env/tool_failures/"))}
    assert len(failures) == 12 and not any(failures.values())  # every place and tool fault logged; none failed
    assert m["time/env"] > 0 and m["time/env_wait"] > 0


def test_a_dict_of_factories_routes_rows_and_exposes_each_environments_tools(pool, envs_module):
    envs = environments(pool, {"count": envs_module.Counter, "adder": AdderEnvironment, "puzzle": SlidingPuzzle},
                        [add])
    assert [s["function"]["name"] for s in envs.schemas("count")] == ["add", "double", "incr"]
    assert [s["function"]["name"] for s in envs.schemas("adder")] == ["add", "add"]  # standalone + its method
    assert envs.schemas("puzzle") == []
    with pytest.raises(ValueError, match=r"row 1: environment='chess' is not among"):
        EnvTurns(envs, templates(envs), [{"environment": "count"}, {"environment": "chess"}], 1)
    rows = [{"prompt": "c", "environment": "count", "start": 2}, {"prompt": "what is 2+3?", "environment": "adder",
                                                                   "answer": 5},
            {"environment": "puzzle", "seed": 3}]
    turns = EnvTurns(envs, templates(envs), rows, 1)
    d = Driver(turns)
    assert "columns ['prompt']" in TOKENIZER.decode(d.seq[(0, 0)])  # no 'environment' column in reset
    assert "sliding puzzle" in TOKENIZER.decode(d.seq[(2, 0)])
    r = d.turn((0, 0), call("incr", by=1) + call("add", a=1, b=2))
    assert TOKENIZER.decode(r.append_ids) == tool_reply("3", "3")
    r = d.turn((1, 0), call("add", a=2, b=3) + call("incr", by=1))  # Counter's tool is not the adder's
    assert TOKENIZER.decode(r.append_ids) == tool_reply("5", "{'error': 'Tool incr not found.'}")
    d.turn((2, 0), "<action>up</action>")
    res = turns.results()
    assert res[(0, 0)].reward == 3.0 and res[(1, 0)].reward == 1.0 and res[(1, 0)].failures == {
        "tool/unknown_tool": 1}
    assert [t.env for t in res.values()] == ["count", "adder", "puzzle"]


def test_a_plain_tools_list_runs_on_any_worker(pool):
    envs = environments(pool, None, [add])
    turns = EnvTurns(envs, templates(envs), [{"prompt": "2+3?"}], 2)
    d = Driver(turns)
    assert TOKENIZER.decode(d.turn((0, 0), call("add", a=2, b=3)).append_ids) == tool_reply("5")
    assert d.turn((0, 0), "\\boxed{5}").finish == "stop"
    res = turns.results()
    assert list(res) == [(0, 0), (0, 1)] and (res[(0, 0)].reward, res[(0, 0)].turns, res[(0, 0)].finish) == (
        0.0, 2, "stop")
    assert (res[(0, 1)].turns, res[(0, 1)].finish, res[(0, 1)].failures) == (0, None, {})
    with pytest.raises(ValueError, match="needs an environment_factory or tools"):
        EnvironmentPool(pool)
    with pytest.raises(ValueError, match="must be importable by the workers"):
        EnvironmentPool(pool, None, [lambda a: a])


def kill_workers(pool):
    for w in pool._workers:
        w.kill()


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10**6), st.sampled_from([2, 3]))
def test_sliding_puzzle_boards_need_at_least_three_moves(seed, size):
    grid = generate(size, 8 if size == 2 else 10, 3, seed)
    d = optimal_moves(grid, size, 20)
    assert d is not None and d >= 3
    for _, g in neighbours(grid, size):  # one move takes the optimum down by at most one (BFS is consistent)
        assert optimal_moves(g, size, 20) >= d - 1


def test_sliding_puzzle_backtracking_walk_is_nemo_rls():
    """The 2×2 board graph is one cycle of 12 boards: a walk that never undoes its last move ends exactly 3 moves
    away after 3 moves, while NeMo-RL's walk (backtrack, any neighbour) also ends 1 move away; with min_moves=1 and
    an odd walk the board is never the solved one (the graph is bipartite)."""
    plain = {optimal_moves(generate(2, 3, 1, seed), 2, 12) for seed in range(40)}
    walks = {optimal_moves(generate(2, 3, 1, seed, backtrack=True), 2, 12) for seed in range(40)}
    assert plain == {3} and walks == {1, 3}
    assert all(generate(3, 5, 1, seed, backtrack=True) != solved(3) for seed in range(40))


def optimal_actions(grid, size) -> list[str]:
    """A shortest solution, one action per move, found by walking down the BFS distance."""
    actions = []
    while grid != solved(size):
        d = optimal_moves(grid, size, 30)
        name, grid = next((n, g) for n, g in neighbours(grid, size) if optimal_moves(g, size, 30) == d - 1)
        actions.append(name)
    return actions


def test_text_step_state_travels_with_the_sample_and_survives_dead_workers(pool):
    """The BFS-optimal play solves each board in exactly its optimum (>= 3 turns) with reward 1 ("env_done"),
    although every worker is killed before every step: the state lives with the sample."""
    envs = environments(pool, SlidingPuzzle)
    assert envs.stop_strings() == ("</action>",)
    rows = [{"seed": s, "size": 2} for s in (1, 2)]
    turns = EnvTurns(envs, templates(envs), rows, 1)
    d = Driver(turns)
    assert turns.prompt_ids() == [d.seq[(0, 0)], d.seq[(1, 0)]]  # once: the same prompts, no second reset
    for i, row in enumerate(rows):
        grid = generate(2, 8, 3, row["seed"])
        assert render(grid, 2) in TOKENIZER.decode(d.seq[(i, 0)])
        actions = optimal_actions(grid, 2)
        assert len(actions) >= 3
        for k, a in enumerate(actions):
            kill_workers(pool)
            r = d.turn((i, 0), f"I slide <action>{a}</action>", eos=False)  # stopped at the stop string
            assert (r.finish == "env_done") == (k == len(actions) - 1)
            if r.finish is None:  # the template's end of turn follows the stop string, then the observation
                assert d.tok.decode(r.append_ids).startswith(f"<|endoftext|><|user|>Moved {a}.")
    res = turns.results()
    template = turns.template(None)
    for key, tr in res.items():  # the whole trajectory, token by token, is the template's rendering
        assert d.seq[key] + [EOS] == template.ids(template.render(tr.messages, False))
    assert all(t.reward == 1.0 and t.finish == "env_done" and not t.failures for t in res.values())
    assert [t.turns for t in res.values()] == [len(optimal_actions(generate(2, 8, 3, r["seed"]), 2)) for r in rows]


def test_sliding_puzzle_rules():
    env = SlidingPuzzle()
    text, state = env.reset(seed=5, size=2, min_moves=3, max_moves=3)
    assert "<action>" in text and state["moves"] == 0
    before = list(state["grid"])
    obs, reward, done, stops = env.step("no action here", state)
    assert "No valid action" in obs and (reward, done, stops) == (0.0, False, None) and state["grid"] == before
    empty = before.index(0)
    illegal = "up" if empty >= 2 else "down"  # no tile below the bottom row, none above the top row
    obs, _, _, _ = env.step(f"<action>{illegal}</action>", state)
    assert obs.startswith(f"Cannot move {illegal}") and state["grid"] == before and state["moves"] == 2
    obs, reward, done, _ = env.step("<action>slide 9 9</action>", state)  # the third move: out of moves
    assert (reward, done) == (0.0, True) and "Out of moves" in obs


def hostile_turns(pool, envs_module, rows, n=1, **kw):
    envs = environments(pool, envs_module.Hostile, **kw)
    return Driver(EnvTurns(envs, templates(envs), rows, n))


def test_hostile_tools_are_counted_and_bounded(pool, envs_module):
    """Per trajectory (2 workers: trajectory t lives on worker t % 2): a tool that raises or naps past its soft
    limit gets an error observation and the trajectory goes on; one that escapes the soft limit (hard kill), exits
    or SIGKILLs its worker ends its trajectory ("error", reward 0) and every other trajectory whose instance was on
    that worker ends at its next call ("instance_lost"); a 100K-token result is cut to max_observation_chars;
    malformed calls and too many calls get error observations; a reset that raises or hangs ends the trajectory at
    its first turn. Trajectories on the other worker are untouched, and new ones start fine."""
    rows = [{"prompt": "p"}] * 8 + [{"prompt": "p", "mode": "raise"}, {"prompt": "p", "mode": "hang"}]
    d = hostile_turns(pool, envs_module, rows, max_tool_calls_per_turn=3)
    k = [(i, 0) for i in range(10)]
    r = d.turn(k[0], call("boom") + call("nap") + call("ok"))
    assert d.tok.decode(r.append_ids) == tool_reply("{'error': 'boom'}",
                                                    f"{{'error': 'Tool nap ran longer than {TIMEOUT_S} s'}}", "fine")
    r = d.turn(k[1], call("flood"))
    flood = d.tok.decode(r.append_ids)
    assert len(flood) < MAX_CHARS + 100 and "truncated 499000 characters" in flood
    r = d.turn(k[2], call("ok") + '<tool_call>{"name": "ok", "argu</tool_call>' + call("ok") * 3)
    text = d.tok.decode(r.append_ids)
    assert text.count("fine") == 3 and "malformed tool call" in text and "more than 3 tool calls" in text
    assert d.turn(k[2], "done").finish == "stop"  # its get_reward runs on worker 0 before the kill below
    start = time.perf_counter()
    assert d.turn(k[4], call("stuck")).finish == "error"  # worker 0: killed past the hard limit
    assert time.perf_counter() - start < 2 * TIMEOUT_S + GRACE_S + 2  # bounded by the hard limit (+ respawn)
    assert d.turn(k[3], call("die")).finish == "error"  # worker 1: os._exit
    assert d.turn(k[0], call("ok")).finish == "error"  # its instance died with worker 0 (k[4]'s kill)
    assert d.turn(k[1], "no call").finish == "stop"  # ended before noticing: its get_reward finds no instance
    assert d.turn(k[8], call("ok")).finish == "error" and d.turn(k[9], call("ok")).finish == "error"
    r = d.turn(k[6], call("ok"))  # worker 0, reset after nothing died: but k[4] killed it later
    assert r.finish == "error"
    res = d.turns.results()
    f = {key: dict(t.failures) for key, t in res.items()}
    assert f[k[0]] == {"tool/raised": 1, "tool/timeout": 1, "instance_lost": 1}
    assert f[k[1]] == {"instance_lost": 1} and res[k[1]].truncated == 1
    assert f[k[2]] == {"tool/malformed": 1, "tool/too_many": 1}
    assert f[k[3]] == {"tool/worker_died": 1, "instance_lost": 1}
    assert f[k[4]] == {"tool/timeout": 1, "instance_lost": 1}
    assert f[k[8]] == {"reset/raised": 1} and f[k[9]] == {"reset/timeout": 1}
    assert f[k[6]] == {"instance_lost": 1}
    assert f[k[5]] == {"instance_lost": 1} and f[k[7]] == {"instance_lost": 1}  # never called: lost at results()
    rewards = {key: t.reward for key, t in res.items()}
    assert rewards[k[2]] == 1.0 and all(v == 0.0 for key, v in rewards.items() if key != k[2])
    # the run goes on, on the respawned workers: a tool that SIGKILLs its worker (0) ends its trajectory and the
    # other one on that worker, not the one on worker 1; then fresh trajectories work on both
    d = hostile_turns(pool, envs_module, [{"prompt": "p"}] * 3)
    assert d.turn((0, 0), call("sigkill")).finish == "error"
    assert d.turn((1, 0), call("ok")).finish is None and d.turn((2, 0), call("ok")).finish == "error"
    res = d.turns.results()
    assert [dict(t.failures) for t in res.values()] == [{"tool/worker_died": 1, "instance_lost": 1}, {},
                                                        {"instance_lost": 1}]
    assert [t.reward for t in res.values()] == [0.0, 1.0, 0.0]
    d = hostile_turns(pool, envs_module, [{"prompt": "p"}] * 2)
    assert all(d.turn((i, 0), call("ok")).finish is None for i in range(2))
    assert all(t.reward == 1.0 and not t.failures for t in d.turns.results().values())


def test_a_worker_that_dies_in_a_turn_of_several_calls_fails_each_call(pool, envs_module):
    """One task runs a turn's calls: when ``die`` kills the worker after ``ok`` ran, the whole answer is lost, so
    both calls count as worker_died, the instance is lost once and the trajectory ends ("error", reward 0); the
    trajectory on the other worker is untouched."""
    d = hostile_turns(pool, envs_module, [{"prompt": "p"}] * 2)
    assert d.turn((0, 0), call("ok") + call("die")).finish == "error"
    assert d.turn((1, 0), call("ok")).finish is None
    res = d.turns.results()
    assert (res[(0, 0)].finish, res[(0, 0)].tool_calls, res[(0, 0)].reward) == ("error", 2, 0.0)
    assert dict(res[(0, 0)].failures) == {"tool/worker_died": 2, "instance_lost": 1}
    assert (res[(1, 0)].reward, dict(res[(1, 0)].failures)) == (1.0, {})


def test_a_sample_whose_reset_text_differs_from_its_groups_ends_with_an_error(pool, envs_module):
    """A group shares one prompt: Moody's reset text names its worker, so the sample on the other worker than
    sample 0's differs, is counted (reset/mismatch) and ends at its first turn."""
    envs = environments(pool, envs_module.Moody)
    d = Driver(EnvTurns(envs, templates(envs), [{"prompt": "p"}], 2))
    assert d.seq[(0, 0)] == d.seq[(0, 1)]
    assert d.turn((0, 0), "x").finish == "stop" and d.turn((0, 1), "x").finish == "error"
    res = d.turns.results()
    assert [dict(t.failures) for t in res.values()] == [{}, {"reset/mismatch": 1}]


def test_hostile_text_steps_are_counted_and_keep_the_state(pool, envs_module):
    envs = environments(pool, envs_module.Steps)
    turns = EnvTurns(envs, templates(envs), [{"prompt": "play"}], 1)
    d = Driver(turns)
    key = (0, 0)
    r = d.turn(key, "a")
    assert d.tok.decode(r.append_ids) == user_reply("step 1") and r.stop_strings == ("STOP", "END")
    for bad in ("RAISE", "HANG", "STUCK", "DIE"):
        r = d.turn(key, bad)
        assert r.finish is None and r.stop_strings is None and "environment step failed" in d.tok.decode(r.append_ids)
    r = d.turn(key, "FLOOD")
    assert len(d.tok.decode(r.append_ids)) < MAX_CHARS + 100
    r = d.turn(key, "b")
    assert d.tok.decode(r.append_ids) == user_reply("step 3")  # the four failed steps did not count
    assert d.turn(key, "DONE").finish == "env_done"
    t = turns.results()[key]
    assert t.reward == 0.5 + 0.25 + 0.5 + 1.0 and t.turns == 8 and t.truncated == 1
    assert dict(t.failures) == {"step/raised": 1, "step/timeout": 2, "step/worker_died": 1}


ACTIONS = ["ok", "boom", "nap", "die", "flood", "malformed", "stop"]


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=3), min_size=4, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_random_hostile_schedules_are_counted_exactly(pool, envs_module, scripts, order):
    """Random tool behaviours per trajectory, interleaved in a random order: the counts, finish reasons and rewards
    equal those of a model of the pool (an instance lives on worker t % 2 and dies with it)."""
    d = hostile_turns(pool, envs_module, [{"prompt": "p"}] * 4)
    alive, ended, truncated = [True] * 4, [False] * 4, [0] * 4
    expect = [Counter() for _ in range(4)]
    finish, pos = [None] * 4, [0] * 4
    text = {"ok": call("ok"), "boom": call("boom"), "nap": call("nap"), "die": call("die"), "flood": call("flood"),
            "malformed": '<tool_call>{"name": </tool_call>', "stop": "the end"}
    for t in order + [0, 1, 2, 3] * 3:
        if ended[t] or pos[t] == len(scripts[t]):
            continue
        action = scripts[t][pos[t]]
        pos[t] += 1
        r = d.turn((t, 0), text[action])
        if action == "stop":
            finish[t], ended[t] = "stop", True
        elif action == "malformed":
            expect[t]["tool/malformed"] += 1
        elif not alive[t]:
            expect[t]["instance_lost"] += 1
            finish[t], ended[t] = "error", True
        elif action == "die":
            expect[t].update({"tool/worker_died": 1, "instance_lost": 1})
            finish[t], ended[t] = "error", True
            for u in range(4):
                if u % 2 == t % 2 and not ended[u]:
                    alive[u] = False
        elif action in ("boom", "nap"):
            expect[t]["tool/raised" if action == "boom" else "tool/timeout"] += 1
        elif action == "flood":
            truncated[t] += 1
        assert r.finish == finish[t]
    res = d.turns.results()
    for t in range(4):
        if finish[t] != "error" and not alive[t]:
            expect[t]["instance_lost"] += 1  # found gone by get_reward
        assert res[(t, 0)].failures == expect[t]
        assert res[(t, 0)].finish == finish[t]
        assert res[(t, 0)].reward == (1.0 if alive[t] and finish[t] != "error" else 0.0)
        assert res[(t, 0)].truncated == truncated[t]


def readme_module(name: str) -> str:
    """The README's example module ``# <name>.py: ...``, as a user would save it."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(rf"\n```python\n(# {name}\.py.*?)\n```", text, re.S)
    assert block, f"the README's {name}.py example is gone"
    return block.group(1)


def test_the_readme_examples_run_in_the_workers(tmp_path, monkeypatch):
    """Both README contracts, saved as the user would, in a fresh pool: the shop's async price and failing buy
    (an error observation) then a good buy (get_reward 1); the game won by bisection (step rewards sum to 1)."""
    for name in ("my_envs", "my_games"):
        (tmp_path / f"{name}.py").write_text(readme_module(name))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_envs
    import my_games

    with RewardPool(RewardConfig(functions=["format"], timeout_s=1.0), 1,
                    preload=environment_modules({"shop": my_envs.Shop, "guess": my_games.Guess})) as p:
        envs = EnvironmentPool(p, {"shop": my_envs.Shop, "guess": my_games.Guess})
        rows = [{"prompt": "Buy a pear.", "environment": "shop", "coins": 7, "wanted": "pear"},
                {"prompt": "Play.", "environment": "guess", "seed": 11}]
        d = Driver(EnvTurns(envs, templates(envs), rows, 1))
        assert d.tok.decode(d.seq[(0, 0)]).endswith("Buy a pear. You have 7 coins.<|assistant|>")
        r = d.turn((0, 0), call("price", item="pear") + call("buy", item="apple") + call("buy", item="pear"))
        assert d.tok.decode(r.append_ids) == tool_reply("5", "bought apple, 4 coins left",
                                                        "{'error': 'pear costs 5, you have 4'}")
        d.turn((0, 0), "no pear for me")
        low, high, turns = 1, 100, 0
        while True:
            guess = (low + high) // 2
            r = d.turn((1, 0), f"<guess>{guess}</guess>", eos=False)
            turns += 1
            if r.finish:
                break
            text = d.tok.decode(r.append_ids)
            low, high = (guess + 1, high) if "Higher" in text else (low, guess - 1)
        res = d.turns.results()
    assert (res[(0, 0)].reward, res[(0, 0)].failures) == (0.0, {"tool/raised": 1})  # no pear: the apple was bought
    assert (res[(1, 0)].reward, res[(1, 0)].finish, res[(1, 0)].turns) == (1.0, "env_done", turns) and turns <= 7


def test_waiting_on_a_closed_pool_raises_instead_of_hanging(envs_module):
    with RewardPool(RewardConfig(functions=["format"], timeout_s=TIMEOUT_S), 1) as p:
        envs = environments(p, envs_module.Hostile)
        d = Driver(EnvTurns(envs, templates(envs), [{"prompt": "p"}], 1))
        ids = d.tok(call("stuck"), add_special_tokens=False)["input_ids"] + [EOS]
        d.turns.start((0, 0), ids, d.tok.decode(ids))
    with pytest.raises(RuntimeError, match="reward pool was closed"):
        d.turns.ready(block=True)


def test_the_python_tool_runs_in_a_worker(tmp_path, monkeypatch):
    """Through the pool (TMPDIR: a directory of the test's): the program's directory is named by the worker's pid
    and removed after the call; its output comes back as the tool message."""
    from fastgrpo.environments.python_code import run_python

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the server and its workers take the environment of the pool
    with RewardPool(RewardConfig(functions=["format"], timeout_s=5.0), 1,
                    preload=environment_modules(None, [run_python])) as p:
        envs = EnvironmentPool(p, None, [run_python])
        d = Driver(EnvTurns(envs, templates(envs), [{"prompt": "p"}], 1))
        program = "import os\nprint(6 * 7, os.path.basename(os.getcwd()))"
        r = d.turn((0, 0), call("run_python", code=program))
        worker = p._workers[0].pid
    assert d.tok.decode(r.append_ids).startswith(f"<|tool|><tool_response>\nexit status 0\n42 fastgrpo-code-{worker}-")
    assert list(tmp_path.iterdir()) == []


def runs(completion) -> list[tuple[int, list[int]]]:
    """A completion's tokens cut where the loss mask changes: (1, a sampled turn) / (0, an appended suffix)."""
    out = []
    for t, m in zip(completion.token_ids, completion.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def test_a_hostile_environment_in_engine_rollouts_is_counted_and_the_run_finishes(pool, envs_module):
    """The real engine (tiny random model, turns cut by stop strings) against Chaos, whose step raises, hangs,
    kills its worker, returns 100K tokens, ends or answers, as the hash of the turn's text says. Per trajectory,
    from the engine's own completion: the handler saw exactly the sampled turns; the failures, the reward and the
    state (a step counter that must survive the dead workers) are those the turns' texts imply; each appended run
    is the template's suffix for the expected observation; the 100K-token observation ends the trajectory with
    "length" in the engine (it does not fit max_sequence_tokens); env_done and max_turns end where they should."""
    from fastgrpo.config import ModelConfig
    from fastgrpo.engine.engine import GenerationEngine, SamplingParams
    from fastgrpo.models.loading import build_tiny_model

    model = build_tiny_model(ModelConfig(), TOKENIZER, seed=0)
    engine = GenerationEngine(model, eos_token_ids=EOS, tokenizer=TOKENIZER, max_batch_size=8)
    envs = environments(pool, envs_module.Chaos, max_observation_chars=200_000)
    turns = EnvTurns(envs, templates(envs), [{"prompt": "go"}, {"prompt": "again"}, {"prompt": "more"}], 4)
    params = SamplingParams(n=4, max_new_tokens=5, max_turns=4, seed=3, max_sequence_tokens=600,
                            stop_strings=tuple(string.ascii_lowercase + string.digits))
    completions = engine.generate(turns.prompt_ids(), params, turns=turns)
    res = turns.results()
    seen = Counter()
    for (i, j), t in res.items():
        c = completions[i][j]
        parts = runs(c)
        sampled, appended = [ids for m, ids in parts if m], [ids for m, ids in parts if not m]
        contents = [m["content"] for m in t.messages if m["role"] == "assistant"]
        assert len(contents) == t.turns and len(sampled) in (t.turns, t.turns + 1) and len(appended) <= t.turns
        expect, reward, steps, finish = Counter(), 0.0, 0, None
        for k, content in enumerate(contents):
            text = TOKENIZER.decode(sampled[k])
            eos = sampled[k][-1] == EOS
            assert content == (text.removesuffix("<|endoftext|>") if eos else text)
            kind = zlib.crc32(content.encode()) % 6
            seen[kind] += 1
            if kind < 3:
                expect[f"step/{['raised', 'timeout', 'worker_died'][kind]}"] += 1
                want = None  # an error observation
            else:
                steps += 1
                reward += {3: 0.5, 4: 1.0, 5: 0.25}[kind]
                want = user_reply("y" * 100_000 if kind == 3 else f"ok {steps}", eos)
            if kind in (3, 4):
                assert k == len(contents) - 1  # nothing comes after a done or an observation that does not fit
                # the engine's rule: an answer with ids on the last allowed turn is "max_turns" before any fit check
                finish = "env_done" if kind == 4 else "max_turns" if k + 1 == params.max_turns else "length"
                continue
            if k < len(appended):
                got = TOKENIZER.decode(appended[k])
                if want is None:
                    head = user_reply("{'error': ", eos).removesuffix("<|assistant|>")
                    assert got.startswith(head) and "environment step failed" in got, got
                    assert got.endswith("}<|assistant|>")
                else:
                    assert got == want, (got, want)
        if finish is None:  # a turn that hit max_new_tokens (not seen by the handler), the last allowed turn, or
            # an observation that did not fit
            finish = ("length" if len(sampled) > t.turns else "max_turns" if t.turns == params.max_turns
                      else "length")
            assert len(appended) == t.turns - (finish == "max_turns" or len(sampled) == t.turns)
        assert c.finish_reason == finish and c.num_turns == len(sampled)
        assert t.finish == ("env_done" if finish == "env_done" else None)
        assert t.failures == expect and t.reward == pytest.approx(reward) and t.truncated == 0
        if finish == "max_turns":
            assert t.turns == params.max_turns
    assert all(seen[k] for k in range(6)), seen  # the schedule met every behaviour


@pytest.mark.parametrize("environment", ["tools", "factory"])
def test_a_rollout_replaying_the_tool_tiny_demonstration_gives_its_tokens_and_mask(pool, environment):
    """The warm-up trains the very sequences GRPO then samples: a rollout through EnvTurns (the adder as a plain
    tool, or as AdderEnvironment) whose policy writes the demonstration's assistant texts gives the demonstration's
    token ids, with its loss mask on the sampled tokens; AdderEnvironment's reward says the tool gave the answer."""
    from fastgrpo.config import DataConfig
    from fastgrpo.data.prompts import prompt_messages
    from fastgrpo.data.tool_tiny import _assistant_text, conversation_example, tool_tiny_conversation

    cfg = DataConfig()
    row = {"prompt": "37+85+9=", "answer": "131"}
    envs = environments(pool, None, [add]) if environment == "tools" else environments(pool, AdderEnvironment)
    template = templates(envs)
    conversation = tool_tiny_conversation(row, cfg)
    example = conversation_example(template, conversation)
    d = Driver(EnvTurns(envs, template, [{**row, "prompt": prompt_messages(row["prompt"], cfg)}], 1))
    mask = [False] * len(d.seq[(0, 0)])
    seen = prompt_messages(row["prompt"], cfg)  # the conversation as the policy sees it: its turns as texts
    for k, m in enumerate(conversation[len(seen):], start=len(seen)):
        if m["role"] != "assistant":
            seen.append(m)  # the tool result the environment answered with
            continue
        text = _assistant_text(template, seen, m)  # what the policy writes for this demonstration turn
        seen.append({"role": "assistant", "content": text})
        before = len(d.seq[(0, 0)])
        r = d.turn((0, 0), text)
        mask += [True] * (len(d.seq[(0, 0)]) - before - len(r.append_ids)) + [False] * len(r.append_ids)
        assert (r.finish == "stop") == (k == len(conversation) - 1)
    assert d.seq[(0, 0)] == example.input_ids and mask == example.loss_mask
    t = d.turns.results()[(0, 0)]
    assert (t.tool_calls, t.failures, t.reward) == (2, {}, 1.0 if environment == "factory" else 0.0)


def test_reward_chunks_and_environment_calls_share_the_workers(pool, envs_module):
    """Reward groups submitted while trajectories call their tools: gather() waits for the reward chunks only and
    scores them as without environments; the tool answers are unaffected."""
    envs = environments(pool, envs_module.Counter)
    d = Driver(EnvTurns(envs, templates(envs), [{"prompt": "p", "start": 1}], 3))
    completions = ["\\boxed{1}", "no box", "\\boxed{", "\\boxed{22}"] * 3
    for g in range(3):
        pool.submit(g, ["p"] * 4, completions[4 * g:4 * g + 4], {})
        r = d.turn((0, g), call("incr", by=g))
        assert d.tok.decode(r.append_ids) == tool_reply(str(1 + g))
    result, _ = pool.gather()
    assert result.per_function["format"] == [1.0, 0.0, 0.0, 1.0] * 3
    assert [t.reward for t in d.turns.results().values()] == [1.0, 2.0, 3.0]


def test_plain_tools_that_kill_their_worker_get_error_observations_and_the_trajectory_goes_on(pool, envs_module):
    """Without an instance there is nothing to lose: a plain tool past the hard limit, or one that exits its worker,
    is answered with an error observation (counted), and the trajectory's next call works on the new worker."""
    envs = environments(pool, None, [add, envs_module.wedge, envs_module.crash])
    d = Driver(EnvTurns(envs, templates(envs), [{"prompt": "p"}], 1))
    r = d.turn((0, 0), call("wedge") + call("add", a=1, b=1))
    assert d.tok.decode(r.append_ids) == tool_reply("{'error': 'Tool wedge ran past the time limit'}",
                                                    "{'error': 'Tool add ran past the time limit'}")
    r = d.turn((0, 0), call("crash"))
    assert d.tok.decode(r.append_ids) == tool_reply("{'error': 'Tool crash crashed its worker'}")
    assert d.tok.decode(d.turn((0, 0), call("add", a=2, b=2)).append_ids) == tool_reply("4")
    t = d.turns.results()[(0, 0)]
    assert (t.finish, t.tool_calls, t.failures) == (None, 4, {"tool/timeout": 2, "tool/worker_died": 1})


TINY_RESPONSE_TEMPLATE = {  # transformers' response template for the tiny chat template (TRL's Qwen3 one, re-anchored)
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|endoftext\|>\s*", "content": "text"},
    },
}


def test_tool_calls_parsed_by_the_tokenizers_response_template(pool):
    """A tokenizer with a response template: EnvTurns parses each turn with ``tokenizer.parse_response`` (prefix:
    the text before the turn), and a call it cannot read is an error observation."""
    import copy

    tok = copy.deepcopy(TOKENIZER)
    tok.response_template = TINY_RESPONSE_TEMPLATE
    envs = environments(pool, None, [add])
    template = ChatTemplate(tok, tools=envs.schemas())
    assert template.tool_call_format() == "parse_response"
    d = Driver(EnvTurns(envs, template, [{"prompt": "1+2="}], 1))
    r = d.turn((0, 0), "sure " + call("add", a=1, b=2) + call("add", a=3, b=4))
    assert d.tok.decode(r.append_ids) == tool_reply("3", "7")
    r = d.turn((0, 0), '<tool_call>{"name": "add", </tool_call>')
    assert "malformed tool call" in d.tok.decode(r.append_ids)
    assert d.turn((0, 0), "\\boxed{3}").finish == "stop"
    t = d.turns.results()[(0, 0)]
    assert (t.tool_calls, dict(t.failures)) == (3, {"tool/malformed": 1})


def test_an_async_get_reward_that_hangs_times_out_and_leaves_the_worker_usable(pool, envs_module):
    envs = environments(pool, envs_module.Lazy)
    rows = [{"prompt": "p", "slow": True}, {"prompt": "p"}, {"prompt": "p"}]  # trajectories 0 and 2: worker 0
    d = Driver(EnvTurns(envs, templates(envs), rows, 1))
    for i in range(3):
        assert d.turn((i, 0), "done").finish == "stop"
    res = d.turns.results()
    assert [(t.reward, dict(t.failures)) for t in res.values()] == [(0.0, {"get_reward/timeout": 1}), (2.0, {}),
                                                                    (2.0, {})]


def test_a_sessions_handler_takes_rows_over_time_and_frees_each_group(pool, envs_module):
    """A generation session's EnvTurns (async GRPO): rows added while a turn waits on its worker (its answer is
    handed to the engine at the next ready), a group's trajectories taken when the engine finishes it (the rewards of
    those the engine ended collected then), its instances freed: the rows added later reuse them (each worker's
    count of instances made stays at the rows in flight on it) and the handler keeps only the rows in flight."""
    envs = environments(pool, envs_module.Made)
    turns = EnvTurns(envs, templates(envs), [], 1)
    first = turns.add([{"prompt": "a"}, {"prompt": "b"}])  # rows 0 and 1: workers 0 and 1
    assert all(" made 1" in TOKENIZER.decode(p) for p in first)
    ids = TOKENIZER(call("ping"), add_special_tokens=False)["input_ids"] + [EOS]
    turns.start((0, 0), ids, TOKENIZER.decode(ids))  # its tool call runs on worker 0
    [third] = turns.add([{"prompt": "c"}])  # row 2, worker 0: row 0's instance is still in use
    assert " made 2" in TOKENIZER.decode(third)
    got = dict(turns.ready(block=True))  # the answer that arrived during the add
    assert TOKENIZER.decode(got[(0, 0)].append_ids) == tool_reply("pong")
    ids = TOKENIZER("done", add_special_tokens=False)["input_ids"] + [EOS]
    turns.start((0, 0), ids, TOKENIZER.decode(ids))
    assert dict(turns.ready(block=True))[(0, 0)].finish == "stop"
    turns.end_group(0)
    [t0] = turns.take_group(0)
    [t1] = turns.take_group(1)  # ended by the engine ("length"): its reward is collected here
    assert (t0.reward, t0.turns, t0.tool_calls, t0.finish) == (1.0, 2, 1, "stop")
    assert (t1.reward, t1.turns, t1.finish) == (1.0, 0, None)
    later = turns.add([{"prompt": "d"}, {"prompt": "e"}])  # rows 3 (worker 1) and 4 (worker 0): instances reused
    assert [" made 1" in TOKENIZER.decode(later[0]), " made 2" in TOKENIZER.decode(later[1])] == [True, True]
    assert sorted(turns.rows) == [2, 3, 4]
    turns.close()
