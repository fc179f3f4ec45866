"""bench/bench_multiturn.py runs end to end at toy sizes on CPU (``--smoke``, records nothing), and its prefill
counts are the closed forms of the workload: the engine that keeps the KV prefills each prompt once and, per resumed
turn, the observation plus the one sampled token whose K/V were not cached; the re-prefilling one prefills the
prompts once, then every trajectory's whole conversation at every later turn. (No time is asserted.)"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_multiturn_smoke_prefills_the_closed_form():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the plain CPU path users run
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_multiturn.py"), "--smoke"], cwd=ROOT / "bench",
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("impl "))
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("kv_kept ", "re_prefill "))}
    shape_width = len(rows["kv_kept"]) - len(header) + 1  # the shape column holds spaces
    col = {name: i + (shape_width - 1 if i > header.index("shape") else 0) for i, name in enumerate(header)}
    P, n, prompt, turns, k, obs = 2, 2, 8, 3, 4, 6  # the --smoke workload
    kv = int(rows["kv_kept"][col["prefill_tokens"]])
    re = int(rows["re_prefill"][col["prefill_tokens"]])
    assert kv == P * prompt + P * n * (turns - 1) * (obs + 1)
    assert re == P * prompt + sum(P * n * (prompt + t * (k + obs)) for t in range(1, turns))
    assert float(rows["re_prefill"][col["prefill_ratio"]]) == float(f"{re / kv:.3g}")
    assert "rows appended" not in proc.stdout
