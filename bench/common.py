"""Shared benchmark plumbing: timing, peak extra memory, the two ceilings, pytest-benchmark cases, result rows.

Microbenchmarks (``bench/micro_*.py``) are pytest-benchmark cases (``pytest bench/ --benchmark-only``, see
``bench/conftest.py``): :func:`measure` times one method of one group and fills ``extra_info``. End-to-end
benchmarks stay scripts: they print side-by-side ratios against baselines measured in the same run and append rows
(device, git sha, date, shape, figures) to ``bench/results/<name>.csv``.

- GPU time: CUDA events (pytest-benchmark rounds read :func:`cuda_event_clock`; scripts use
  ``triton.testing.do_bench``), medians. CPU time: ``perf_counter``.
- GPU peak extra memory: ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
- Timing and memory are separate measurements. Every timing runs in the state users run in: the default
  allocator and threads (:func:`assert_timing_state` checks it before each timed call and fails otherwise).
- CPU peak extra memory: measured in a forked child, never in the timed process. The child makes the resident size
  exact (``exact_cpu_rss``: on glibc every block of 64 KiB or more becomes its own mmap, unmapped when freed, and
  free heap pages are handed back before the call; the libraries' pages are mapped in first, as they are in the
  parent: ``_map_file_pages``), runs the call once and reports the resident high-water mark
  (``VmHWM``, reset through ``/proc/self/clear_refs``) above the resident size before it. That setting slows code
  that allocates fresh tensors (every one is page-faulted in), so it must never reach a timed call: the fork keeps
  it out of the parent.
- Ceilings (the roofline), measured on random data (never zeros) in the same run: the device's copy bandwidth
  (bytes read + written) and its matmul rate (bf16 on GPU, fp32 on CPU).
"""

from __future__ import annotations

import csv
import ctypes
import ctypes.util
import datetime
import functools
import gc
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the microbenchmarks run
# (rtol, atol) of the numbers check between a baseline and fastgrpo: fp32 paths agree to rounding; in bf16 the
# outputs are rounded to 8 bits of mantissa (relative 2^-8) and each side rounds differently.
CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-3)}
# A smoke run (``pytest bench/ --benchmark-disable``; bench/conftest.py sets this before the cases are collected):
# every case's numbers check and one call, untimed, at the small sizes of its table's "smoke" entry.
SMOKE = False
SMOKE_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # what the smoke sizes run in (flash-attn: 16 bit)


def sizes(table: dict):
    """A case table's entry for this run: ``table["smoke"]`` in a smoke run, else ``table[DEVICE]``."""
    return table["smoke" if SMOKE else DEVICE]


def members(methods: tuple[str, ...], compiled: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A group's members in this run. A smoke run leaves out the ``compiled`` ones: each is an inductor compile
    (most of a smoke run's time; docs/benchmarks.md) of the code of a member checked beside it uncompiled
    (``torch.compile`` of ``eager``, Liger's compiled chunk loop of ``liger eager``)."""
    return tuple(m for m in methods if not (SMOKE and m in compiled))


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()} {_cpu_model()}".rstrip()


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; empty elsewhere): rows of two machines with the same core
    count stay apart (bench/results/ holds rows from an AMD EPYC and an Intel Xeon host, both ``x86_64x2``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def git_sha() -> str:
    """The checkout's short sha; ``FASTGRPO_GIT_SHA`` when set (a copy without ``.git``, as on the device machine)."""
    if os.environ.get("FASTGRPO_GIT_SHA"):
        return os.environ["FASTGRPO_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 2, rep: int = 5) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events through do_bench on GPU)."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    assert_timing_state()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


MMAP_THRESHOLD_BYTES = 64 * 1024  # blocks this large or larger are mmapped, so freeing one unmaps it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameter numbers (malloc.h)
# the allocator probe's block: below glibc's largest dynamic mmap threshold (32 MiB on 64-bit), far above its heap's
# usual free space (the top pad is 128 KiB)
_PROBE_BYTES = 16 << 20
_IS_MMAPPED = 0x2  # the flag bit in a glibc chunk's size word (the word just before the pointer malloc returns)


@functools.cache
def _glibc():
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _fix_malloc_thresholds() -> None:
    """A fixed mmap threshold of 64 KiB and no trim hysteresis (glibc ``mallopt``), for the rest of the process:
    only ever called in the child of :func:`peak_extra_bytes`.

    By default glibc raises its mmap threshold (up to 32 MiB) each time an mmapped block is freed, after which
    such blocks come from the heap, and freed heap pages stay resident: a call that reuses them never raises the
    resident high-water mark (a chunked path would read 0 extra bytes).
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, 0)


def exact_cpu_rss() -> None:
    """Make the resident size track live bytes: fixed malloc thresholds, then free heap pages handed back."""
    _fix_malloc_thresholds()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def malloc_thresholds_fixed() -> bool | None:
    """Whether this process's glibc has a fixed mmap threshold, as ``exact_cpu_rss`` sets (None: not glibc).

    It reads the allocator's behaviour, not a flag of ours. By default glibc's threshold is dynamic: freeing an
    mmapped block raises the threshold above that block's size, so the same request made again comes from the
    heap. The probe mallocs 16 MiB, frees it, mallocs it again and reads the second chunk's ``IS_MMAPPED`` bit: clear
    by default (the request is below the threshold by then), set once the threshold is fixed below it (``mallopt``,
    or ``MALLOC_MMAP_THRESHOLD_`` in the environment), unless a 16 MiB free block happens to lie in the heap.
    """
    libc = _glibc()
    if libc is None:
        return None
    libc.free(libc.malloc(_PROBE_BYTES))
    ptr = libc.malloc(_PROBE_BYTES)
    if not ptr:
        raise MemoryError("malloc of the allocator probe failed")
    try:
        return bool(ctypes.c_size_t.from_address(ptr - ctypes.sizeof(ctypes.c_size_t)).value & _IS_MMAPPED)
    finally:
        libc.free(ptr)


def assert_timing_state() -> None:
    """Fail unless this process times in the users' state: glibc's default (dynamic) mmap threshold, not the fixed
    one ``exact_cpu_rss`` sets. Every timing helper here calls it before timing."""
    if malloc_thresholds_fixed():
        raise RuntimeError("this process's malloc has a fixed mmap threshold (exact_cpu_rss ran here, or "
                           "MALLOC_MMAP_THRESHOLD_ is set): timings would not be those of the default allocator")


_MADV_POPULATE_READ = 22  # madvise advice (Linux >= 5.14): map the pages of a range now, reading them if need be


def _map_file_pages() -> None:
    """Map, in this (forked) process, every page of its readable file mappings (the libraries' code and constants).

    fork copies the page tables of anonymous memory only; a file mapping's pages (libtorch's code) are mapped
    again on first use, so a child's call would count, as its own resident memory, every page of code it runs that
    the parent had already mapped (the size is in docs/benchmarks.md). Mapping them all before the measurement
    leaves the call's own memory.
    """
    libc = _glibc()
    if libc is None:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or fields[1][0] != "r":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            libc.madvise(start, end - start, _MADV_POPULATE_READ)  # a failure (old kernel) leaves it as it was


def _cpu_peak_in_child(fn: Callable[[], object]) -> int:
    """Fork; the child makes RSS exact, runs ``fn`` once and sends back its peak extra resident bytes."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is printed twice
        stream.flush()
    read_fd, write_fd = os.pipe()
    grad = torch.is_grad_enabled()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's exit handlers
        result = ["error\nno result"]

        def measure() -> None:
            try:
                torch.set_grad_enabled(grad)  # torch's grad mode is per thread
                _map_file_pages()
                exact_cpu_rss()
                with open("/proc/self/clear_refs", "w") as f:  # "5" resets the resident high-water mark (Linux)
                    f.write("5")
                before = _rss_kib("VmRSS")
                out = fn()
                result[0] = str(max(_rss_kib("VmHWM") - before, 0) * 1024)
                del out
            except BaseException:  # noqa: BLE001 (everything goes back to the parent, which raises)
                result[0] = "error\n" + traceback.format_exc()

        try:
            os.close(read_fd)
            # on a new thread: GNU OpenMP's pool belongs to the thread that started it, and its workers do not
            # survive a fork (the main thread's next parallel region would wait for them forever); a new thread
            # starts its own, with the parent's thread count (torch.compile's guards see the same state: no recompile)
            worker = threading.Thread(target=measure)
            worker.start()
            worker.join()
            os.write(write_fd, result[0].encode())
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0 if result[0].isdigit() else 1)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not msg.isdigit():
        raise RuntimeError(f"the memory-measurement child failed (status {status}):\n{msg}")
    return int(msg)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak memory one call of ``fn`` needs above what was in use before it ran (its outputs included).

    GPU: the caching allocator's peak above the bytes allocated before. CPU: measured in a forked child (see the
    module docstring), so the calling process keeps the default allocator and its later timings are the users';
    ``fn``'s side effects and result stay in the child (blocks under 64 KiB are not tracked exactly: noise).
    """
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak
    return _cpu_peak_in_child(fn)


def copy_bandwidth_gbps(nbytes: int | None = None, device: torch.device | str = "cuda") -> float:
    """Copy bandwidth in GB/s, counting bytes read plus bytes written (median); 2 GiB on GPU, 256 MiB on CPU."""
    nbytes = nbytes or (2 << 30 if torch.device(device).type == "cuda" else 256 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n: int | None = None, dtype: torch.dtype | None = None, device: torch.device | str = "cuda") -> float:
    """Dense ``n×n @ n×n`` matmul rate in TFLOP/s on random data (median): 8192² bf16 on GPU, 2048² fp32 on CPU."""
    cuda = torch.device(device).type == "cuda"
    n = n or (8192 if cuda else 2048)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device)
    return 2 * n**3 / ms / 1e9


def cuda_event_clock() -> Callable[[], float]:
    """A pytest-benchmark timer that reads GPU time: seconds elapsed on the GPU between CUDA events.

    Each call records an event on the current stream, waits for it, and returns the GPU time since the first call.
    pytest-benchmark reads the timer just before and just after each round, so a round's duration is the GPU time
    from the end of all earlier work to the end of the kernels the round queued, idle gaps while the host launched
    them included (a launch-bound method is charged for it). Synchronised by construction.
    """
    last: list[torch.cuda.Event] = []
    total = [0.0]

    def cuda_event_clock() -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        if last:
            total[0] += last[0].elapsed_time(event) / 1e3
            last[:] = [event]
        else:
            last.append(event)
        return total[0]

    return cuda_event_clock


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than any GPU's L2 (H200: 60 MB)


def flush_l2() -> None:
    """Evict the GPU's L2 cache before a timed round (as ``triton.testing.do_bench`` does): no round starts warm."""
    _l2_flush_buffer().zero_()


def measure(benchmark, fn: Callable[[], object], *, device: torch.device | str, method: str,
            ceilings: dict[str, float], bytes_moved: int | None = None, flops: int | None = None,
            rounds: int | None = None, setup: Callable[[], object] | None = None, **info) -> None:
    """Time ``fn`` as one pytest-benchmark case and record what the tables and plots need in ``extra_info``.

    ``fn`` has already run once (the numbers check, which also compiles and autotunes). Its peak extra memory is
    measured on one more call (on CPU in a forked child: :func:`peak_extra_bytes`), then ``rounds`` timed calls
    follow in the default process state (default: 25 on GPU after 3 warm-up rounds; on CPU one untimed call, then
    as many as fit in about 1.5 s, 3 to 20). On GPU every round starts with a cold L2 and is timed by CUDA events
    (:func:`cuda_event_clock`).
    ``setup`` runs before each call, outside the timing (e.g. fresh inputs for an in-place method).
    ``extra_info``: ``method``, ``device``, ``peak_extra_MiB``, ``median_ms``, and with ``bytes_moved`` the
    effective ``GB/s`` and ``frac_of_copy_bw`` (of the measured copy bandwidth), with ``flops`` the ``TFLOP/s``
    and ``frac_of_matmul``; ``info`` is added as given (shape, dtype, the numbers check's errors).
    ``pytest --benchmark-disable`` runs ``fn`` once and records nothing (a smoke run).
    """
    cuda = torch.device(device).type == "cuda"
    if benchmark.disabled:
        benchmark.pedantic(fn, setup=setup)
        return
    if setup is not None:
        setup()
    peak = peak_extra_bytes(fn, device)
    assert_timing_state()
    if rounds is None and not cuda:  # as many rounds as fit in ~1.5 s, 3 to 20, from one call in the timed state
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        rounds = max(3, min(20, int(1.5 / max(time.perf_counter() - start, 1e-6))))
    rounds = rounds or 25
    if cuda:
        benchmark._timer = cuda_event_clock()  # the fixture's timer, read around each round (pytest-benchmark API)

    def before_round():
        if setup is not None:
            setup()
        if cuda:
            flush_l2()

    benchmark.pedantic(fn, setup=before_round, rounds=rounds, warmup_rounds=3 if cuda else 0)
    seconds = benchmark.stats.stats.median
    extra = {"method": method, "device": device_name(device), "peak_extra_MiB": peak / 2**20,
             "median_ms": seconds * 1e3, "cpu_threads": torch.get_num_threads(), "loadavg_1min": os.getloadavg()[0]}
    if bytes_moved is not None:
        gbps = bytes_moved / seconds / 1e9
        extra.update({"bytes_moved": bytes_moved, "GB/s": gbps, "copy_GB/s": ceilings["copy_GB/s"],
                      "frac_of_copy_bw": gbps / ceilings["copy_GB/s"]})
    if flops is not None:
        tflops = flops / seconds / 1e12
        extra.update({"flops": flops, "TFLOP/s": tflops, "matmul_TFLOP/s": ceilings["matmul_TFLOP/s"],
                      "frac_of_matmul": tflops / ceilings["matmul_TFLOP/s"]})
    benchmark.extra_info.update(extra, **info)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=1)
def head_inputs(n_seqs: int, T: int, H: int, V: int, dtype: torch.dtype, seed: int = 0):
    """What a trainer hands its LM-head loss: ``hidden [S, T, H]`` and ``weight [V, H]`` (leaves that require
    grad), ``targets [S, T]`` and a completion ``mask [S, T]`` (bool: a prompt of T/8 tokens, then a completion of
    random length ≥ T/4, then padding). Cached (one shape at a time): every member of a group sees the same data.
    """
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(n_seqs, T, H, device=DEVICE, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=DEVICE, generator=g) / H**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (n_seqs, T), device=DEVICE, generator=g)
    prompt = T // 8
    ends = torch.randint(prompt + T // 4, T + 1, (n_seqs, 1), device=DEVICE, generator=g)
    pos = torch.arange(T, device=DEVICE)
    mask = (pos >= prompt) & (pos < ends)  # [S, T]
    return hidden, weight, targets, mask


def eager_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What a trainer does without fusion: full logits in the compute dtype, fp32 log-softmax, gather."""
    logits = hidden @ weight.t()  # [..., V]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def loss_and_grads(loss: torch.Tensor, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"loss": loss, "grad_<name>": ∂loss/∂input}``: backward through autograd, nothing accumulated in ``.grad``."""
    grads = torch.autograd.grad(loss, tuple(inputs.values()))
    return {"loss": loss.detach(), **{f"grad_{k}": g for k, g in zip(inputs, grads)}}


def check_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype,
               method: str) -> float:
    """Assert that a baseline computed what fastgrpo computed (every named output and gradient) before it is timed.

    Tolerance ``CHECK_TOLERANCE[dtype]``, each output compared in fp32; fails naming the method and the output, so
    that no comparison times two different computations. Returns the largest absolute difference.
    """
    rtol, atol = CHECK_TOLERANCE[dtype]
    worst = 0.0
    for name, ref in want.items():
        out = got[name].float()
        torch.testing.assert_close(out, ref.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{method}: {name} differs from fastgrpo's\n{m}")
        worst = max(worst, (out - ref.float()).abs().max().item() if out.numel() else 0.0)
    return worst


def append_rows(name: str, rows: list[dict], device: torch.device | str) -> Path:
    """Append result rows to ``bench/results/<name>.csv`` with device, git sha, torch version and UTC date."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.csv"
    stamp = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_sha": git_sha(),
        "device": device_name(device),
        "torch": torch.__version__,
    }
    full = [{**stamp, **r} for r in rows]
    fields = list(dict.fromkeys(k for r in full for k in r))
    if path.exists():
        with open(path, newline="") as f:
            old_fields = next(csv.reader(f), [])
        fields = list(dict.fromkeys(old_fields + fields))
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    else:
        old = []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(old + full)
    return path


def print_table(rows: list[dict], title: str = "") -> None:
    """A fixed-width table of ``rows`` (floats to 3 significant digits)."""
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = [[f"{r.get(c, ''):.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(f[i]) for f in fmt)) for i, c in enumerate(cols)]
    if title:
        print(title)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for f in fmt:
        print("  ".join(v.ljust(w) for v, w in zip(f, widths)))
