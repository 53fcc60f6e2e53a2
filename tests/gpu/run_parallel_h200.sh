#!/usr/bin/env bash
# The several-GPU checks on one 4-GPU machine, in the background (a device call lasts at most
# 10 minutes): 2 GPUs (data parallel, tensor parallel), a killed vLLM on the other 2 GPUs at the
# same time (data parallel recovers, tensor parallel stops), then all 4 GPUs; with "one", first
# the same file on one GPU. Logs and result files in $1 (default /tmp/gpu_parallel).
#   setsid bash tests/gpu/run_parallel_h200.sh /tmp/gpu_parallel [one] &    # then poll $1/done
set -u
out="${1:-/tmp/gpu_parallel}"
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
test_file=tests/gpu/test_parallel_gpu.py
pytest_on() {  # pytest_on GPUS NAME -k EXPR
  local gpus=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT="$out/$name" PYTHONUNBUFFERED=1 timeout 1500 \
    python3 -m pytest -q -s -p no:cacheprovider "$test_file" "$@" > "$out/$name.log" 2>&1
  echo "$name exit $? after $SECONDS s" >> "$out/summary"
}
[ "${2:-}" = one ] && pytest_on 0 one_gpu
pytest_on 0,1 two_gpus -k "every_gpu" &
pytest_on 2,3 two_gpus_killed -k "killed or dies" &
wait
pytest_on 0,1,2,3 four_gpus -k "every_gpu"
touch "$out/done"
