"""The reward worker pool: every fault scored 0 and counted in its own counter, for the faulty completions only (a
failed call's completions scored again alone), hard timeouts within the stated bound, dead workers respawned, the
same scores in the same order for 0 to 3 workers and any submission order, overlap with the submitter, clean
shutdown, workers free of torch and of the entry script, and a hostile reward through a whole training run.

Four pools (0 to 3 workers) are shared by the module: starting a pool's server costs about a second here (a fresh
interpreter importing the reward modules); a worker is then a fork of it.
"""

import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.config import RewardConfig
from fastgrpo.rewards import CHUNK_SIZE, COUNTERS, RewardSet, chunk_bounds
from fastgrpo.rewards.pool import RewardPool, default_num_workers
from fastgrpo.rewards.processes import WorkerProcess

REPO = Path(__file__).resolve().parents[1]

TIMEOUT_S = 0.25
SLEEP_S = 0.04  # sleepy(): seconds per "SLOW" completion (a chunk of 4 stays well under TIMEOUT_S)
BEHAVIOURS = ("hang", "raise", "exit", "nan", "short")  # what these completions make scripted() do
USER_MODULE = """
    import math, os, signal, time

    STATE = {}

    def init():
        STATE["ready"] = True

    def broken_init():
        raise RuntimeError("no sandbox")

    def initialized(prompts, completions, **kw):
        if not STATE.get("ready"):
            raise RuntimeError("worker_init did not run")
        return [1.0] * len(completions)

    def raises(prompts, completions, **kw):
        raise RuntimeError("boom")

    def nan_second(prompts, completions, **kw):
        return [1.0, math.nan, 2.0, -math.inf][: len(completions)]

    def wrong_length(prompts, completions, **kw):
        return [1.0] * (len(completions) + 1)

    def hang(prompts, completions, **kw):
        if any("HANG" in c for c in completions):
            time.sleep(30)
        return [0.5] * len(completions)

    def die(prompts, completions, **kw):
        if any("DIE" in c for c in completions):
            os.kill(os.getpid(), signal.SIGKILL)
        return [0.25] * len(completions)

    def length(prompts, completions, level, **kw):
        return [len(c) / 10 + (lv == "hard") + len(p) / 100 for p, c, lv in zip(prompts, completions, level)]

    def sleepy(prompts, completions, **kw):
        time.sleep(SLEEP_S * sum("SLOW" in c for c in completions))
        return [1.0] * len(completions)

    def scripted(prompts, completions, **kw):  # BEHAVIOURS in order (the first hang, raise or exit ends the call),
        out = []  # "short" anywhere drops the last score; any other completion c scores len(c) % 5 / 4
        for c in completions:
            if c == "hang":
                time.sleep(30)
            if c == "raise":
                raise RuntimeError("a faulty completion")
            if c == "exit":
                os._exit(3)
            out.append(math.nan if c == "nan" else len(c) % 5 / 4)
        return out[: len(out) - ("short" in completions)]

    def sleep_each(prompts, completions, **kw):
        time.sleep(0.01 * len(completions))
        return [1.0] * len(completions)

    def report(prompts, completions, report, **kw):  # what this process imported and holds open, to a file
        import json, sys
        fds = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # the listing's own descriptor, closed by now
                pass
        with open(report[0], "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "modules": sorted(sys.modules), "fds": fds,
                       "main": getattr(sys.modules["__main__"], "__file__", None), "init": STATE.get("ready")}, f)
        return [1.0] * len(completions)
"""
HOSTILE_MODULE = """
    import math, os, time, zlib

    def kind(prompt, completion):  # 0 hangs, 1 raises, 2 kills the worker, 3 is NaN: 1 completion in 23 each
        return zlib.crc32(f"{prompt}\\0{completion}".encode()) % 23

    def hostile(prompts, completions, **kw):
        out = []
        for p, c in zip(prompts, completions):
            k = kind(p, c)
            if k == 0:
                time.sleep(3600)
            if k == 1:
                raise RuntimeError("a faulty reward")
            if k == 2:
                os._exit(3)
            out.append(math.nan if k == 3 else len(c) % 7 / 7)
        return out
"""
FUNCTIONS = ["format", "pool_user:initialized", "pool_user:raises", "pool_user:nan_second",
             "pool_user:wrong_length", "pool_user:hang", "pool_user:die", "pool_user:length", "pool_user:sleepy",
             "pool_broken:f", "pool_user:scripted"]
WEIGHTS = [0.5, 0.125, 3.0, 0.25, 5.0, 2.0, 4.0, 1.5, 0.0625, 7.0, 0.75]


def make_cfg(**kw) -> RewardConfig:
    return RewardConfig(functions=FUNCTIONS, weights=WEIGHTS, timeout_s=TIMEOUT_S, worker_init="pool_user:init", **kw)


@pytest.fixture(scope="module")
def user_modules(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool_rewards")
    (path / "pool_user.py").write_text(textwrap.dedent(USER_MODULE).replace("SLEEP_S", repr(SLEEP_S)))
    (path / "pool_broken.py").write_text("raise ImportError('this reward module is broken')\n")
    (path / "pool_hostile.py").write_text(textwrap.dedent(HOSTILE_MODULE))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(path))  # the workers' server gets the trainer's sys.path
        yield path


def _pool(n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the broken module, warned by the in-process set
        return RewardPool(make_cfg(), n)


@pytest.fixture(scope="module")
def pools(user_modules):
    made = {n: _pool(n) for n in (0, 1, 2, 3)}
    yield made
    for pool in made.values():
        pool.close()


def groups_of(texts_per_group, seed=0):
    """(prompts, completions, columns) per group: the group's prompt repeated, one column value per completion."""
    rng = random.Random(seed)
    out = []
    for p, texts in enumerate(texts_per_group):
        prompt = f"question {p}" + "?" * rng.randrange(3)
        out.append(([prompt] * len(texts), list(texts), {"answer": [str(p)] * len(texts),
                                                          "level": [rng.choice(["easy", "hard"]) for _ in texts]}))
    return out


def run(pool, groups, order=None):
    for i in order if order is not None else range(len(groups)):
        pool.submit(i, *groups[i])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return pool.gather()


def wait_bound(killed_calls, timeouts, num_workers, times, timeout_s=TIMEOUT_S):
    """The pool docstring's bound on time/reward_wait, C = ``killed_calls`` (on several completions, killed at their
    budget) and H = ``timeouts``, with 0.5 s for S (the functions are fast) and the dispatch."""
    return ((killed_calls + timeouts) * timeout_s / num_workers + 3 * timeout_s * (1 - 1 / num_workers)
            + times["time/reward_worker_start"] + 0.5)


def expectation(groups, behaviour, score) -> tuple[list[float], dict[str, int], int, int]:
    """What a reward must give the completions of ``groups`` when ``behaviour(c)`` names what completion c makes
    each call it is in do (one of BEHAVIOURS, None: nothing) and ``score(c)`` is its score alone: the scores, the
    counters, the worker kills and the calls on several completions killed at their budget.

    A call ends at its first hang, raise or exit, and fails as a whole on those and on "short": then, on several
    completions, each is scored alone (counted as isolated). Alone, a hang times out, a raise, exit or "short" fails
    and a NaN is non-finite; all score 0, every other completion its own score."""
    scores, counts, kills, killed_calls = [], dict.fromkeys(COUNTERS, 0), 0, 0
    faults = {"hang": "timeouts", "raise": "failures", "exit": "failures", "short": "failures", "nan": "nonfinite"}
    for completions in groups:
        for a, b in chunk_bounds(len(completions)):
            does = [behaviour(c) for c in completions[a:b]]
            first = next((d for d in does if d in ("hang", "raise", "exit")), None)
            if b - a > 1 and (first or "short" in does):
                counts["isolated"] += b - a
                kills += first in ("hang", "exit")
                killed_calls += first == "hang"
            for c, d in zip(completions[a:b], does):
                if d in faults:
                    counts[faults[d]] += 1
                scores.append(0.0 if d in faults else score(c))
                kills += d in ("hang", "exit")
    return scores, counts, kills, killed_calls


def scripted_score(c: str) -> float:
    return len(c) % 5 / 4


@settings(derandomize=True, deadline=None, max_examples=24)
@given(st.lists(st.lists(st.sampled_from(["a", "raise", "bb", "exit", "ccc", "nan", "dddd", "short", ""]),
                         min_size=1, max_size=6), min_size=1, max_size=3),
       st.sampled_from([3, 1, 2, 0]), st.sampled_from([None, 1, None, 6, None]))
def test_only_the_faulty_completions_score_zero(pools, groups, num_workers, hang_at):
    """Chunk layouts (group sizes), worker counts and fault mixes (at most one hang: each costs its call's budget,
    then its own): every innocent completion gets the score it gets alone, every faulty one 0, and each counter and
    the kills are what the completions imply. In process, "exit" (which would end the test) is "raise"."""
    texts = [["raise" if c == "exit" and not num_workers else c for c in g] for g in groups]
    flat = [(p, j) for p, g in enumerate(texts) for j in range(len(g))]
    if hang_at is not None:
        p, j = flat[hang_at % len(flat)]
        texts[p][j] = "hang"
    result, times = run(pools[num_workers], groups_of(texts), order=list(reversed(range(len(texts)))))
    scores, counts, kills, killed_calls = expectation(texts, lambda c: c if c in BEHAVIOURS else None, scripted_score)
    assert result.per_function["scripted"] == scores
    assert result.faults["scripted"] == counts
    if num_workers:
        assert times["reward/workers_respawned"] == kills
        assert times["time/reward_wait"] <= wait_bound(killed_calls, counts["timeouts"], num_workers, times)


def test_each_fault_is_counted_and_the_run_goes_on(pools):
    pool = pools[3]
    texts = [[f"\\boxed{{{j}}}" for j in range(5)] for _ in range(3)]  # chunks [0:4] and [4:5] per group
    texts[1][2] = "HANG \\boxed{2}"  # hang() past its budget on chunk [0:4] of group 1, then alone
    texts[2][4] = "DIE"  # die() SIGKILLs its worker on chunk [4:5] of group 2, a chunk of one: final
    groups = groups_of(texts)
    result, times = run(pool, groups, order=[2, 0, 1])
    f, n = result.faults, 15
    # raises() and wrong_length() fail on every completion alone too: the 4-completion chunks are re-run one by one
    for name in ("raises", "wrong_length"):
        assert result.per_function[name] == [0.0] * n
        assert f[name] == {"failures": n, "timeouts": 0, "nonfinite": 0, "isolated": 12}
    assert f["f"] == {"failures": n, "timeouts": 0, "nonfinite": 0, "isolated": 0}  # never called: nothing to isolate
    assert result.per_function["nan_second"] == [1.0, 0.0, 2.0, 0.0, 1.0] * 3  # NaN / inf: that completion's own
    assert f["nan_second"] == {"failures": 0, "timeouts": 0, "nonfinite": 6, "isolated": 0}
    assert result.per_function["hang"] == [0.5] * 7 + [0.0] + [0.5] * 7  # only the hanging completion scores 0
    assert f["hang"] == {"failures": 0, "timeouts": 1, "nonfinite": 0, "isolated": 4}
    assert result.per_function["die"] == [0.25] * 14 + [0.0]
    assert f["die"] == {"failures": 1, "timeouts": 0, "nonfinite": 0, "isolated": 0}
    assert result.per_function["initialized"] == [1.0] * n and f["initialized"]["failures"] == 0
    assert result.per_function["format"] == [1.0] * 14 + [0.0]
    assert times["reward/workers_respawned"] == 3  # the hung worker (chunk, then the completion alone), the dead one
    assert times["time/reward_wait"] <= wait_bound(1, 1, 3, times)
    names = list(result.per_function)
    assert result.total == [sum(w * result.per_function[k][j] for k, w in zip(names, WEIGHTS)) for j in range(n)]
    assert all(math.isfinite(t) for t in result.total)
    m = result.metrics()
    assert (m["reward/hang/timeouts"], m["reward/hang/isolated"], m["reward/die/failures"]) == (1, 4, 1)
    assert set(m) == {f"reward/{k}/{x}" for k in names for x in ("mean", *COUNTERS)}

    # the next step: the respawned workers score normally
    again, times = run(pool, groups_of([[f"\\boxed{{{j}}}" for j in range(5)]] * 2))
    assert again.faults["hang"] == dict.fromkeys(COUNTERS, 0) and again.faults["die"]["failures"] == 0
    assert again.per_function["hang"] == [0.5] * 10 and times["reward/workers_respawned"] == 0


def test_zero_to_three_workers_give_identical_results(pools):
    texts = [[f"\\boxed{{{(p * j) % 4}}} step {j}" for j in range(2 + 3 * p)] for p in range(4)]
    texts[3][6] = "HANG"
    groups = groups_of(texts, seed=1)
    results = {n: run(pools[n], groups, order=random.Random(n).sample(range(4), 4))[0] for n in pools}
    for n in (1, 2, 3):
        assert results[n].total == results[0].total
        assert results[n].per_function == results[0].per_function
        assert results[n].faults == results[0].faults
    assert results[0].faults["hang"] == {"failures": 0, "timeouts": 1, "nonfinite": 0, "isolated": CHUNK_SIZE}
    assert results[0].per_function["hang"].count(0.0) == 1


@settings(max_examples=8)
@given(st.lists(st.lists(st.text("0123456789{}\\boxed SLOW", max_size=12), min_size=1, max_size=6), min_size=1,
                max_size=4), st.randoms(use_true_random=False))
def test_scores_do_not_depend_on_workers_or_submission_order(pools, texts, rng):
    groups = groups_of(texts, seed=len(texts))
    results = []
    for n in (0, 1, 3):
        order = list(range(len(groups)))
        rng.shuffle(order)
        res, _ = run(pools[n], groups, order=order)
        results.append((res.total, res.per_function, res.faults))
    assert results[0] == results[1] == results[2]
    # a per-completion function scores the same in one flat in-process call
    flat = RewardSet(RewardConfig(functions=["pool_user:length"])).score(
        [p for g in groups for p in g[0]], [c for g in groups for c in g[1]],
        {"level": [v for g in groups for v in g[2]["level"]]})
    assert results[0][1]["length"] == flat.per_function["length"]


def test_the_math_reward_in_a_worker_matches_in_process(user_modules):
    """The built-in math reward (fast paths and math-verify, imported when the worker starts) in a worker."""
    texts = [["\\boxed{12}", "so \\boxed{ 12 }", "\\boxed{\\frac{24}{2}}", "\\boxed{13}", "12"],
             ["\\boxed{x^2+2x+1}", "\\boxed{(x+1)^2}", "\\boxed{"]]
    groups = [(["p"] * 5, texts[0], {"answer": ["12"] * 5}), (["q"] * 3, texts[1], {"answer": ["(x+1)^2"] * 3})]
    cfg = RewardConfig(functions=["math"], timeout_s=5.0)
    with RewardPool(cfg, 1) as pool:
        got, _ = run(pool, groups, order=[1, 0])
    expected = RewardSet(cfg).score(groups[0][0] + groups[1][0], texts[0] + texts[1],
                                    {"answer": groups[0][2]["answer"] + groups[1][2]["answer"]})
    assert got.per_function == expected.per_function == {"math": [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]}
    assert got.faults == expected.faults == {"math": dict.fromkeys(COUNTERS, 0)}


def test_a_worker_killed_while_idle_is_respawned(pools):
    pool = pools[1]
    run(pool, groups_of([["\\boxed{0}"]]))  # a step scored: the worker is up and idle, whatever ran before
    worker = pool._workers[0]
    signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)
    assert select.select([worker.pidfd], [], [], 10)[0]  # it has exited
    result, times = run(pool, groups_of([["\\boxed{0}"] * 3]))
    assert times["reward/workers_respawned"] == 1
    assert result.per_function["format"] == [1.0] * 3 and result.faults["format"] == dict.fromkeys(COUNTERS, 0)


def test_a_dead_server_is_restarted_and_its_workers_replaced(user_modules):
    """The server's workers die with it (Linux: parent-death signal); the next task starts a new server."""
    with _pool(1) as pool:
        run(pool, groups_of([["\\boxed{0}"]]))
        worker, server = pool._workers[0], pool._server.proc
        server.kill()
        server.wait()
        assert select.select([worker.pidfd], [], [], 10)[0]  # the worker is gone too
        result, times = run(pool, groups_of([["\\boxed{0}"] * 3]))
        assert pool._server.proc is not server and pool._server.proc.poll() is None
    assert times["reward/workers_respawned"] == 1
    assert result.per_function["format"] == [1.0] * 3 and result.faults["format"] == dict.fromkeys(COUNTERS, 0)


def test_scoring_overlaps_the_submitter(pools):
    """With a slow reward and groups submitted over time (as the engine finishes them), most of the reward time is
    hidden: the wait after the last submission is below the total reward time."""
    for n in (0, 1, 3):
        pool = pools[n]
        for i in range(4):
            if i:
                time.sleep(4 * SLEEP_S + 0.05)  # "generation" of the next group
            pool.submit(i, *groups_of([["SLOW"] * 4])[0])
        _, times = run(pool, [])
        if n:  # only the last group's 4 x SLEEP_S is left after the last submission; without overlap, >= 2 groups'
            assert times["time/reward_wait"] < 2 * 4 * SLEEP_S < times["time/reward"]
        else:  # in process, every group is scored after the last one is submitted
            assert times["time/reward_wait"] == times["time/reward"]


def record_processes(monkeypatch) -> list[int]:
    """Patches the pool to keep a pidfd of every worker it starts (respawns included) and of its server."""
    pidfds = []
    real_start = WorkerProcess.start

    def start(self):
        real_start(self)
        pidfds.append(os.pidfd_open(self.pid))
        pidfds.append(os.pidfd_open(self.server.proc.pid))

    monkeypatch.setattr(WorkerProcess, "start", start)
    return pidfds


def exited(pidfd):
    return bool(select.select([pidfd], [], [], 0)[0])


def test_close_kills_hung_workers_and_is_idempotent(user_modules, monkeypatch):
    pidfds = record_processes(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with _pool(2) as pool:
            pool.submit(0, *groups_of([["HANG"] * 4])[0])
            while len(pidfds) < 4 or not pool._queue.empty():  # both workers started, the hang taken
                time.sleep(0.01)
            raise KeyboardInterrupt  # Ctrl-C while a worker hangs
    assert all(exited(fd) for fd in pidfds)
    assert all(w.pid is None for w in pool._workers) and not any(t.is_alive() for t in pool._threads)
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit(1, ["p"], ["c"], {})


def test_in_process_worker_init_failure_counts_every_function(user_modules):
    cfg = RewardConfig(functions=["math", "pool_user:initialized"], worker_init="pool_user:broken_init")
    with pytest.warns(RuntimeWarning, match="worker_init 'pool_user:broken_init' failed: RuntimeError: no sandbox"):
        rs = RewardSet(cfg)
    res = rs.score(["p"] * 2, ["\\boxed{1}"] * 2, {"answer": ["1", "1"]})
    assert res.total == [0.0, 0.0] and res.faults["math"]["failures"] == 2


def test_submit_checks_its_arguments(pools):
    with pytest.raises(ValueError, match=r"\['answer'\] must hold one entry per completion \(2\)"):
        pools[0].submit(0, ["p", "p"], ["a", "b"], {"answer": ["1"]})
    pools[0].submit(0, ["p"], ["a"], {"answer": ["1"], "level": ["easy"]})
    with pytest.raises(ValueError, match="batch index 0 was already submitted"):
        pools[0].submit(0, ["p"], ["a"], {"answer": ["1"], "level": ["easy"]})
    run(pools[0], [])


def test_default_num_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert default_num_workers(1, 8) == 11  # 8 GPU ranks of a 96-core node: 88 free cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_num_workers(2, 1) == 1  # the CPU demo keeps both cores busy: still one worker


@pytest.mark.parametrize("field, value, message", [
    ("num_workers", -1, "reward.num_workers must be >= 0"),
    ("worker_init", "no_colon", "reward.worker_init must be 'module:function'"),
    ("functions", ["a:f", "b:f"], "reward.functions must have distinct function names"),
])
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**{field: value})


def test_a_training_run_scores_while_generating_and_stops_its_workers(user_modules, tmp_path, monkeypatch):
    """GRPO steps with the real engine (3 waves of 2 groups) and a reward that sleeps per completion: groups are
    scored while later waves decode, so the logged wait is below the reward time; Ctrl-C (in the third update)
    leaves no worker behind."""
    from fastgrpo.algorithms.update import PolicyUpdate
    from fastgrpo.config import load_config
    from fastgrpo.metrics import read_jsonl
    from fastgrpo.trainer import Trainer

    real_run, calls = PolicyUpdate.run, []

    def run_then_interrupt(self, samples, **kwargs):
        calls.append(len(samples))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run(self, samples, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "run", run_then_interrupt)
    pidfds = record_processes(monkeypatch)
    cfg = load_config(overrides=[
        "grpo.num_prompts_per_step=6", "grpo.num_generations=4", "rollout.max_new_tokens=8",
        "rollout.max_batch_size=8", "sft.warmup_steps=0", "train.num_threads=1", "train.max_steps=5",
        "eval.at_start=false", "eval.every_steps=0", "checkpoint.every_steps=0", "logging.progress_bar=false",
        f"logging.output_dir={tmp_path}", "reward.num_workers=1", f"reward.timeout_s={TIMEOUT_S}",
        "reward.functions=[pool_user:sleep_each]"])
    trainer = Trainer(cfg)
    pool = trainer.algorithm.rewards
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert pidfds and all(exited(fd) for fd in pidfds) and all(w.pid is None for w in pool._workers)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "time/reward" in r]
    assert [r["step"] for r in rows] == [1, 2] and calls == [24, 24, 24]
    second = rows[1]  # the first also waits for the worker to start
    assert second["reward/sleep_each/timeouts"] == 0 and second["reward/workers_respawned"] == 0
    assert second["time/reward_wait"] < second["time/reward"]


ENTRY_SCRIPT = """
import json, sys
import torch  # as fastgrpo/train.py does: a worker that re-imported this entry script would import torch
from fastgrpo.config import RewardConfig
from fastgrpo.rewards.pool import RewardPool

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    torch.ones(4).sum()  # the trainer's torch is loaded and in use
    cfg = RewardConfig(functions=["pool_user:report", "math"], worker_init="pool_user:init")
    with RewardPool(cfg, 2) as pool:
        for i in range(2):
            pool.submit(i, ["p"], ["\\\\boxed{1}"], {"answer": ["1"], "report": [f"{sys.argv[2]}/{i}.json"]})
        result, _ = pool.gather()
    print(json.dumps(result.per_function))
"""


def test_workers_import_neither_torch_nor_the_entry_script(user_modules, tmp_path):
    """From an entry script that imports torch (the trainer's case), a worker holds the reward modules (math-verify
    here), its initializer's state, stdio and its pipe: no torch, no entry script, no other descriptor."""
    script = tmp_path / "entry.py"
    script.write_text(ENTRY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script), str(user_modules), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"report": [1.0, 1.0], "math": [1.0, 1.0]}
    for i in range(2):
        r = json.loads((tmp_path / f"{i}.json").read_text())
        heavy = [m for m in r["modules"] if m.split(".")[0] in ("torch", "triton", "transformers", "numpy")]
        assert heavy == [] and not {"fastgrpo.train", "fastgrpo.trainer"} & set(r["modules"])
        assert r["main"] is None and "math_verify" in r["modules"] and r["init"] is True
        fds = r["fds"]
        assert fds["0"] == "/dev/null" and set(fds) - {"0", "1", "2"} == {
            fd for fd, target in fds.items() if fd not in ("0", "1", "2") and target.startswith("socket:")}
        assert len(set(fds) - {"0", "1", "2"}) == 1  # its pipe, nothing else
        assert r["ppid"] != out.returncode and r["pid"] != r["ppid"]


def readme_reward_module() -> str:
    """The README's ``reward.worker_init`` example, as a user would save it."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"\n( *)```python\n(\1# my_rewards\.py.*?)\n\1```", text, re.S)
    assert block, "the README's reward.worker_init example is gone"
    return textwrap.dedent(block.group(2))


def test_the_readme_worker_init_example_runs_in_the_workers(tmp_path, monkeypatch):
    """Each worker runs ``start_sandbox`` itself (its own directory, named by its pid), and ``passes_tests`` runs
    the tests with ``subprocess``: a failing test scores 0 (workers see their children's exit statuses)."""
    (tmp_path / "my_rewards.py").write_text(readme_reward_module())
    sandboxes = tmp_path / "tmp"
    sandboxes.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(sandboxes))  # the server and its workers take the environment of the pool
    cfg = RewardConfig(functions=["my_rewards:passes_tests"], worker_init="my_rewards:start_sandbox")
    pidfds = record_processes(monkeypatch)
    codes = ["def f():\n    return 1", "def f():\n    return 2", "def f(:", "def f():\n    return 1"] * 2
    tests = ["assert f() == 1"] * 8
    with RewardPool(cfg, 2) as pool:
        pool.submit(0, ["write f"] * 4, codes[:4], {"tests": tests[:4]})
        pool.submit(1, ["write f"] * 4, codes[4:], {"tests": tests[4:]})
        result, times = pool.gather()
        pids = {w.pid for w in pool._workers}
    assert result.per_function["passes_tests"] == [1.0, 0.0, 0.0, 1.0] * 2
    assert result.faults["passes_tests"] == dict.fromkeys(COUNTERS, 0) and times["reward/workers_respawned"] == 0
    owners = {int(d.name.split("-")[1]) for d in sandboxes.iterdir() if d.name.startswith("sandbox-")}
    assert owners == pids and len(pids) == 2  # one sandbox per worker, made in the worker
    assert all(exited(fd) for fd in pidfds)


def test_a_hostile_reward_run_finishes_with_every_fault_counted(user_modules, tmp_path, monkeypatch):
    """Issue 23's run, shrunk: 6 GRPO steps of the tiny recipe with 2 workers and a reward of which 1 completion in
    23 hangs, 1 raises, 1 calls os._exit and 1 returns NaN. Every step logs exactly the faults, isolated completions,
    kills and mean score that the completions it generated imply, every innocent completion keeps its score, and
    time/reward_wait is within the pool's documented bound."""
    from pool_hostile import kind

    from fastgrpo.config import load_config
    from fastgrpo.metrics import read_jsonl
    from fastgrpo.trainer import Trainer

    steps, submitted = [], []
    real_submit, real_gather = RewardPool.submit, RewardPool.gather

    def submit(self, index, prompts, completions, columns):
        submitted.append((index, list(zip(prompts, completions))))
        return real_submit(self, index, prompts, completions, columns)

    def gather(self):
        result, times = real_gather(self)
        steps.append(([group for _, group in sorted(submitted)], result.per_function["hostile"]))
        submitted.clear()
        return result, times

    monkeypatch.setattr(RewardPool, "submit", submit)
    monkeypatch.setattr(RewardPool, "gather", gather)
    timeout_s, workers = 0.2, 2
    cfg = load_config(overrides=[
        "grpo.num_prompts_per_step=12", "grpo.num_generations=4", "rollout.max_new_tokens=8", "sft.warmup_steps=0",
        "train.num_threads=1", "train.max_steps=6", "eval.at_start=false", "eval.every_steps=0",
        "checkpoint.every_steps=0", "logging.progress_bar=false", f"logging.output_dir={tmp_path}",
        f"reward.num_workers={workers}", f"reward.timeout_s={timeout_s}", "reward.functions=[pool_hostile:hostile]"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        Trainer(cfg).fit()
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "time/reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and len(steps) == 6
    behaviours = {0: "hang", 1: "raise", 2: "exit", 3: "nan"}
    total = dict.fromkeys(COUNTERS, 0)
    for row, (groups, got) in zip(rows, steps):
        scores, counts, kills, killed_calls = expectation(groups, lambda pc: behaviours.get(kind(*pc)),
                                                          lambda pc: len(pc[1]) % 7 / 7)
        assert got == scores  # the innocent completions of a failed chunk keep their own scores
        assert {f: row[f"reward/hostile/{f}"] for f in COUNTERS} == counts
        assert row["reward/workers_respawned"] == kills
        assert row["reward/hostile/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-12)
        assert row["time/reward_wait"] <= wait_bound(killed_calls, counts["timeouts"], workers, row, timeout_s)
        total = {f: total[f] + counts[f] for f in COUNTERS}
    assert all(total.values()), total  # the run met every kind of fault and isolated chunks
    assert any(kind(*pc) == 2 for groups, _ in steps for g in groups for pc in g)  # and a worker exit
