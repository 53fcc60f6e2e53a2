#!/usr/bin/env bash
# The whole GPU suite (tests/gpu) on one GPU in two lanes: vLLM refuses to start unless its
# --gpu-memory-utilization share of the GPU is free, and the families test (8B shapes, two layouts)
# and the loops (a KV cache sized as a share of the GPU) hold much of it. So the families test runs
# first beside the tests that start no vLLM; then the loops run one after another in one lane, the
# tests whose vLLM has a fixed KV cache in the other. Memory checks count only each test's own
# processes (bench.common.gpu_used_mib), so the lanes leave each other's numbers alone. Logs,
# summaries and result files in $1. On one H200 the lanes' tests took 43 min together, 27 min of
# wall time in lanes (with test_parallel_gpu.py in the other lane then, where it ran out of memory).
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
# The loops these start take a share of the GPU for vLLM's KV cache (0.3-0.45 of it): one at a time.
one_at_a_time="tests/gpu/test_colocate_gpu.py tests/gpu/test_shared_vllm_gpu.py tests/gpu/test_parallel_gpu.py"
lane families $families &
lane no_vllm $no_vllm
wait
lane loops $one_at_a_time &
# Every other GPU test (a new file lands here without an edit), and the vLLM version checks.
lane fixed_kv tests/gpu $(for f in $families $no_vllm $one_at_a_time; do echo "--ignore=$f"; done) tests/unit/test_vllm_compat.py
wait
touch "$out/done"
