"""Reward scoring off the critical path: worker processes per rank with hard time limits, fed while decoding.

The trainer submits each GRPO group as soon as the engine finishes it (:meth:`RewardPool.submit`) and collects
every score, in prompt order, before computing advantages (:meth:`RewardPool.gather`)::

    pool = RewardPool(cfg.reward, num_workers=3)       # starts the workers' server; they load the functions by name
    pool.submit(p, prompts_G, completions_G, columns)  # one group, any order; returns at once
    result, times = pool.gather()                      # RewardResult in submission-index order
    pool.close()                                       # also on Ctrl-C / errors: no orphan processes

Work is cut into tasks: one reward function on one chunk of at most ``CHUNK_SIZE`` = 4 completions of a group
(the same fixed chunks :class:`fastgrpo.rewards.RewardSet` scores in process, so scores do not depend on
``num_workers`` nor on the order groups finish). A task is a call ``fn(*args)`` of a module-level function (sent by
name) with a budget in seconds: a reward task calls one of the functions the worker loaded when it started; other
work with a hard time limit runs in the same workers the same way through :meth:`RewardPool.run` (environment steps
and tool calls, :mod:`fastgrpo.environments`), which may pin a task to one worker (where its state lives): each
worker takes its own pinned tasks before the shared queue's. A parent-side supervisor thread per worker keeps
``PIPELINE_DEPTH`` = 2 tasks at its worker (the next waits in the pipe, so the worker never idles waiting for the
thread, which shares the GIL with the generation loop). The worker runs them one at a time; a task's budget starts
when the worker starts it (when the task before it answered). Past it, the worker is killed, the task waiting
behind it goes back to the queue, and a new worker is started at once; a worker that dies during a task (segfault,
``os._exit``, OOM kill) is replaced the same way. ``reward/workers_respawned`` counts both.

**Fault isolation.** A reward call's budget is ``reward.timeout_s`` for the whole chunk (the ``math`` built-in,
which times each completion itself, gets ``k × timeout_s`` for k completions, a limit only code that escapes its
alarm reaches). When the call on several completions fails as a whole (past its budget, the function raised or
returned the wrong number of scores, or its worker died), each of its completions is queued again as a task of its
own, with a budget of ``timeout_s``, at the front of the queue (they hold up :meth:`gather`), and counted in
``reward/<name>/isolated``; a task of one completion that fails scores 0 and counts in ``reward/<name>/timeouts``
(past its budget) or ``reward/<name>/failures`` (raised, wrong length, worker died or could not start). So only a
faulty completion scores 0, and an innocent one that shared its chunk gets the score it gets alone; a NaN or ±inf
score is its own completion's fault already (``reward/<name>/nonfinite``). The supervisor threads run the re-runs:
:meth:`submit` still returns at once. A re-run, or a task sent back to the queue, never waits in a worker's pipe
behind another task: it is sent only to a worker with nothing in flight.

**Longest wait.** Let t = ``reward.timeout_s``, W the workers and, for one step's reward tasks: S the summed time of
the calls that answered (the innocent completions of a failed call are scored twice: in it, and alone), C the calls
on several completions killed at their budget (each holds a completion that then times out alone, or takes longer
than t in all), H the completions that time out alone. A killed task holds its worker for its budget, t, so the
workers are busy S + (C + H)·t in all, plus the start-ups. A worker idles only while the queue is empty (one with
nothing in flight takes a task at once), so at each such moment the step's last task, or the chunk a re-run comes
from, is running or waits in a pipe behind a running task. A task waits in a pipe only at its first dispatch, and
before that it was in the queue from :meth:`submit` on, since before the wait began. So the idle moments lie within
at most three tasks of at most t each (the one the chunk waited behind, the chunk, its re-run), and Graham's
list-scheduling argument gives

    time/reward_wait ≤ (S + (C + H)·t) / W + 3·t·(1 − 1/W) + time/reward_worker_start + milliseconds per task,

the third term being the summed waits for workers to become ready (the first step's start-up, then each respawn:
a fork and ``reward.worker_init``; at most :data:`fastgrpo.rewards.processes.WORKER_START_TIMEOUT_S` each, after
which the task fails). With no fault (C = H = 0) that is S/W plus at most three calls. With fast functions (S ≈ 0)
and one hang per failed chunk (C = H), a step waits at most 2·H·t / W + 3·t: each hang costs its chunk's budget
once, then its own (with ``k × t`` for a chunk, as before isolation, it would cost (k + 1)·t). A ``math`` call
killed past its ``k × t`` counts k·t in C's term and in the tail.

**Processes, isolation and memory.** The pool starts one server per pool, a fresh interpreter (``python -c``, with
the trainer's ``sys.path``, working directory and environment as they are when the pool is built) that imports only
:mod:`fastgrpo.rewards` and the modules of the configured functions and of ``reward.worker_init`` (math-verify and
sympy for ``math``), and never the entry script: no ``__main__`` is re-run, so ``torchrun fastgrpo/train.py`` does
not bring torch into the workers (a reward module that imports torch does; torch then runs on one thread there). A
worker is a ``fork`` of that warm server: ready after a fork and ``reward.worker_init``, instead of a ``spawn``ed
interpreter importing the entry script, torch, math-verify and sympy again. Workers share the server's pages until
they write them: each adds what its own scoring touches (its PSS, not its RSS, is its cost), and none holds torch.
The respawn time (a worker's death to its replacement scoring) and the memory per warm worker (PSS and RSS, the
server's share included) are measured by ``bench/bench_rewards.py --part workers`` (rows in
``bench/results/rewards.csv``; figures in docs/benchmarks.md). The server inherits no CUDA context, tensor or file of
the trainer (``close_fds``, stdin from ``/dev/null``); a worker's descriptors are stdio and its pipe (plus any a
reward module opened at import time). Per-worker state (sandboxes, connections, threads) belongs in
``reward.worker_init``, which runs in each worker after the fork, never in the server: a module's import-time state
is copied into every worker (and CUDA, initialised before a fork, is unusable after it). Workers and the server
ignore SIGINT (Ctrl-C reaches the whole process group; the trainer shuts them down) and exit when their pipe closes;
on Linux the server gets SIGKILL when the trainer thread that started it exits, and a worker when the server does,
so a killed trainer leaves none behind (a dead server is restarted at the next worker start; its workers die with it
and count as respawned). The trainer watches and kills a worker through a pidfd (Linux ≥ 5.3), so a recycled pid is
never signalled; elsewhere through its pid. A reward may start processes (``subprocess`` sees their exit statuses:
the workers reset SIGCHLD); those that outlive a killed worker are not stopped by the pool.

Modules: this one (the task queue, the supervisor threads, :class:`RewardPool`); :mod:`fastgrpo.rewards.processes`
(the trainer's handles on the server and the workers); :mod:`fastgrpo.rewards.worker` (the code that runs in them).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastgrpo.config import RewardConfig
from fastgrpo.rewards.processes import WORKER_START_TIMEOUT_S, WORKER_STOP_TIMEOUT_S, ServerProcess, WorkerProcess
from fastgrpo.rewards.scoring import (
    CHUNK_SIZE,
    COUNTERS,
    RewardResult,
    RewardSet,
    Scores,
    add_faults,
    call_budget,
    chunks,
    combine,
    function_name,
    no_scores,
)
from fastgrpo.rewards.worker import score_task

PIPELINE_DEPTH = 2  # tasks sent ahead to a worker: the next one waits in its pipe while it runs one
GATHER_POLL_S = 0.5  # gather() wakes this often, so Ctrl-C is seen while it waits


def default_num_workers(busy_cores_per_rank: int, local_world_size: int) -> int:
    """The cores this node's ranks leave free, divided among them, at least 1.

    ``busy_cores_per_rank``: the cores a rank keeps busy (its torch threads on CPU; its Python thread on GPU).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(local_world_size, 1)
    return max(1, (cores - busy_cores_per_rank * local) // local)


@dataclass
class _Task:
    fn: Callable  # a module-level function: the worker runs fn(*args) and sends back what it returns
    args: tuple
    budget_s: float  # the hard time limit of one run, from when the worker starts it
    done: Callable[[object, str | None], None]  # called (on a supervisor thread) with the worker's answer and None,
    # or None and the fault ("timeouts": past its budget, "failures": the worker died or could not start)
    worker: int | None = None  # the worker it must run on (its state lives there); None: any
    pipe: bool = True  # whether it may wait in a worker's pipe behind another task: not a re-run nor a task sent
    # back (the wait bound in the module docstring)


class _TaskQueue:
    """The tasks not yet sent: one queue any worker takes from, and one per worker for tasks pinned to it (taken
    first: an environment step holds a paused sample, a reward chunk waits only for gather)."""

    def __init__(self, num_workers: int):
        self.shared: deque[_Task] = deque()
        self.pinned: list[deque[_Task]] = [deque() for _ in range(num_workers)]
        self.cond = threading.Condition()
        self.closed = False

    def put(self, task: _Task, *, front: bool = False) -> None:
        with self.cond:
            q = self.shared if task.worker is None else self.pinned[task.worker]
            q.appendleft(task) if front else q.append(task)
            self.cond.notify_all()

    def get(self, worker: int, *, pipe: bool) -> _Task | None:
        """The next task for ``worker``: its own first, then a shared one; None when closed. ``pipe``: to wait in
        the worker's pipe behind the task it runs: None at once when there is none or the next one may not
        (:attr:`_Task.pipe`); else it waits for one."""
        with self.cond:
            while not self.closed:
                for q in (self.pinned[worker], self.shared):
                    if q:
                        return q.popleft() if q[0].pipe or not pipe else None
                if pipe:
                    return None
                self.cond.wait()
            return None

    def empty(self) -> bool:
        with self.cond:
            return not self.shared and not any(self.pinned)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class RewardPool:
    """The configured reward functions, scored by ``num_workers`` worker processes (0: in this process).

    See the module docstring for the scheduling, the time bound and the counters. ``num_workers=0`` keeps every
    submitted group until :meth:`gather`, which scores them here with :class:`fastgrpo.rewards.RewardSet`.
    """

    def __init__(self, cfg: RewardConfig, num_workers: int, *, preload: Sequence[str] = ()):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.cfg, self.num_workers = cfg, num_workers
        self.names = [function_name(n) for n in cfg.functions]
        self.weights = list(cfg.weights) or [1.0] * len(self.names)
        self._batches: dict[int, tuple[list[str], list[str], dict[str, list]]] = {}
        self._in_process = RewardSet(cfg) if num_workers == 0 else None
        self._results: dict[tuple[int, int, int], Scores] = {}  # (batch, function, first completion) -> scores
        self._expected = 0
        self._first_submit = self._last_result = None
        self._respawned = 0
        self._start_wait_s = 0.0
        self._errors: set[str] = set()
        self._warned: set[str] = set()
        self._lock = threading.Condition()
        self._close_lock = threading.Lock()
        self._closed = False
        self._queue = _TaskQueue(num_workers)
        self._server = ServerProcess({"functions": list(cfg.functions), "worker_init": cfg.worker_init,
                                "timeout_s": cfg.timeout_s, "preload": list(preload)}) if num_workers else None
        self._workers = [WorkerProcess(self._server) for _ in range(num_workers)]
        self._threads = []
        if self._server is not None:
            self._server.start()  # it imports the reward modules while the trainer builds its model
        for i, w in enumerate(self._workers):  # each supervisor starts its worker at once
            t = threading.Thread(target=self._supervise, args=(w, i), daemon=True, name=f"reward-supervisor-{i}")
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
                for a, *chunk in chunks(prompts, completions, columns):
                    self._expected += 1
                    self._queue.put(self._reward_task((index, f, a), (f, *chunk), alone=False))

    def run(self, fn: Callable, args: tuple, budget_s: float, done: Callable[[object, str | None], None], *,
            worker: int | None = None) -> None:
        """Run ``fn(*args)`` (a module-level function) in a worker, on ``worker`` when given (where its state lives),
        under the same hard limit, kill and respawn as a reward chunk; returns at once.

        ``done(answer, None)`` gets what ``fn`` returned, or ``done(None, fault)`` the fault: "timeouts" when it ran
        past ``budget_s`` (the worker was killed and replaced), "failures" when the worker died in it or could not
        start. ``done`` runs on a supervisor thread and must not block. Such tasks are not part of :meth:`gather`.
        """
        if self._closed:
            raise RuntimeError("RewardPool.run after close()")
        if self._server is None:
            raise ValueError("RewardPool.run needs worker processes (num_workers >= 1)")
        if worker is not None and not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker}")
        self._queue.put(_Task(fn, args, budget_s, done, worker))

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
            self._batches = {}
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
        faults = {name: dict.fromkeys(COUNTERS, 0) for name in self.names}
        for (_, f, _), (scores, counts) in sorted(results.items()):  # batch, then function, then completion order
            per_function[self.names[f]] += scores
            add_faults(faults[self.names[f]], counts)
        end = time.perf_counter()
        times.update({"time/reward": max(last, start) - first, "time/reward_wait": end - start})
        return combine(self.names, self.weights, per_function, faults), times

    def _score_in_process(self) -> RewardResult:
        parts = [self._in_process.score(*self._batches[i]) for i in sorted(self._batches)]
        per_function = {name: [s for p in parts for s in p.per_function[name]] for name in self.names}
        faults = {name: dict.fromkeys(COUNTERS, 0) for name in self.names}
        for p in parts:
            for name in self.names:
                add_faults(faults[name], p.faults[name])
        return combine(self.names, self.weights, per_function, faults)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (tasks still queued or running then get no answer)."""
        return self._closed

    def close(self) -> None:
        """Stop every worker (asked first, killed after WORKER_STOP_TIMEOUT_S). Idempotent; safe in ``finally``."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._queue.close()
        for w in self._workers:
            w.stop()
        if self._server is not None:
            self._server.close()
        for t in self._threads:
            t.join(WORKER_STOP_TIMEOUT_S)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ supervisor threads

    def _supervise(self, worker: WorkerProcess, index: int) -> None:
        """Feed one worker; every task taken gets a result or goes back to the queue, whatever the worker does."""
        inflight: deque[_Task] = deque()  # sent to the worker, in order: it runs the head, the rest wait in its pipe
        deadline = 0.0  # when the head's budget runs out
        try:
            self._ready(worker)  # started now, overlapping the trainer's set-up (on failure: again at its first task)
        except Exception as e:  # noqa: BLE001 - e.g. close() pulled the pipe away
            self._errors.add(f"reward worker error: {type(e).__name__}: {e}")
        while not self._closed:
            try:
                # PIPELINE_DEPTH tasks at the worker: it never waits for this thread (and the GIL it shares with the
                # generation loop) between two tasks
                while len(inflight) < PIPELINE_DEPTH:
                    task = self._queue.get(index, pipe=bool(inflight))
                    if task is None:
                        if self._closed:
                            return
                        break
                    if self._closed:
                        return
                    if not inflight and not self._ready(worker):
                        task.done(None, "failures")
                        continue
                    try:
                        worker.conn.send((task.fn, task.args))
                    except OSError:  # it died since its last answer: the poll below, or the next _ready, sees it
                        task.pipe = False
                        self._queue.put(task, front=True)
                        break
                    if not inflight:
                        deadline = time.perf_counter() + task.budget_s
                    inflight.append(task)
                if not inflight:
                    continue
                head, fault, result = inflight[0], None, None
                if not worker.conn.poll(max(deadline - time.perf_counter(), 0.0)):
                    fault = self._lose(worker, inflight, "timeouts")  # killing it is the only way to stop any code
                else:
                    try:
                        result = worker.conn.recv()
                        inflight.popleft()
                    except (EOFError, OSError):  # died mid-task (segfault, SIGKILL, os._exit): EOF or a reset pipe
                        fault = self._lose(worker, inflight, "failures")
                head.done(result, fault)
                if inflight:  # the worker started the next task when it sent this answer
                    deadline = time.perf_counter() + inflight[0].budget_s
            except Exception as e:  # noqa: BLE001 - e.g. close() pulled the pipe away: the tasks still get an answer
                if self._closed:
                    return
                self._errors.add(f"reward worker error: {type(e).__name__}: {e}")
                worker.kill()
                while inflight:
                    inflight.popleft().done(None, "failures")

    def _ready(self, worker: WorkerProcess) -> bool:
        """Start the worker if it is not running (counted when it died) and wait until it has loaded the functions;
        False when it could not start, died, or was not ready within WORKER_START_TIMEOUT_S."""
        if not worker.alive():  # never started, killed after its last task, or died while idle
            if worker.started:
                worker.kill()
                self._count_respawn()
            if not self._start(worker):
                return False
        if worker.ready:
            return True
        start = time.perf_counter()
        errors = None
        if worker.conn.poll(WORKER_START_TIMEOUT_S):
            try:
                errors = worker.conn.recv()
            except (EOFError, OSError):  # died in reward.worker_init
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

    def _lose(self, worker: WorkerProcess, inflight: deque[_Task], fault: str) -> str:
        """The worker hung or died in the head task: respawn it; the head fails as ``fault`` (returned), the tasks
        waiting behind it (never started) go back to the front of the queue, in order, never to wait in a pipe
        again."""
        inflight.popleft()
        while inflight:
            task = inflight.pop()
            task.pipe = False
            self._queue.put(task, front=True)
        self._respawn(worker)
        return fault

    def _reward_task(self, key: tuple[int, int, int], args: tuple, *, alone: bool) -> _Task:
        """The task of reward function ``args[0]`` on the completions of ``args`` (``alone``: one completion of a
        failed call, re-run); its answer is kept under ``key``, (batch, function, first completion)."""
        budget = call_budget(self.cfg.functions[args[0]], len(args[2]), self.cfg.timeout_s)
        return _Task(score_task, args, budget, functools.partial(self._store, key, args, alone), pipe=not alone)

    def _store(self, key: tuple[int, int, int], args: tuple, alone: bool, answer: Scores | str | None,
               fault: str | None) -> None:
        """A reward task's answer, kept for gather(). A call that failed as a whole (``fault``, or the worker's answer
        naming one) on several completions queues each of them again alone, first; on one, it scores 0 as that
        fault."""
        fault = fault or (answer if isinstance(answer, str) else None)
        n = len(args[2])
        if fault and n > 1:
            index, f, a = key
            singles = [self._reward_task((index, f, a + j), (f, *one), alone=True) for j, *one in chunks(*args[1:], 1)]
            with self._lock:
                self._expected += n - 1  # the call's one result becomes n
            for task in reversed(singles):
                self._queue.put(task, front=True)
            return
        scores, counts = no_scores(n, fault) if fault else answer
        with self._lock:
            self._results[key] = (scores, {**counts, "isolated": 1} if alone else counts)
            self._last_result = time.perf_counter()
            self._lock.notify_all()

    def _start(self, worker: WorkerProcess) -> bool:
        """Fork the worker from the server (the wait counts in ``time/reward_worker_start``); False when the server
        could not, or the pool is closing."""
        if self._closed:
            return False
        start = time.perf_counter()
        try:
            worker.start()
        except OSError as e:
            if not self._closed:
                self._errors.add(f"the reward worker server could not start a worker: {type(e).__name__}: {e}")
            return False
        finally:
            with self._lock:
                self._start_wait_s += time.perf_counter() - start
        if self._closed:  # close() may have stopped this worker before it existed
            worker.kill()
            return False
        return True

    def _respawn(self, worker: WorkerProcess) -> None:
        """Kill the worker and start its replacement now, overlapping the remaining work (waited for at its next
        task); nothing starts once the pool is closing."""
        worker.kill()
        self._count_respawn()
        self._start(worker)

    def _count_respawn(self) -> None:
        with self._lock:
            self._respawned += 1


__all__ = ["CHUNK_SIZE", "RewardPool", "default_num_workers"]
