"""What an environment call costs in the reward workers, and what a tool that kills its worker costs.

Run: ``python bench/bench_environments.py`` (``--calls``, ``--deaths``). Sequential calls (one in flight, as one
paused sample sees them) through :class:`fastgrpo.environments.EnvironmentPool` on a pool of 2 workers, in the
process state users run in:

- ``in_process_us``: the tool itself (``add``), called here: the baseline;
- ``tools_ms`` / ``factory_ms`` / ``step_ms``: one turn's round trip (submit → answer) for the plain tool, the same
  tool on a stateful ``AdderEnvironment`` instance pinned to its worker, and a sliding-puzzle step (its state
  pickled there and back); medians over ``--calls``;
- ``death_ms``: a tool that calls ``os._exit``: from the call's submission to its "error" answer (the supervisor
  sees the death), then ``respawn_ms``: the next call on that worker, which waits for the replacement (a fork of
  the warm server) to start and answer; medians over ``--deaths``, with the environment modules preloaded by the
  server (``preload=environment_modules(...)``) and without (each new worker imports them at its first task).
  The pool without preloading runs first (the first pool's calls are also the process's first: slower).

Rows go to ``bench/results/environments.csv`` (with the machine's 1-minute load average).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import append_rows, print_table

from fastgrpo.config import RewardConfig
from fastgrpo.environments import EnvironmentPool, environment_modules
from fastgrpo.environments.adder import AdderEnvironment, add
from fastgrpo.environments.sliding_puzzle import SlidingPuzzle
from fastgrpo.environments.tools import ToolCall
from fastgrpo.rewards.pool import RewardPool

CRASHER = '''
import os


class Crasher:
    def reset(self, **row):
        return None

    def crash(self) -> str:
        """Exit the worker."""
        os._exit(3)

    def ok(self) -> str:
        """Answer."""
        return "ok"
'''


def wait(submit) -> tuple[object, str | None, float]:
    """Run one pool call (``submit(done)``) and wait for its answer: (answer, fault, seconds)."""
    box, event = {}, threading.Event()

    def done(answer, fault):
        box["out"] = (answer, fault)
        event.set()

    start = time.perf_counter()
    submit(done)
    event.wait()
    return (*box["out"], time.perf_counter() - start)


def roundtrips(envs: EnvironmentPool, calls: int) -> dict[str, float]:
    key = (999, 0, 0)
    wait(lambda done: envs.reset(key, "adder", {"answer": 3}, 0, done))
    out = {}
    for name, submit in [
        ("tools_ms", lambda done: envs.call_tools(None, "plain", [ToolCall("add", {"a": 1, "b": 2})], None, done)),
        ("factory_ms", lambda done: envs.call_tools(key, "adder", [ToolCall("add", {"a": 1, "b": 2})], 0, done)),
    ]:
        times = [wait(submit)[2] for _ in range(calls)]
        out[name] = 1e3 * statistics.median(times)
    _, state = SlidingPuzzle().reset(seed=1)
    times = [wait(lambda done: envs.step("puzzle", "<action>up</action>", dict(state), done))[2] for _ in range(calls)]
    out["step_ms"] = 1e3 * statistics.median(times)
    return out


def deaths(envs: EnvironmentPool, n: int) -> dict[str, float]:
    died, respawned = [], []
    for i in range(n):
        key = (1000 + i, 0, 0)
        wait(lambda done, key=key: envs.reset(key, "crasher", {}, 0, done))
        answer, fault, s = wait(lambda done, key=key: envs.call_tools(key, "crasher", [ToolCall("crash", {})], 0,
                                                                      done))
        assert fault == "failures", (answer, fault)
        died.append(s)
        answer, fault, s = wait(lambda done: envs.call_tools(None, "plain", [ToolCall("add", {"a": 1, "b": 1})],
                                                             0, done))
        assert fault is None and answer[0].content == "2", (answer, fault)
        respawned.append(s)
    return {"death_ms": 1e3 * statistics.median(died), "respawn_ms": 1e3 * statistics.median(respawned)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--deaths", type=int, default=20)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    Path(tmp, "bench_crasher.py").write_text(CRASHER)
    sys.path.insert(0, tmp)
    import bench_crasher

    start = time.perf_counter()
    for _ in range(args.calls):
        add(1, 2)
    rows = []
    in_process_us = 1e6 * (time.perf_counter() - start) / args.calls
    factories = {"plain": None, "adder": AdderEnvironment, "puzzle": SlidingPuzzle, "crasher": bench_crasher.Crasher}
    for preload in (False, True):
        modules = environment_modules(factories, [add]) if preload else ()
        with RewardPool(RewardConfig(functions=["format"], timeout_s=5.0), 2, preload=modules) as pool:
            envs = EnvironmentPool(pool, factories, [add])
            row = {"preload": preload, "load": round(os.getloadavg()[0], 2), "in_process_us": round(in_process_us, 2)}
            row.update({k: round(v, 3) for k, v in roundtrips(envs, args.calls).items()})
            row.update({k: round(v, 3) for k, v in deaths(envs, args.deaths).items()})
            rows.append(row)
    print_table(rows, "environment calls in the reward workers (2 workers)")
    append_rows("environments", rows, "cpu")


if __name__ == "__main__":
    main()
