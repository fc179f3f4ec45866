"""Reward scoring in the training process vs the worker pool, on the tiny demo: step time and the share hidden; and
what a worker costs: the time from its death to its replacement scoring, and its memory.

Run: ``python bench/bench_rewards.py`` (``--steps``, ``--reward-delay-ms``, ``--workers``, ``--deaths``; ``--part
steps`` or ``--part workers`` for one half; ``--quick`` for a smoke run). Everything is timed in the process state
users run in (default allocator and threads); memory is read from ``/proc`` of the worker processes, which changes
nothing in them.

**Steps.** For each reward cost (the demo's math reward alone, then with a synthetic ``--reward-delay-ms`` per
completion, standing in for math-verify/sympy on long answers) it builds one ``tiny``-recipe trainer with
``reward.num_workers=0`` (scored after generation, in process) and one per ``--workers`` count, gives each the same
supervised warm-up, then runs their GRPO steps round-robin (step 1 of each, step 2 of each, ...), so the load of a
shared machine drifts alike for all. Same seeds: every trainer samples and scores the same completions
(``same_rewards`` checks that their ``reward/mean`` agree at every step). Medians over the steps after the first
(which pays the workers' start):

- ``step_s``: ``time/step``; ``gen_s``: ``time/generation`` (with the pool it includes decoding and submitting
  each finished group); ``reward_s``: ``time/reward`` (first submission → last score); ``wait_s``:
  ``time/reward_wait`` (what the step waited for after generation);
- ``hidden``: ``1 − wait_s / reward_s``, the share of the reward time hidden behind generation;
- ``x_step``: the in-process step time / this row's step time.

Groups reach the pool as they finish: with the demo's settings all 256 sequences decode in one wave and end
together after ~8 tokens, leaving little to overlap; ``--max-batch-size 32`` decodes in 8 waves, as a long
rollout whose groups finish at different times would.

The reward work and generation share the machine's cores.

**Workers** (``measure`` = respawn / memory rows), with the ``math`` reward and :func:`reward_functions.crash`, as
``torchrun fastgrpo/train.py`` runs them (this script imports the trainer at the top, as ``train.py`` does: a pool
that re-imports the entry script in its workers pays for that here too):

- ``respawn_ms``: one worker scores ``--deaths`` groups each holding one completion that kills it, then as many
  groups without; the difference of the two ``gather`` times divided by the deaths is the cost of one death: from
  the worker's exit to its replacement ready and scoring again. ``start_ms``: the pool's own
  ``time/reward_worker_start / reward/workers_respawned`` over the first run (the waits for readiness alone).
  ``first_ready_s``: from building the pool to the first group scored.
- ``pss_mib_per_worker`` / ``rss_mib_per_worker``: the proportional-set (shared pages split among their users) and
  resident sizes of every process the pool added (``pool_procs``: its workers, and its server where there is one),
  summed and divided by ``--workers``' largest count, with the workers warm (every function called). PSS is what
  the node pays; RSS counts each shared page in every process.

Rows go to ``bench/results/rewards.csv`` (with the 1-minute load average of the machine when the row was made).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import append_rows, print_table
from reward_functions import CRASH, DELAY_ENV

from fastgrpo.algorithms.sft import sft_warmup
from fastgrpo.config import RewardConfig, load_config
from fastgrpo.metrics import MetricsLogger
from fastgrpo.rewards import clear_caches
from fastgrpo.rewards.pool import RewardPool
from fastgrpo.trainer import Trainer


def compare(steps: int, workers: list[int], delay_ms: float, warmup: int, max_batch_size: int) -> list[dict]:
    """One row per worker count (0 first): medians over steps 2.. of trainers stepped round-robin."""
    os.environ[DELAY_ENV] = str(delay_ms)  # before the pools start: their workers inherit the environment
    clear_caches()  # the in-process trainer starts as cold as the new workers (its verdicts of the last run are gone)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        try:
            for w in workers:
                trainers[w] = Trainer(load_config("tiny", None, [
                    f"sft.warmup_steps={warmup}", "logging.progress_bar=false", f"logging.output_dir={tmp}/{w}",
                    f"reward.num_workers={w}", f"rollout.max_batch_size={max_batch_size}",
                    f"reward.functions=[{'reward_functions:delayed_math' if delay_ms else 'math'}]"]))
                sft_warmup(trainers[w].ctx, *trainers[w].algorithm.warmup_examples())
                trainers[w].algorithm.begin()
            logger = MetricsLogger(tmp, enabled=False)
            logs = {w: [] for w in workers}
            for _ in range(steps):
                for w, trainer in trainers.items():
                    logs[w].append(trainer.train_step(logger))
        finally:
            for trainer in trainers.values():
                trainer.close()
    same = all(a["reward/mean"] == b["reward/mean"] for w in workers for a, b in zip(logs[w], logs[workers[0]]))
    keys = ("time/step", "time/generation", "time/reward", "time/reward_wait")
    med = {w: {k: statistics.median(m[k] for m in logs[w][1:]) for k in keys} for w in workers}
    rows = []
    for w in workers:
        t = med[w]
        rows.append({"measure": "steps", "delay_ms": delay_ms, "batch": max_batch_size, "workers": w,
                     "steps": steps - 1,
                     "step_s": t["time/step"], "gen_s": t["time/generation"], "reward_s": t["time/reward"],
                     "wait_s": t["time/reward_wait"],
                     "hidden": 1 - t["time/reward_wait"] / t["time/reward"] if t["time/reward"] > 0 else 0.0,
                     "x_step": med[workers[0]]["time/step"] / t["time/step"], "same_rewards": same,
                     "loadavg_1min": os.getloadavg()[0]})
    return rows


def _groups(n: int, text: str) -> list[tuple[list[str], list[str], dict[str, list]]]:
    """``n`` one-completion groups of ``text`` (a correct math answer: every function is called)."""
    return [(["q"], [f"{text} \\boxed{{{i}}}"], {"answer": [str(i)]}) for i in range(n)]


def _score(pool: RewardPool, groups) -> tuple[float, dict[str, float]]:
    """Wall time of submitting ``groups`` and gathering their scores, and the pool's times."""
    start = time.perf_counter()
    for i, g in enumerate(groups):
        pool.submit(i, *g)
    _, times = pool.gather()
    return time.perf_counter() - start, times


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(d))
    return children


def _pool_memory_kib() -> tuple[int, int, int]:
    """(processes, summed RSS, summed PSS) of this process's descendants: the pool's processes."""
    children, todo, procs, rss, pss = _children(), [os.getpid()], 0, 0, 0
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.endswith("kB\n"))}
            procs, rss, pss = procs + 1, rss + kib["Rss"], pss + kib["Pss"]
    return procs, rss, pss


def workers_cost(deaths: int, workers: int) -> list[dict]:
    """The respawn row (one worker, ``deaths`` deaths) and the memory row (``workers`` warm workers)."""
    cfg = RewardConfig(functions=["math", "reward_functions:crash"])
    start = time.perf_counter()
    with RewardPool(cfg, 1) as pool:
        _score(pool, _groups(1, "warm"))
        first_ready_s = time.perf_counter() - start
        crashing, times = _score(pool, _groups(deaths, CRASH))
        assert times["reward/workers_respawned"] == deaths, times
        healthy, _ = _score(pool, _groups(deaths, "fine"))
    rows = [{"measure": "respawn", "workers": 1, "deaths": deaths, "first_ready_s": first_ready_s,
             "respawn_ms": (crashing - healthy) / deaths * 1e3,
             "start_ms": times["time/reward_worker_start"] / deaths * 1e3, "loadavg_1min": os.getloadavg()[0]}]
    with RewardPool(cfg, workers) as pool:
        _score(pool, _groups(4 * workers, "warm"))  # every worker has called both functions
        procs, rss, pss = _pool_memory_kib()
    rows.append({"measure": "memory", "workers": workers, "pool_procs": procs,
                 "pss_mib_per_worker": pss / workers / 1024, "rss_mib_per_worker": rss / workers / 1024,
                 "loadavg_1min": os.getloadavg()[0]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is not counted)")
    ap.add_argument("--reward-delay-ms", type=float, default=5.0, help="synthetic cost per completion (0: none)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool sizes to compare with in-process")
    ap.add_argument("--warmup", type=int, default=100, help="supervised warm-up steps (the policy learns \\boxed{})")
    ap.add_argument("--max-batch-size", type=int, default=256, help="rollout.max_batch_size: sequences decoded at "
                    "once (the demo's 256 decodes the step's 32 x 8 in one wave: its groups all finish at the end)")
    ap.add_argument("--deaths", type=int, default=5, help="worker deaths timed by the respawn measurement")
    ap.add_argument("--part", choices=("all", "steps", "workers"), default="all",
                    help="steps: in process vs the pool; workers: respawn time and memory per worker")
    ap.add_argument("--quick", action="store_true", help="3 steps, 20 warm-up steps, one pool size, 2 deaths")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.workers, args.deaths = 3, 20, args.workers[:1], 2
    out = []
    if args.part in ("all", "workers"):  # first: no trainer's pool is running beside it
        rows = workers_cost(args.deaths, max(args.workers))
        print_table(rows, "reward workers: respawn time (one worker) and memory per worker (warm)")
        out += rows
    if args.part in ("all", "steps"):
        steps = []
        for delay in dict.fromkeys([0.0, args.reward_delay_ms]):
            rows = compare(args.steps, [0, *args.workers], delay, args.warmup, args.max_batch_size)
            print_table(rows)
            steps += rows
        print_table(steps, "\nreward scoring: in process (workers=0) vs the pool, tiny demo")
        out += steps
    print(f"rows appended to {append_rows('rewards', out, 'cpu')}")


if __name__ == "__main__":
    main()
