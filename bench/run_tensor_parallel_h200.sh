#!/usr/bin/env bash
# The largest shapes on one 4-GPU machine with one copy of the weights (bench/memory.py, vLLM
# generating beside the trainer, 5 GRPO steps, random weights drawn by vLLM), in the background
# (a device call lasts at most 10 minutes):
#   70b: a Llama-3.1-70B shape, tensor parallel over GPUs 0-3 (vLLM TP=4), profile lean
#   32b: a Qwen3-32B shape over GPUs 0,1 (vLLM TP=2, profile lean) and, at the same time, on GPU 2
#        alone (profile offload-grads: gradients and moments in host memory, ~122 GiB of it)
# JSON rows, logs and table.md in $1 (default /tmp/tp). Needs $SMOLLM2_CONFIG_DIR (a tokenizer).
#   setsid bash bench/run_tensor_parallel_h200.sh /tmp/tp 70b 32b &     # then poll $1/done
set -u
out="${1:-/tmp/tp}"
shift
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
memory() {  # memory GPUS TP SHAPE CONFIG
  local visible=$1 tp=$2 shape=$3 config=$4
  CUDA_VISIBLE_DEVICES=$visible PYTHONUNBUFFERED=1 timeout 1200 python3 bench/memory.py --out "$out" \
    --shapes "$shape" --configs "$config" --tensor-parallel "$tp" --tokenizer "$SMOLLM2_CONFIG_DIR" \
    --steps 5 --batch-size 8 --seq-len 512 --kv-gib 8 --vllm-args=--enforce-eager --run-timeout 1100 \
    > "$out/$shape-tp$tp-$config.log" 2>&1
  echo "$shape TP=$tp $config exit $? after $SECONDS s" >> "$out/summary"
}
[ $# -eq 0 ] && set -- 70b 32b
for what in "$@"; do
  case $what in
    70b) memory 0,1,2,3 4 llama3.1-70b lean8 ;;
    32b) memory 0,1 2 qwen3-32b lean8 &
         memory 2 1 qwen3-32b lean8-offload-grads &
         wait ;;
  esac
done
python3 bench/memory.py --table "$out"/memory_*.json > "$out/table.md" 2>&1
touch "$out/done"
