#!/usr/bin/env bash
# The whole GPU suite (tests/gpu) on one GPU in about half the serial time, in two lanes: the
# tests that start vLLM hold little memory except the families test (8B shapes, two layouts), and
# vLLM refuses to start unless --gpu-memory-utilization's share of the GPU is free. So the
# families test runs first beside the tests that start no vLLM, then the other vLLM tests run in
# two lanes. Memory checks count only each test's own processes (bench.common.gpu_used_mib), so
# the lanes do not disturb each other's numbers. Logs, summaries and result files in $1.
#   setsid bash tests/gpu/run_one_gpu.sh /tmp/gpu_suite &      # then poll /tmp/gpu_suite/done
set -u
out="${1:-/tmp/gpu_suite}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
lane() {  # lane NAME TEST_FILE...
  local name=$1; shift
  OUT="$out/$name" PYTHONUNBUFFERED=1 timeout "${LANE_SECONDS:-1500}" \
    python3 -m pytest -p no:cacheprovider -ra -s --durations=0 "$@" > "$out/$name.log" 2>&1
  echo "$name exit $? after $SECONDS s: $(tail -n 1 "$out/$name.log")" >> "$out/summary"
}
families=tests/gpu/test_families_gpu.py
no_vllm="tests/gpu/test_shared_prefix_gpu.py tests/gpu/test_optimizer_offload_gpu.py tests/gpu/test_logprob_memory_gpu.py"
single_copy="tests/gpu/test_colocate_gpu.py tests/gpu/test_shared_vllm_gpu.py"
lane families $families &
lane no_vllm $no_vllm
wait
lane single_copy $single_copy &
# Every other GPU test (a new file lands here without an edit), and the vLLM version checks.
lane loop tests/gpu $(for f in $families $no_vllm $single_copy; do echo "--ignore=$f"; done) tests/unit/test_vllm_compat.py
wait
touch "$out/done"
