"""The reward pool's server and worker processes: the code that runs in them (never in the trainer).

The server is a fresh interpreter started by :class:`fastgrpo.rewards.processes.ServerProcess` with
:data:`SERVER_CODE`: it imports :mod:`fastgrpo.rewards` and the configured reward modules once, then forks one
worker per pipe the trainer sends over its control socket and answers with the worker's pid (:data:`PID`). A worker
loads the reward functions (running ``reward.worker_init``), reports which failed, then runs tasks ``fn(*args)``
(module-level functions, pickled by name) one at a time until told to stop or its pipe closes; a reward chunk is the
task :func:`score_task`. This module imports neither torch nor the trainer's modules, so neither do the workers.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from fastgrpo.rewards.scoring import load_functions, resolve, score_chunk

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a process gets when its parent thread exits
PID = struct.Struct("q")  # the server's answer to a fork request: the new worker's pid
SERVER_CODE = ("import json, sys; a = json.loads(sys.argv[1]); sys.path[:] = a.pop('sys_path'); "
               "from fastgrpo.rewards.worker import server_main; server_main(**a)")


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux), and exit now if it already has."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def server_main(control_fd: int, parent: int, functions: list[str], worker_init: str, timeout_s: float,
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


def score_task(f: int, prompts: list[str], completions: list[str], columns: dict[str, list]):
    """A task in a worker: reward function ``f`` on one chunk, :func:`score_chunk`'s answer (the pool enforces the
    budget by killing, and isolates a call that failed as a whole)."""
    return score_chunk(_functions[f], prompts, completions, columns, _timeout_s, soft_limit=False)
