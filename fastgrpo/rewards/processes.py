"""The trainer's handles on the reward pool's processes: the server (:class:`ServerProcess`) and its forked workers
(:class:`WorkerProcess`). The code that runs inside them is :mod:`fastgrpo.rewards.worker`; what they run, and when,
is :class:`fastgrpo.rewards.pool.RewardPool`'s.

The server is started with ``python -c`` :data:`fastgrpo.rewards.worker.SERVER_CODE`, the trainer's ``sys.path``,
working directory and environment, stdin from ``/dev/null`` and no inherited descriptor but its control socket
(``close_fds``). A worker is forked by the server on a socket pair whose other end the trainer keeps (the worker's
death reads as EOF there); the trainer watches and kills it through a pidfd (Linux ≥ 5.3), so a recycled pid is
never signalled; elsewhere through its pid.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from fastgrpo.rewards.worker import PID, SERVER_CODE

WORKER_START_TIMEOUT_S = 300.0  # a (re)started worker not ready by then is killed and its task fails
WORKER_STOP_TIMEOUT_S = 2.0  # close(): how long a worker may take to exit after being asked, before it is killed


class ServerProcess:
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


class WorkerProcess:
    """One worker process (a fork of the server), its pipe and its pidfd; used by one supervisor thread and by
    close() (kill() is serialised by a lock)."""

    def __init__(self, server: ServerProcess):
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
