"""pytest-benchmark set-up for the microbenchmarks (``bench/micro_*.py``).

    pytest bench/ --benchmark-only                                         # every microbenchmark, table per group
    pytest bench/ --benchmark-only --benchmark-json=bench/results/micro-cpu.json   # what bench/results/ keeps
    pytest bench/ --benchmark-only --benchmark-compare=bench/results/micro-cpu.json \\
        --benchmark-compare-fail=median:25%                                # fails when a median is 25% slower
    pytest bench/ --benchmark-disable                                      # smoke run: checks + one call each,
                                                                           # untimed, at each case's smoke sizes
    python bench/plot.py                                                   # PNGs from bench/results/*.json

One group per op, shape and mode; fastgrpo and every baseline are members of the same group, each checked
against fastgrpo's numbers before it is timed. The smoke run (CI's, ``.ci/run``) collects every case at the small
sizes of its table's ``"smoke"`` entry (``common.sizes``): each peer's agreement check runs once, in seconds.
On CPU the plain-torch paths are measured: ``TRITON_INTERPRET`` is dropped before fastgrpo is imported (the
interpreter runs Triton kernels thousands of times slower; run ``tests/`` and ``bench/`` in separate sessions). The
JSON's ``machine_info`` gains the device, torch, triton and CUDA versions and the CPU threads; ``commit_info`` gains
the short sha and the run's UTC date.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.pop("TRITON_INTERPRET", None)

import common  # noqa: E402
import fastgrpo.kernels.utils as kernel_utils  # noqa: E402  (after TRITON_INTERPRET)
import triton  # noqa: E402
from common import DEVICE, copy_bandwidth_gbps, device_name, git_sha, matmul_tflops  # noqa: E402


def pytest_configure(config):
    if kernel_utils.INTERPRET and DEVICE == "cpu":
        raise pytest.UsageError("bench/ measures the plain-torch path on CPU, but fastgrpo was imported with "
                                "TRITON_INTERPRET=1 (tests/conftest.py sets it): run bench/ in its own pytest session")
    common.SMOKE = bool(config.getoption("benchmark_disable", False))  # before the micro_*.py cases are collected


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def ceilings() -> dict[str, float]:
    """The roofline of this run, measured once per session: copy bandwidth (GB/s) and matmul rate (TFLOP/s); none
    in a smoke run (nothing is timed)."""
    if common.SMOKE:
        return {}
    return {"copy_GB/s": copy_bandwidth_gbps(device=DEVICE), "matmul_TFLOP/s": matmul_tflops(device=DEVICE)}


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update({
        "device": device_name(DEVICE),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
    })


def pytest_benchmark_update_commit_info(config, commit_info):
    commit_info["sha"] = git_sha()
    commit_info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
