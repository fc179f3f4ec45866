"""A Python code tool: the model's program runs in a subprocess with a time limit and a memory cap.

Ground rules (also in the README): this is **not a security sandbox**. The program runs as the trainer's user, with
its network and its file system; it is limited, not confined:

- wall clock: :data:`TIME_LIMIT_S` (then its whole process group is killed), CPU time: the same (``RLIMIT_CPU``);
- memory: :data:`MEMORY_LIMIT_MB` of address space (``RLIMIT_AS``; an allocation past it fails in the program);
- files: each written file at most :data:`FILE_LIMIT_BYTES` (``RLIMIT_FSIZE``); no core dumps;
- working directory: a fresh temporary directory per call, named by the worker's pid and removed afterwards
  (``HOME`` and ``TMPDIR`` point there); the interpreter runs isolated (``python -I``: no ``PYTHONPATH``, no user
  site-packages) with a minimal environment (no inherited variables, so no credentials from the trainer's);
- output: standard output and error go to a file in that directory (so ``RLIMIT_FSIZE`` bounds them too) and the
  first :data:`OUTPUT_CHARS` characters are returned.

For untrusted code or a shared machine, run the tool against a real sandbox (a container, gVisor, a remote
service) from an async tool instead. The limits apply per call; the worker's own time limit
(``reward.timeout_s``) must exceed :data:`TIME_LIMIT_S`, or the worker stops the call first (the process group is
killed either way).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TIME_LIMIT_S = 4.0
MEMORY_LIMIT_MB = 512
FILE_LIMIT_BYTES = 1 << 20
OUTPUT_CHARS = 4096


def _limit() -> None:
    """In the child, before exec: its resource limits."""
    memory = MEMORY_LIMIT_MB << 20
    cpu = int(TIME_LIMIT_S) + 1
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str) -> str:
    """Run a Python program and return its exit status and what it printed.

    Args:
        code: The source code of the program.

    Returns:
        The exit status, then the program's standard output and standard error.
    """
    with tempfile.TemporaryDirectory(prefix=f"fastgrpo-code-{os.getpid()}-") as cwd:
        Path(cwd, "main.py").write_text(code)
        env = {"PATH": os.defpath, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
        with open(Path(cwd, "output.txt"), "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "main.py"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit, start_new_session=True)
            try:
                status = f"exit status {proc.wait(TIME_LIMIT_S)}"
            except subprocess.TimeoutExpired:
                status = f"killed: ran longer than {TIME_LIMIT_S} s"
            finally:  # also when the worker's own limit interrupts the wait: nothing it started outlives the call
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its process group: the program and what it started
                except ProcessLookupError:
                    pass
                proc.wait()
        with open(Path(cwd, "output.txt"), encoding="utf-8", errors="replace") as f:
            text = f.read(OUTPUT_CHARS + 1)
    if len(text) > OUTPUT_CHARS:
        text = text[:OUTPUT_CHARS] + "... [output truncated]"
    return f"{status}\n{text}"
