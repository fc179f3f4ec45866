"""Reward scoring off the critical path: worker processes per rank with hard time limits, fed while decoding.

The trainer submits each GRPO group as soon as the engine finishes it (:meth:`RewardPool.submit`) and collects
every score, in prompt order, before computing advantages (:meth:`RewardPool.gather`)::

    pool = RewardPool(cfg.reward, num_workers=3)       # spawns the workers; they load the functions by name
    pool.submit(p, prompts_G, completions_G, columns)  # one group, any order; returns at once
    result, times = pool.gather()                      # RewardResult in submission-index order
    pool.close()                                       # also on Ctrl-C / errors: no orphan processes

Work is cut into tasks: one reward function on one chunk of at most ``CHUNK_SIZE`` = 4 completions of a group
(the same fixed chunks :class:`fastgrpo.rewards.RewardSet` scores in process, so scores do not depend on
``num_workers`` nor on the order groups finish). A parent-side supervisor thread per worker keeps
``PIPELINE_DEPTH`` = 2 tasks at its worker (the next waits in the pipe, so the worker never idles waiting for the
thread, which shares the GIL with the generation loop). The worker runs them one at a time; a task's budget,
``k × reward.timeout_s`` for k completions, starts when the worker starts it (when the task before it answered).
Past it, the worker is killed: the k completions score 0 and count in ``reward/<name>/timeouts``, the task waiting
behind it goes back to the queue, and a new worker is spawned at once. A worker that dies during a task (segfault,
OOM kill) counts the task's completions in ``reward/<name>/failures`` and is replaced the same way.
``reward/workers_respawned`` counts both.

**Longest wait.** A task holds a worker at most ``B = 4 × timeout_s`` (plus the dispatch, milliseconds). With W
workers and T tasks not finished when generation ends, the last task to finish entered its worker's pipe at the
latest after ``(T − 1)/W`` budgets (until then every worker is busy), waits at most one budget for the task ahead
of it and runs at most one, so ``time/reward_wait ≤ (⌈T/W⌉ + 2) · 4 · timeout_s + time/reward_worker_start``, the
last term being the summed waits for workers to become ready (the first step's start-up, then each respawn: a
Python interpreter, the imports, ``reward.worker_init``; at most :data:`WORKER_START_TIMEOUT_S` each, after which
the task fails). With the demo's math reward (timeout_s = 5 s) and no hang the wait is the scoring time itself.

**Isolation and memory.** Workers are ``spawn``ed: a fresh interpreter that inherits no CUDA context, no
tensors and no open files of the trainer; only strings and the dataset columns are sent to them (pickled over a
pipe, about the size of the text). A worker imports ``fastgrpo.rewards`` (no torch: ``fastgrpo`` loads its kernels
lazily; ~20 MB, 0.5 s) and math-verify with sympy (~60 MB, ~2 s) when the ``math`` reward is on. Under ``torchrun
fastgrpo/train.py`` spawn also re-imports that script in the worker, which imports torch (~0.3 GB resident, a few
seconds; torch then runs on one thread there): the real run's 8 ranks × ~11 workers of a 96-core node hold ~30 GB
of host memory. Workers ignore SIGINT (Ctrl-C reaches the whole process group; the trainer shuts them down), exit
when their pipe closes, and on Linux get SIGKILL when the trainer thread that started them exits, so a killed
trainer leaves none behind. A reward function cannot start ``multiprocessing`` children of its own (workers are
daemonic); ``subprocess`` works.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from fastgrpo.config import RewardConfig
from fastgrpo.rewards import (
    CHUNK_SIZE,
    FAULTS,
    RewardResult,
    RewardSet,
    add_faults,
    chunk_bounds,
    combine,
    function_name,
    load_functions,
    no_scores,
    score_chunk,
)

WORKER_START_TIMEOUT_S = 300.0  # a (re)spawned worker not ready by then is killed and its task fails
WORKER_STOP_TIMEOUT_S = 2.0  # close(): how long a worker may take to exit after being asked, before it is killed
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a process gets when its parent thread exits
PIPELINE_DEPTH = 2  # tasks sent ahead to a worker: the next one waits in its pipe while it runs one
GATHER_POLL_S = 0.5  # gather() wakes this often, so Ctrl-C is seen while it waits


def default_num_workers(busy_cores_per_rank: int, local_world_size: int) -> int:
    """The cores this node's ranks leave free, divided among them, at least 1.

    ``busy_cores_per_rank``: the cores a rank keeps busy (its torch threads on CPU; its Python thread on GPU).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(local_world_size, 1)
    return max(1, (cores - busy_cores_per_rank * local) // local)


def _worker_main(conn, functions: list[str], worker_init: str, timeout_s: float) -> None:
    """A worker: load the functions, say which failed, then answer tasks until told to stop or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    if sys.platform == "linux":  # killed with the thread that started it, even in a task that never returns
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if "torch" in sys.modules:  # imported with the fastgrpo package: keep it off the trainer's cores
        sys.modules["torch"].set_num_threads(1)
    fns, errors = load_functions(functions, worker_init)
    conn.send(errors)
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if task is None:
            return
        f, prompts, completions, columns = task
        conn.send(score_chunk(fns[f], prompts, completions, columns, timeout_s, soft_limit=False))


@dataclass
class _Task:
    key: tuple[int, int, int]  # (submission index, function, chunk start)
    function: int
    prompts: list[str]
    completions: list[str]
    columns: dict[str, list]


class _Worker:
    """One worker process and its pipe; used by one supervisor thread only (and by close())."""

    def __init__(self, ctx, args: tuple):
        self.ctx, self.args = ctx, args
        self.proc = self.conn = None
        self.ready = False

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_main, args=(child, *self.args), daemon=True,
                                     name="fastgrpo-reward-worker")
        self.proc.start()
        child.close()  # the worker holds the only other end: its death reads as EOF here
        self.ready = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join()
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None
        self.ready = False

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it has not within WORKER_STOP_TIMEOUT_S."""
        proc, conn = self.proc, self.conn  # its supervisor may be killing it at the same moment
        if proc is None:
            return
        try:
            conn.send(None)
        except (OSError, AttributeError):
            pass
        proc.join(WORKER_STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()
        if self.proc is proc:
            self.proc = self.conn = None


class RewardPool:
    """The configured reward functions, scored by ``num_workers`` spawned processes (0: in this process).

    See the module docstring for the scheduling, the time bound and the counters. ``num_workers=0`` keeps every
    submitted group until :meth:`gather`, which scores them here with :class:`fastgrpo.rewards.RewardSet`.
    """

    def __init__(self, cfg: RewardConfig, num_workers: int):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.cfg, self.num_workers = cfg, num_workers
        self.names = [function_name(n) for n in cfg.functions]
        self.weights = list(cfg.weights) or [1.0] * len(self.names)
        self._batches: dict[int, tuple[list[str], list[str], dict[str, list]]] = {}
        self._in_process = RewardSet(cfg) if num_workers == 0 else None
        self._results: dict[tuple[int, int, int], tuple[list[float], dict[str, int]]] = {}
        self._expected = 0
        self._first_submit = self._last_result = None
        self._respawned = 0
        self._start_wait_s = 0.0
        self._errors: set[str] = set()
        self._warned: set[str] = set()
        self._lock = threading.Condition()
        self._spawn_lock = threading.Lock()  # no worker starts once close() has begun
        self._closed = False
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        ctx = mp.get_context("spawn")
        self._workers = [_Worker(ctx, (list(cfg.functions), cfg.worker_init, cfg.timeout_s))
                         for _ in range(num_workers)]
        self._threads = []
        try:
            for w in self._workers:
                self._start(w)
        except BaseException:
            self.close()
            raise
        for i, w in enumerate(self._workers):
            t = threading.Thread(target=self._supervise, args=(w,), daemon=True, name=f"reward-supervisor-{i}")
            t.start()
            self._threads.append(t)

    # ------------------------------------------------------------------ the trainer's side

    def submit(self, index: int, prompts: Sequence[str], completions: Sequence[str],
               columns: dict[str, list]) -> None:
        """Queue one batch (a GRPO group) for scoring; ``index`` orders it in :meth:`gather`'s result.

        ``prompts``, ``completions`` and every column hold one entry per completion.
        """
        if self._closed:
            raise RuntimeError("RewardPool.submit after close()")
        prompts, completions = list(prompts), list(completions)
        columns = {k: list(v) for k, v in columns.items()}
        if index in self._batches:
            raise ValueError(f"batch index {index} was already submitted since the last gather()")
        bad = [k for k, v in columns.items() if len(v) != len(completions)] + (
            ["prompts"] if len(prompts) != len(completions) else [])
        if bad:
            raise ValueError(f"{bad} must hold one entry per completion ({len(completions)})")
        now = time.perf_counter()
        with self._lock:
            self._first_submit = self._first_submit or now
            self._batches[index] = (prompts, completions, columns)
            if self._in_process is not None:
                return
            for f in range(len(self.names)):
                for a, b in chunk_bounds(len(completions)):
                    self._expected += 1
                    self._queue.put(_Task((index, f, a), f, prompts[a:b], completions[a:b],
                                          {k: v[a:b] for k, v in columns.items()}))

    def gather(self) -> tuple[RewardResult, dict[str, float]]:
        """Wait for every submitted batch's scores; returns them concatenated in index order, and the times.

        Times: ``time/reward`` (first submission → last score), ``time/reward_wait`` (the part spent in this
        call: after generation, the step's actual wait), ``time/reward_worker_start`` (summed waits for workers to
        start) and the count ``reward/workers_respawned``. Resets the pool for the next step. In process
        (``num_workers=0``) the scoring happens here: ``time/reward`` = ``time/reward_wait``.
        """
        start = time.perf_counter()
        if self._in_process is not None:
            result = self._score_in_process()
            end = time.perf_counter()
            self._batches.clear()
            self._first_submit = None
            return result, {"time/reward": end - start, "time/reward_wait": end - start,
                            "time/reward_worker_start": 0.0, "reward/workers_respawned": 0.0}
        with self._lock:
            while len(self._results) < self._expected:
                if self._closed:
                    raise RuntimeError("RewardPool.gather after close()")
                self._lock.wait(GATHER_POLL_S)
            results, self._results = self._results, {}
            batches, self._batches = self._batches, {}
            first, last = self._first_submit or start, self._last_result or start
            times = {"time/reward_worker_start": self._start_wait_s, "reward/workers_respawned": float(self._respawned)}
            self._expected, self._first_submit, self._last_result = 0, None, None
            self._respawned, self._start_wait_s = 0, 0.0
            new_errors = self._errors - self._warned
            self._warned |= new_errors
        for error in sorted(new_errors):
            warnings.warn(f"{error}; its completions score 0 and count in reward/<name>/failures", RuntimeWarning,
                          stacklevel=2)
        per_function = {name: [] for name in self.names}
        faults = {name: dict.fromkeys(FAULTS, 0) for name in self.names}
        for index in sorted(batches):
            n = len(batches[index][1])
            for f, name in enumerate(self.names):
                for a, _ in chunk_bounds(n):
                    scores, counts = results[(index, f, a)]
                    per_function[name] += scores
                    add_faults(faults[name], counts)
        end = time.perf_counter()
        times.update({"time/reward": max(last, start) - first, "time/reward_wait": end - start})
        return combine(self.names, self.weights, per_function, faults), times

    def _score_in_process(self) -> RewardResult:
        parts = [self._in_process.score(*self._batches[i]) for i in sorted(self._batches)]
        per_function = {name: [s for p in parts for s in p.per_function[name]] for name in self.names}
        faults = {name: dict.fromkeys(FAULTS, 0) for name in self.names}
        for p in parts:
            for name in self.names:
                add_faults(faults[name], p.faults[name])
        return combine(self.names, self.weights, per_function, faults)

    def close(self) -> None:
        """Stop every worker (asked first, killed after WORKER_STOP_TIMEOUT_S). Idempotent; safe in ``finally``."""
        with self._spawn_lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for w in self._workers:
            w.stop()
        for t in self._threads:
            t.join(WORKER_STOP_TIMEOUT_S)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ supervisor threads

    def _supervise(self, worker: _Worker) -> None:
        """Feed one worker; every task taken gets a result or goes back to the queue, whatever the worker does."""
        inflight: deque[_Task] = deque()  # sent to the worker, in order: it runs the head, the rest wait in its pipe
        deadline = 0.0  # when the head's budget runs out
        while not self._closed:
            try:
                # PIPELINE_DEPTH tasks at the worker: it never waits for this thread (and the GIL it shares with the
                # generation loop) between two tasks
                while len(inflight) < PIPELINE_DEPTH:
                    try:
                        task = self._queue.get_nowait() if inflight else self._queue.get()
                    except queue.Empty:
                        break
                    if task is None or self._closed:
                        return
                    if not inflight and not self._ready(worker):
                        self._store(task, no_scores(len(task.completions), "failures"))
                        continue
                    try:
                        worker.conn.send((task.function, task.prompts, task.completions, task.columns))
                    except OSError:  # it died since its last answer: the poll below, or the next _ready, sees it
                        self._queue.put(task)
                        break
                    if not inflight:
                        deadline = time.perf_counter() + len(task.completions) * self.cfg.timeout_s
                    inflight.append(task)
                if not inflight:
                    continue
                head = inflight[0]
                if not worker.conn.poll(max(deadline - time.perf_counter(), 0.0)):
                    result = self._lose(worker, inflight, "timeouts")  # killing it is the only way to stop any code
                else:
                    try:
                        result = worker.conn.recv()
                        inflight.popleft()
                    except (EOFError, OSError):  # died mid-task (segfault, SIGKILL, os._exit): EOF or a reset pipe
                        result = self._lose(worker, inflight, "failures")
                self._store(head, result)
                if inflight:  # the worker started the next task when it sent this answer
                    deadline = time.perf_counter() + len(inflight[0].completions) * self.cfg.timeout_s
            except Exception as e:  # noqa: BLE001 - e.g. close() pulled the pipe away: the tasks still get an answer
                if self._closed:
                    return
                self._errors.add(f"reward worker error: {type(e).__name__}: {e}")
                worker.kill()
                while inflight:
                    task = inflight.popleft()
                    self._store(task, no_scores(len(task.completions), "failures"))

    def _ready(self, worker: _Worker) -> bool:
        """Start the worker if it is not running (counted when it died) and wait until it has loaded the functions;
        False when it died or did not start within WORKER_START_TIMEOUT_S."""
        if worker.proc is None or not worker.proc.is_alive():  # killed after its last task, or died while idle
            if worker.proc is not None:
                worker.kill()
                self._count_respawn()
            self._start(worker)
        if worker.ready:
            return True
        start = time.perf_counter()
        errors = None
        if worker.conn.poll(WORKER_START_TIMEOUT_S):
            try:
                errors = worker.conn.recv()
            except (EOFError, OSError):  # died while importing or in reward.worker_init
                pass
        with self._lock:
            self._start_wait_s += time.perf_counter() - start
        if errors is None:
            self._errors.add(f"a reward worker died or did not start within {WORKER_START_TIMEOUT_S} s")
            worker.kill()
            self._count_respawn()
            return False
        self._errors.update(e for e in errors if e)
        worker.ready = True
        return True

    def _lose(self, worker: _Worker, inflight: deque[_Task], fault: str) -> tuple[list[float], dict[str, int]]:
        """The worker hung or died in the head task: respawn it; the head scores 0 as ``fault``, the tasks waiting
        behind it (never started) go back to the queue."""
        head = inflight.popleft()
        while inflight:
            self._queue.put(inflight.popleft())
        self._respawn(worker)
        return no_scores(len(head.completions), fault)

    def _store(self, task: _Task, result: tuple[list[float], dict[str, int]]) -> None:
        with self._lock:
            self._results[task.key] = result
            self._last_result = time.perf_counter()
            self._lock.notify_all()

    def _start(self, worker: _Worker) -> None:
        with self._spawn_lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            worker.start()

    def _respawn(self, worker: _Worker) -> None:
        """Kill the worker and start its replacement now, overlapping the remaining work (waited for at its next
        task); nothing starts once the pool is closing."""
        worker.kill()
        self._count_respawn()
        if not self._closed:
            self._start(worker)

    def _count_respawn(self) -> None:
        with self._lock:
            self._respawned += 1


__all__ = ["CHUNK_SIZE", "RewardPool", "default_num_workers"]
