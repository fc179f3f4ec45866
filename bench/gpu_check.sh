#!/usr/bin/env bash
# The one prepared GPU script: the GPU test tier, then every GPU benchmark, each bounded, in under 8 minutes.
#
#   bash bench/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#
# It needs torch, triton and transformers already installed (the lent GPU machine has them and can install
# nothing), so it does not pip-install fastgrpo: it lays the package out under a temporary folder with links
# (kernels/ appears as fastgrpo/kernels, as setup.py maps it) and puts that folder on PYTHONPATH.
# Each benchmark appends rows (device, git sha, date, shape, figures) to bench/results/*.csv; when $OUT is
# set (the device tool), those files also come back as $OUT/results.tgz and the full log as $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

site=$(mktemp -d)
mkdir -p "$site/fastgrpo"
for f in "$root"/fastgrpo/*; do ln -s "$f" "$site/fastgrpo/$(basename "$f")"; done
ln -s "$root/kernels" "$site/fastgrpo/kernels"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

log=${OUT:-/tmp}/gpu_check.log
: >"$log"
summary=()

step() {  # step NAME SECONDS CMD...: run one bounded step, record status and wall time
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=TIMEOUT; elif [ "$rc" -ne 0 ]; then status="FAIL($rc)"; fi
  summary+=("$(printf '%-24s %-9s %5ss' "$name" "$status" "$((SECONDS - t0))")")
}

step env 30 python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__, torch.cuda.get_device_name())"
step ceilings 40 python3 -c "import sys; sys.path.insert(0, 'bench'); from common import *; \
print(f'copy bandwidth {copy_bandwidth_gbps():.0f} GB/s, bf16 matmul {matmul_tflops():.0f} TFLOP/s')"
# Only the test files that hold GPU cases are collected (the others may import packages the GPU machine lacks,
# such as math-verify). Run from inside $site: `python -m` puts the working directory first on sys.path, and the
# repository root would offer its fastgrpo/ (without kernels/) ahead of the laid-out package.
gpu_files=$(grep -rl "mark.gpu" "$root/tests" | sort | tr '\n' ' ')
step gpu_tests 80 bash -c "cd '$site' && python3 -m pytest -q -m gpu -p no:cacheprovider $gpu_files"
for b in logprobs:45 grpo_loss:60 linear_logprobs:75 varlen_attention:100 generation:110; do
  name=${b%%:*}
  [ -f "bench/bench_$name.py" ] && step "bench_$name" "${b##*:}" python3 "bench/bench_$name.py"
done

if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" bench/results; fi
rm -rf "$site"
echo
echo "gpu_check summary ($(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null))"
grep -E "^copy bandwidth" "$log" | tail -1
printf '%s\n' "${summary[@]}"
