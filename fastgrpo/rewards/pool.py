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
thread, which shares the GIL with the generation loop). The worker runs them one at a time; a
task's budget, ``k × reward.timeout_s`` for k completions, starts when the worker starts it (when the task before it
answered). Past it, the worker is killed: the k completions score 0 and count in ``reward/<name>/timeouts``, the task
waiting behind it goes back to the queue, and a new worker is started at once. A worker that dies during a task
(segfault, ``os._exit``, OOM kill) counts the task's completions in ``reward/<name>/failures`` and is replaced the
same way. ``reward/workers_respawned`` counts both.

**Longest wait.** Let ``B = 4 × timeout_s`` (the largest budget), T the step's tasks (reward functions × chunks of
every group) and W the workers. A task runs at most once (a task sent back to the queue never started) and holds its
worker at most B; it waits in the queue only while every worker holds two tasks, so the queue drains by W tasks per
B at least, and once sent it waits at most one budget behind the task ahead of it. Hence

    time/reward_wait ≤ (⌈T/W⌉ + 2) · 4 · timeout_s + time/reward_worker_start + milliseconds per task of dispatch,

the middle term being the summed waits for workers to become ready (the first step's start-up, then each respawn:
a fork and ``reward.worker_init``; at most :data:`WORKER_START_TIMEOUT_S` each, after which the task fails). With the
demo's math reward (timeout_s = 5 s) and no hang the wait is the scoring time itself.

**Processes, isolation and memory.** The pool starts one server per pool, a fresh interpreter (``python -c``, with
the trainer's ``sys.path``, working directory and environment as they are when the pool is built) that imports only
:mod:`fastgrpo.rewards` and the modules of the configured functions and of ``reward.worker_init`` (math-verify and
sympy for ``math``), and never the entry script: no ``__main__`` is re-run, so ``torchrun fastgrpo/train.py`` does
not bring torch into the workers (a reward module that imports torch does; torch then runs on one thread there). A
worker is a ``fork`` of that warm server: ready after a fork and ``reward.worker_init``, instead of a ``spawn``ed
interpreter importing the entry script, torch, math-verify and sympy again. Workers share the server's pages until
they write them: each adds what its own scoring touches (its PSS, not its RSS, is its cost), and none holds torch.
Measured on 2 CPU cores with the math reward (``bench/bench_rewards.py --part workers``, rows in
``bench/results/rewards.csv``, under a load average of ~9): from a worker's death to its replacement scoring, ~15 ms
(spawned interpreters before: 8-13 s); per warm worker, the server's share included, ~28 MiB PSS and ~84 MiB RSS
(before: ~306 and ~410 MiB), so 8 ranks × ~11 workers on a 96-core node hold ~2.5 GB, not ~27 GB. The server
inherits no CUDA context, tensor or file of the trainer (``close_fds``, stdin from ``/dev/null``); a worker's
descriptors are stdio and its pipe (plus any a reward module opened at import time). Per-worker state (sandboxes,
connections, threads) belongs in ``reward.worker_init``, which runs in each worker after the fork, never in the
server: a module's import-time state is copied into every worker (and CUDA, initialised before a fork, is unusable
after it). Workers and the server ignore SIGINT (Ctrl-C reaches the whole process group; the trainer shuts them
down) and exit when their pipe closes; on Linux the server gets SIGKILL when the trainer thread that started it
exits, and a worker when the server does, so a killed trainer leaves none behind (a dead server is restarted at the
next worker start; its workers die with it and count as respawned). The trainer watches and kills a worker through a
pidfd (Linux ≥ 5.3), so a recycled pid is never signalled; elsewhere through its pid. A reward may start processes
(``subprocess`` sees their exit statuses: the workers reset SIGCHLD); those that outlive a killed worker are not
stopped by the pool.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

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
    resolve,
    score_chunk,
)

WORKER_START_TIMEOUT_S = 300.0  # a (re)started worker not ready by then is killed and its task fails
WORKER_STOP_TIMEOUT_S = 2.0  # close(): how long a worker may take to exit after being asked, before it is killed
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a process gets when its parent thread exits
PIPELINE_DEPTH = 2  # tasks sent ahead to a worker: the next one waits in its pipe while it runs one
GATHER_POLL_S = 0.5  # gather() wakes this often, so Ctrl-C is seen while it waits
PID = struct.Struct("q")  # the server's answer to a fork request: the new worker's pid
SERVER_CODE = ("import json, sys; a = json.loads(sys.argv[1]); sys.path[:] = a.pop('sys_path'); "
               "from fastgrpo.rewards.pool import _server_main; _server_main(**a)")


def default_num_workers(busy_cores_per_rank: int, local_world_size: int) -> int:
    """The cores this node's ranks leave free, divided among them, at least 1.

    ``busy_cores_per_rank``: the cores a rank keeps busy (its torch threads on CPU; its Python thread on GPU).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(local_world_size, 1)
    return max(1, (cores - busy_cores_per_rank * local) // local)


# ---------------------------------------------------------------------- in the server and the workers

def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux), and exit now if it already has."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _server_main(control_fd: int, parent: int, functions: list[str], worker_init: str, timeout_s: float,
                 preload: list[str]) -> None:
    """The server: import the reward modules (and ``preload``) once, then fork a worker for each pipe the trainer
    sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    _die_with_parent(parent)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers: no zombies (reset in each worker)
    load_functions(functions, "")  # imports the modules and math-verify; their errors are the workers' to report
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a task that needs it fails in its worker, where it is counted
            pass
    if worker_init:
        try:
            resolve(worker_init)  # its module only: the initializer itself runs in each worker
        except ValueError:
            pass
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not msg or not fds:  # the trainer closed the pool or is gone
            return
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                control.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # subprocess.run in a reward needs its exit statuses
                _die_with_parent(server)
                _worker_main(Connection(fds[0]), functions, worker_init, timeout_s)
                code = 0
            except BaseException:  # noqa: BLE001 - never return into the server's loop
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(fds[0])
        try:
            control.sendall(PID.pack(pid))
        except OSError:  # the trainer is gone
            return


_functions: list[Callable | None] = []  # in a worker: the reward functions, in reward.functions order
_timeout_s = 0.0  # in a worker: reward.timeout_s


def _worker_main(conn: Connection, functions: list[str], worker_init: str, timeout_s: float) -> None:
    """A worker: run the initializer, say which functions failed, then run tasks until told to stop or the pipe
    closes. A task is ``(fn, args)``: a module-level function (pickled by name) and its arguments."""
    global _functions, _timeout_s
    if "torch" in sys.modules:  # a reward module imported it: keep it off the trainer's cores
        sys.modules["torch"].set_num_threads(1)
    _functions, errors = load_functions(functions, worker_init)
    _timeout_s = timeout_s
    conn.send(errors)
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if task is None:
            return
        fn, args = task
        conn.send(fn(*args))


def _score(f: int, prompts: list[str], completions: list[str], columns: dict[str, list]):
    """A task in a worker: reward function ``f`` on one chunk (the pool enforces the budget by killing)."""
    return score_chunk(_functions[f], prompts, completions, columns, _timeout_s, soft_limit=False)


# ---------------------------------------------------------------------- in the trainer

class _Server:
    """The trainer's handle on the server; thread-safe (the supervisors start workers concurrently)."""

    def __init__(self, args: dict):
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> None:
        """Launch the server (returns at once: it imports the reward modules while the trainer goes on)."""
        self.control, child = socket.socketpair()
        args = {**self.args, "control_fd": child.fileno(), "parent": os.getpid(),
                "sys_path": [os.fspath(p) for p in sys.path]}
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, json.dumps(args)],
                                         pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            child.close()

    def fork(self, fd: int) -> int:
        """A new worker on pipe end ``fd``: its pid. Restarts a dead server once; raises OSError when the server
        cannot fork within WORKER_START_TIMEOUT_S (the first call waits for its imports) or the pool is closing."""
        with self.lock:
            for attempt in range(2):
                if self.closed:
                    raise ConnectionError("the reward pool is closed")
                if self.proc is None or self.proc.poll() is not None:
                    self._stop()
                    self.start()
                try:
                    self.control.settimeout(WORKER_START_TIMEOUT_S)
                    socket.send_fds(self.control, [b"F"], [fd])
                    answer = b""
                    while len(answer) < PID.size:
                        part = self.control.recv(PID.size - len(answer))
                        if not part:
                            raise ConnectionError("the reward worker server exited")
                        answer += part
                    return PID.unpack(answer)[0]
                except OSError:  # dead, or stuck in a reward module's import: a fresh one on the next try
                    self._stop()
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Kill the server now (not under the lock: a fork waiting for its imports then fails at once)."""
        self.closed = True
        proc = self.proc
        if proc is not None:
            proc.kill()
        with self.lock:
            self._stop()

    def _stop(self) -> None:
        if self.control is not None:
            self.control.close()  # the server exits on EOF
        if self.proc is not None:
            try:
                self.proc.wait(WORKER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = self.control = None


def _exited(pid: int | None, pidfd: int | None, timeout: float) -> bool:
    """Whether process ``pid`` (its pidfd when there is one) has exited, waiting up to ``timeout`` s for it."""
    if pid is None:
        return True
    if pidfd is not None:
        try:
            return bool(select.select([pidfd], [], [], timeout)[0])  # a pidfd turns readable when its process exits
        except (OSError, ValueError):  # closed by a concurrent kill(), which waited for the exit
            return True
    end = time.perf_counter() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.perf_counter() >= end:
            return False
        time.sleep(0.001)


class _Worker:
    """One worker process (a fork of the server), its pipe and its pidfd; used by one supervisor thread and by
    close() (kill() is serialised by a lock)."""

    def __init__(self, server: _Server):
        self.server = server
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.conn: Connection | None = None
        self.ready = False
        self.lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self.conn is not None

    def start(self) -> None:
        """Fork a new worker from the server; raises OSError when the server cannot."""
        ours, theirs = socket.socketpair()
        try:
            pid = self.server.fork(theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the worker holds the only other end: its death reads as EOF here
        with self.lock:
            self.conn, self.pid, self.ready = Connection(ours.detach()), pid, False
            try:
                self.pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
            except ProcessLookupError:  # it exited already and was reaped; reads as dead from here on
                self.pid = self.pidfd = None

    def alive(self) -> bool:
        return not _exited(self.pid, self.pidfd, 0.0)

    def kill(self) -> None:
        """SIGKILL the worker (if running), wait for its exit, close its pipe. Idempotent."""
        with self.lock:
            if self.alive():
                try:
                    if self.pidfd is not None:
                        signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                    else:
                        os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _exited(self.pid, self.pidfd, WORKER_STOP_TIMEOUT_S)
            if self.pidfd is not None:
                os.close(self.pidfd)
            if self.conn is not None:
                self.conn.close()
            self.pid = self.pidfd = self.conn = None
            self.ready = False

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it has not within WORKER_STOP_TIMEOUT_S."""
        conn, pid, pidfd = self.conn, self.pid, self.pidfd  # its supervisor may be killing it at the same moment
        if conn is not None:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
            _exited(pid, pidfd, WORKER_STOP_TIMEOUT_S)
        self.kill()


@dataclass
class _Task:
    fn: Callable  # a module-level function: the worker runs fn(*args) and sends back what it returns
    args: tuple
    budget_s: float  # the hard time limit of one run, from when the worker starts it
    done: Callable[[object, str | None], None]  # called (on a supervisor thread) with the worker's answer and None,
    # or None and the fault ("timeouts": past its budget, "failures": the worker died or could not start)
    worker: int | None = None  # the worker it must run on (its state lives there); None: any


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

    def get(self, worker: int, block: bool) -> _Task | None:
        """The next task for ``worker``: its own first, then a shared one; None when closed, or empty and not
        ``block``."""
        with self.cond:
            while not self.closed:
                for q in (self.pinned[worker], self.shared):
                    if q:
                        return q.popleft()
                if not block:
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
        self._results: dict[tuple[int, int, int], tuple[list[float], dict[str, int]]] = {}
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
        self._server = _Server({"functions": list(cfg.functions), "worker_init": cfg.worker_init,
                                "timeout_s": cfg.timeout_s, "preload": list(preload)}) if num_workers else None
        self._workers = [_Worker(self._server) for _ in range(num_workers)]
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
                for a, b in chunk_bounds(len(completions)):
                    self._expected += 1
                    args = (f, prompts[a:b], completions[a:b], {k: v[a:b] for k, v in columns.items()})
                    self._queue.put(_Task(_score, args, (b - a) * self.cfg.timeout_s,
                                          functools.partial(self._store, (index, f, a), b - a)))

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

    def _supervise(self, worker: _Worker, index: int) -> None:
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
                    task = self._queue.get(index, block=not inflight)
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

    def _ready(self, worker: _Worker) -> bool:
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

    def _lose(self, worker: _Worker, inflight: deque[_Task], fault: str) -> str:
        """The worker hung or died in the head task: respawn it; the head fails as ``fault`` (returned), the tasks
        waiting behind it (never started) go back to the front of the queue, in order."""
        inflight.popleft()
        while inflight:
            self._queue.put(inflight.pop(), front=True)
        self._respawn(worker)
        return fault

    def _store(self, key: tuple[int, int, int], size: int, result: tuple[list[float], dict[str, int]] | None,
               fault: str | None) -> None:
        """A reward chunk's answer (``size`` completions; a lost chunk scores 0 as ``fault``), kept for gather()."""
        with self._lock:
            self._results[key] = no_scores(size, fault) if fault else result
            self._last_result = time.perf_counter()
            self._lock.notify_all()

    def _start(self, worker: _Worker) -> bool:
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

    def _respawn(self, worker: _Worker) -> None:
        """Kill the worker and start its replacement now, overlapping the remaining work (waited for at its next
        task); nothing starts once the pool is closing."""
        worker.kill()
        self._count_respawn()
        self._start(worker)

    def _count_respawn(self) -> None:
        with self._lock:
            self._respawned += 1


__all__ = ["CHUNK_SIZE", "RewardPool", "default_num_workers"]
