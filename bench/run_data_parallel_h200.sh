#!/usr/bin/env bash
# bench/data_parallel.py on one 4-GPU machine, in the background (a device call lasts at most 10
# minutes): per shape, 1 GPU (GPU 0) and 2 GPUs (GPUs 1, 2) at the same time, then 4 GPUs. JSON
# rows and logs in $1 (default /tmp/dp). Needs $SMOLLM2_CONFIG_DIR (a tokenizer folder).
#   setsid bash bench/run_data_parallel_h200.sh /tmp/dp &        # then poll $1/done
set -u
out="${1:-/tmp/dp}"
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bench() {  # bench GPUS N SHAPE [TRAINER ARGS]
  local visible=$1 n=$2 shape=$3 args=${4:-}
  CUDA_VISIBLE_DEVICES=$visible PYTHONUNBUFFERED=1 timeout 900 python3 bench/data_parallel.py --shape "$shape" \
    --tokenizer "$SMOLLM2_CONFIG_DIR" --gpus "$n" --steps 6 --out "$out" --trainer-args "$args" \
    > "$out/$shape-$n.log" 2>&1
  echo "$shape N=$n exit $? after $SECONDS s" >> "$out/summary"
}
for spec in "qwen2.5-1.5b|" "llama3.1-8b|--bf16-inplace --optimizer adamw8bit"; do
  shape=${spec%%|*}; args=${spec#*|}
  bench 0 1 "$shape" "$args" &
  bench 1,2 2 "$shape" "$args" &
  wait
  bench 0,1,2,3 4 "$shape" "$args"
done
python3 bench/data_parallel.py --table "$out"/dp_*.json > "$out/table.md" 2>&1
touch "$out/done"
