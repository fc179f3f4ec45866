"""bench/bench_e2e_gpu.py runs end to end at toy sizes on CPU (``--cpu-smoke``): the demo part through the trainer's
entry point and the GRPO part (generation + update with fp32 masters and activation checkpointing)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 16 s: the GPU bench's CPU smoke; the demo itself runs in test_train
def test_bench_e2e_cpu_smoke():
    # the plain-torch CPU path (as on a machine without a GPU), not the Triton interpreter the kernel tests use
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_e2e_gpu.py"), "--cpu-smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("demo ") for line in lines) == 1
    grpo = [line.split() for line in lines if line.startswith("grpo-toy ")]
    assert [row[1] for row in grpo] == ["1", "2"]  # two GRPO steps, each with a finite gradient norm
    header = next(line.split() for line in lines if line.startswith("part ") and "grad_norm" in line)
    assert all(float(row[header.index("grad_norm")]) > 0 for row in grpo)
    assert "memory plan for the same settings" in proc.stdout
