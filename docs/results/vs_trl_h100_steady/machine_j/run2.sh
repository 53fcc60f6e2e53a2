#!/usr/bin/env bash
# Machine J, second part: compile with checkpointing; MPS probes.
set -x
source /opt/gpu-env/env.sh
R=/root/res13; W=/root/w13
cd $W; export PYTHONUNBUFFERED=1
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
run ckpt-compile onecopy-shared_vllm "--torch-compile"
if command -v nvidia-cuda-mps-control; then
  nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
  run mps-base onecopy-shared_vllm ""
  run mps-nockpt-ga8-compile onecopy-shared_vllm "--gradient-checkpointing false --gradient-accumulation-steps 8 --torch-compile"
  echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
else
  echo "no nvidia-cuda-mps-control"
fi
echo "== done2 $(date +%T)"
touch $R/DONE2
