#!/usr/bin/env bash
# The one prepared GPU script: the GPU test tier, the microbenchmarks, generation and end to end, each bounded;
# the whole script stays within 540 s (env 15 + ceilings 15 + gpu_tests 75 + micro 215 + generation 45 + moe 30
# + multiturn 30 + vlm 25 + bitwise 40 + e2e 50; the MoE and VLM rows took their 65 s from the others, the
# batch-invariant mode's bench row (bitwise) and its GPU tests (tests/test_bitwise_devices.py, 15 s more for
# gpu_tests) their 55 s, none of it measured: no GPU in the sessions that added them). The 540 s hold whatever a step
# does: a step's limit is cut to what is left of them less its kill grace, and a step with nothing left is skipped.
#
#   bash bench/gpu_check.sh              # from the repository root, on a machine with a CUDA GPU
#   bash bench/gpu_check.sh --dry-run    # anywhere: lay out the package, print each step and its limit, run none
#
# It needs torch, triton, transformers, pytest and pytest-benchmark already installed (the lent GPU machine has
# them and can install nothing), so it does not pip-install fastgrpo: it lays the package out under a temporary
# folder with links (kernels/ appears as fastgrpo/kernels, as setup.py maps it) and puts that folder on PYTHONPATH.
# The microbenchmarks are the pytest-benchmark suite (`pytest bench/ --benchmark-only`), one bounded pytest run per
# bench/micro_*.py file (a timeout loses that file's JSON only), merged into one JSON: $OUT/micro-gpu.json and
# bench/results/micro-gpu.json. Without pytest-benchmark that step is skipped with the reason in the summary.
# The scripts append rows to bench/results/*.csv; with $OUT set (the device tool) bench/results comes back as
# $OUT/results.tgz and the full log as $OUT/gpu_check.log. The summary table comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
dry_run=0
[ "${1:-}" = "--dry-run" ] && dry_run=1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

site=$(mktemp -d)
mkdir -p "$site/fastgrpo" "$site/micro"
# Pure-Python packages the GPU machine lacks (peft, for the LoRA tests: tests/test_lora.py's gpu tier) travel as
# wheels in .whl/ (git-ignored; carry it): `python3 -m pip download --no-deps --only-binary=:all: --python-version
# 3.12 -d .whl peft==0.21.2 accelerate psutil` here, then they are installed into the temporary site, never the
# machine's own.
if ls "$root"/.whl/*.whl >/dev/null 2>&1 && [ "$dry_run" = 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$root"/.whl/*.whl \
    || echo "gpu_check: installing .whl/ failed; the LoRA GPU tests will be skipped"
fi
for f in "$root"/fastgrpo/*; do ln -s "$f" "$site/fastgrpo/$(basename "$f")"; done
ln -s "$root/kernels" "$site/fastgrpo/kernels"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

log=${OUT:-/tmp}/gpu_check.log
: >"$log"
summary=()

record() {  # record NAME STATUS SECONDS
  summary+=("$(printf '%-28s %-9s %5ss' "$1" "$2" "$3")")
}

BUDGET=540  # the whole script's seconds: a step gets at most what is left of them, less its kill grace
KILL_AFTER=5  # seconds between a step's TERM and its KILL

step() {  # step NAME SECONDS CMD...: run one bounded step, record status and wall time
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  local left=$((BUDGET - SECONDS - KILL_AFTER))
  if [ "$dry_run" = 0 ] && [ "$limit" -gt "$left" ]; then  # earlier steps ran long: the budget still holds
    limit=$left
    if [ "$limit" -le 0 ]; then
      echo "=== $name: skipped, the ${BUDGET}s budget is spent" | tee -a "$log"
      record "$name" SKIPPED 0
      return
    fi
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  if [ "$dry_run" = 1 ]; then
    record "$name" dry-run 0
    return
  fi
  timeout --signal=TERM --kill-after=$KILL_AFTER "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=TIMEOUT; elif [ "$rc" -ne 0 ]; then status="FAIL($rc)"; fi
  record "$name" "$status" "$((SECONDS - t0))"
}

step env 15 python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__, torch.cuda.get_device_name())"
step ceilings 15 python3 -c "import sys; sys.path.insert(0, 'bench'); from common import *; \
print(f'copy bandwidth {copy_bandwidth_gbps():.0f} GB/s, bf16 matmul {matmul_tflops():.0f} TFLOP/s')"
# Only the test files that hold GPU cases are collected (the others may import packages the GPU machine lacks,
# such as math-verify). Run from inside $site: `python -m` puts the working directory first on sys.path, and the
# repository root would offer its fastgrpo/ (without kernels/) ahead of the laid-out package.
gpu_files=$(grep -rl "mark.gpu" "$root/tests" | sort | tr '\n' ' ')
step gpu_tests 75 bash -c "cd '$site' && python3 -m pytest -q -m gpu -p no:cacheprovider $gpu_files"

# Microbenchmarks: 215 s in all, per file (torch.compile, flex and autotuning dominate; micro_moe: the MoE block's
# Triton compiles and transformers' per-expert loop). Same reason to run from
# $site; bench/ is passed by absolute path, so its conftest.py and pyproject's settings (rootdir) apply.
if [ "$dry_run" = 1 ] || python3 -c "import pytest_benchmark" 2>/dev/null; then
  for b in logprobs:30 grpo_loss:35 dpo_loss:15 linear_logprobs:35 varlen_attention:40 distill_loss:30 moe:30; do
    name=${b%%:*}
    [ -f "bench/micro_$name.py" ] && step "micro_$name" "${b##*:}" bash -c "cd '$site' && python3 -m pytest -q \
-p no:cacheprovider --rootdir='$root' '$root/bench/micro_$name.py' --benchmark-only --benchmark-columns=median,rounds \
--benchmark-json='$site/micro/$name.json'"
  done
  if [ "$dry_run" = 0 ] && ls "$site"/micro/*.json >/dev/null 2>&1; then
    python3 bench/plot.py --merge bench/results/micro-gpu.json "$site"/micro/*.json 2>&1 | tee -a "$log"
    [ -n "${OUT:-}" ] && cp bench/results/micro-gpu.json "$OUT/micro-gpu.json"
  fi
else
  echo "=== micro: pytest-benchmark is not installed here: microbenchmarks skipped" | tee -a "$log"
  record micro "SKIP(no pytest-benchmark)" 0
fi

step generation 45 python3 bench/bench_generation.py
# the engine on 4 layers of Qwen3-30B-A3B's shape against transformers' generate (grouped_mm experts), the decode
# step against its active-expert roofline (bench/results/moe.csv)
step moe 30 python3 bench/bench_moe.py --quick
step multiturn 30 python3 bench/bench_multiturn.py --quick
# the VLM engine row: 8 prompts x 8 samples of 112-px images (16 image tokens), 16 new tokens, shared vs per sample
step vlm 25 python3 bench/bench_vlm.py --device cuda --prompts 8 --group 8 --side 112 --new 16
# numerics.batch_invariant on vs off on the GPU: the tiny recipe's GRPO step first, then two micro rows at the 1.5B
# widths (no Triton compile: --quick), then the ~10M Qwen2's generation, whose mode-off engine compiles and captures
# graphs (bench/results/batch_invariant.csv, each part appended as it is measured: a timeout loses the last only)
step bitwise 40 python3 bench/bench_batch_invariant.py --device cuda --quick --steps 1 --repeats 1
if [ -f bench/bench_e2e_gpu.py ]; then
  step e2e 50 python3 bench/bench_e2e_gpu.py
fi

if [ -n "${OUT:-}" ] && [ "$dry_run" = 0 ]; then tar czf "$OUT/results.tgz" bench/results; fi
rm -rf "$site"
echo
echo "gpu_check summary ($(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo "${FASTGRPO_GIT_SHA:-?}"))"
grep -E "^copy bandwidth" "$log" | tail -1
printf '%s\n' "${summary[@]}"
