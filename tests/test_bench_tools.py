"""The microbenchmark plumbing: pytest-benchmark collects bench/ with the project's configuration, plot.py renders
and merges pytest-benchmark JSON. (The benchmarks themselves measure; no test asserts a time.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
