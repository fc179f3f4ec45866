"""The microbenchmark plumbing: pytest-benchmark collects bench/ with the project's configuration, plot.py renders
and merges pytest-benchmark JSON, the timed calls run with the default allocator while memory is measured apart.
(The benchmarks themselves measure; no test asserts a time.)"""

import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import plot  # noqa: E402


def _bench(group, method, median_s, **info):
    stats = {"median": median_s, "q1": 0.9 * median_s, "q3": 1.1 * median_s, "min": 0.8 * median_s}
    return {"group": group, "name": f"test[{method}]", "fullname": f"bench/micro_x.py::test[{method}]",
            "stats": stats, "extra_info": {"op": "x", "method": method, "peak_extra_MiB": 10.0 * median_s, **info}}


def _run(benchmarks):
    return {"machine_info": {"device": "cpu:test"}, "commit_info": {"sha": "abc1234", "date": "2026-11-30"},
            "benchmarks": benchmarks}


def test_roofline_is_the_time_floor_of_the_work():
    assert plot.roofline_ms({"bytes_moved": 4e9, "copy_GB/s": 2000.0})[0] == pytest.approx(2.0)  # 4 GB at 2 TB/s
    assert plot.roofline_ms({"flops": 8e12, "matmul_TFLOP/s": 800.0})[0] == pytest.approx(10.0)  # 8 TFLOP at 800/s
    assert plot.roofline_ms({}) is None


def test_plot_writes_one_png_per_op_and_merge_keeps_every_benchmark(tmp_path):
    info = {"bytes_moved": 1e9, "copy_GB/s": 10.0}
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_run([_bench("x fwd", "fastgrpo", 0.1, **info), _bench("x fwd", "eager", 0.3, **info)])))
    b = tmp_path / "b.json"
    b.write_text(json.dumps(_run([_bench("x fwd+bwd", "fastgrpo", 0.2), _bench("x fwd+bwd", "liger", 0.5)])))
    merged = plot.merge_runs([a, b])
    assert [x["extra_info"]["method"] for x in merged["benchmarks"]] == ["fastgrpo", "eager", "fastgrpo", "liger"]
    assert merged["machine_info"] == {"device": "cpu:test"}
    out = tmp_path / "all.json"
    out.write_text(json.dumps(merged))
    (png,) = plot.plot_file(out, tmp_path / "png")
    assert png.name == "all-x.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pytest_collects_the_microbenchmarks_with_benchmark_only():
    """`pytest bench/ --benchmark-only` must start (pyproject's addopts may not hold --benchmark-disable) and
    collect every bench/micro_*.py; plain `pytest` keeps to tests/ (testpaths)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = BENCH.parent
    res = subprocess.run([sys.executable, "-m", "pytest", "bench/", "--benchmark-only", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    files = {line.split("::")[0] for line in res.stdout.splitlines() if line.startswith("bench/")}
    assert files == {f"bench/{p.name}" for p in BENCH.glob("micro_*.py")}


class _Benchmark:
    """The parts of pytest-benchmark's fixture that ``common.measure`` uses: rounds run as asked, median recorded."""

    disabled = False

    def __init__(self):
        self.extra_info, self.stats = {}, None

    def pedantic(self, fn, setup=None, rounds=1, warmup_rounds=0):
        times = []
        for _ in range(warmup_rounds + rounds):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        self.stats = types.SimpleNamespace(stats=types.SimpleNamespace(median=statistics.median(times[warmup_rounds:])))


def _churn_heap():
    """Leave what glibc's default state leaves after real work: freed 8 MiB blocks (the dynamic mmap threshold
    raised above them) and freed heap pages still resident."""
    blocks = [torch.ones(2 << 20) for _ in range(4)]  # 8 MiB each
    del blocks
    blocks = [torch.ones(2 << 20) for _ in range(4)]
    del blocks


def test_timed_calls_run_with_the_default_allocator_and_memory_stays_exact():
    """``measure``'s timed rounds see glibc's default (dynamic) mmap threshold, in this very process, even though
    the peak memory was measured first; the memory figure still comes out exact (from the forked child)."""
    import common

    _churn_heap()
    assert common.malloc_thresholds_fixed() is False  # the test process starts in the default state
    states = []

    def fn():
        states.append(common.malloc_thresholds_fixed())
        return torch.ones(4 << 20)  # 16 MiB, written

    bench = _Benchmark()
    common.measure(bench, fn, device="cpu", method="probe", ceilings={}, rounds=3)
    assert states == [False] * 3  # every timed round; the memory call ran in the child and recorded nothing here
    assert common.malloc_thresholds_fixed() is False
    assert 16 <= bench.extra_info["peak_extra_MiB"] < 16 + 4  # the output's 16 MiB (+ noise under 4 MiB)
    # the child runs with the fixed thresholds (else the call below could read 0: reused resident heap pages)
    common.peak_extra_bytes(lambda: common.malloc_thresholds_fixed() or 1 / 0, "cpu")  # raises if not fixed there
    _churn_heap()
    assert 8 <= common.peak_extra_bytes(lambda: torch.ones(2 << 20), "cpu") / 2**20 < 8 + 4


def test_the_timing_check_fails_once_the_memory_setting_leaks_into_the_timed_process():
    """The check can fail: a process that called ``exact_cpu_rss`` itself (what peak_extra_bytes did before) is
    refused by every timing helper, the generation bench's included."""
    code = """
import common, torch
from bench_generation import timed
assert common.malloc_thresholds_fixed() is False
common.exact_cpu_rss()
assert common.malloc_thresholds_fixed() is True
for call in (lambda: common.median_ms(lambda: None, "cpu"), lambda: timed(lambda: None, "cpu")):
    try:
        call()
    except RuntimeError as e:
        assert "fixed mmap threshold" in str(e)
    else:
        raise SystemExit("a timing helper timed with the fixed thresholds")
print("refused")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MALLOC_MMAP_THRESHOLD_")}
    res = subprocess.run([sys.executable, "-c", code], cwd=BENCH, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "refused", res.stdout + res.stderr


def test_a_failing_memory_call_raises_in_the_caller():
    import common

    def boom():
        raise ValueError("the call failed")

    with pytest.raises(RuntimeError, match="the call failed"):
        common.peak_extra_bytes(boom, "cpu")
