#!/usr/bin/env bash
# 8B in place (no --staged-step) with --mps-active-thread-percentage 85: does the NaN of staged-mps85 come from the cap?
set -x
source /opt/gpu-env/env.sh
R=/root/res22; W=/root/w22; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
echo "== inplace-mps85 $(date +%T)"
timeout 500 python3 bench/vs_trl.py --random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 8 --warmup-steps 3 --timeout 480 --name inplace-mps85 --systems onecopy-shared_vllm --onecopy-args="--torch-compile --mps-active-thread-percentage 85" --onecopy-env-args="--env.max_num_workers 16 --env.max_batches_offpolicy 4" > $R/inplace-mps85.log 2>&1
echo "inplace-mps85 rc=$? $(date +%T)"
echo quit | nvidia-cuda-mps-control
touch $R/DONE
