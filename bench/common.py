"""Shared benchmark plumbing: timing with medians, peak extra memory, the two ceilings, result rows.

Benchmarks are not tests: they print side-by-side ratios against baselines measured in the same run and append
rows (device, git sha, date, shape, figures) to ``bench/results/<name>.csv``.

- GPU time: ``triton.testing.do_bench`` (CUDA events), median. CPU time: ``perf_counter`` median of repeats.
- GPU peak extra memory: ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
- CPU peak extra memory: the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) above the resident size before the call. On glibc the measurement is made exact
  (``exact_cpu_rss``): every block of 64 KiB or more is its own mmap, unmapped when freed, and free heap pages are
  handed back before the call, so the resident size follows the bytes actually live.
- Ceilings (GPU): device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, measured on
  random data in the same run (METHOD.md: never time zeros).
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
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"


def git_sha() -> str:
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


@functools.cache
def _glibc():
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@functools.cache
def _fix_malloc_thresholds() -> None:
    """Once per process: a fixed mmap threshold of 64 KiB and no trim hysteresis (glibc ``mallopt``).

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


def peak_extra_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak memory ``fn`` needs above what was in use before it ran (its outputs included).

    GPU: the caching allocator's peak above the bytes allocated before. CPU: the resident high-water mark above
    the resident size before, after ``exact_cpu_rss`` (blocks under 64 KiB are not tracked exactly: noise).
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
    exact_cpu_rss()
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the resident high-water mark (Linux)
        f.write("5")
    before = _rss_kib("VmRSS")
    out = fn()
    peak = _rss_kib("VmHWM") - before
    del out
    return max(peak, 0) * 1024


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (median)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), "cuda")
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense ``n×n @ n×n`` matmul rate in TFLOP/s on random data (median)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = median_ms(lambda: a @ b, "cuda")
    return 2 * n**3 / ms / 1e9


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
