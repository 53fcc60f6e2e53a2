#!/usr/bin/env bash
# 8B: onecopy --staged-step with float8 moments, then TRL, then the SmolLM2
# learning run with --optimizer adamwfp8 --bf16-inplace --staged-step.
set -x
source /opt/gpu-env/env.sh
R=/root/res23; W=/root/w23; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site $S/trl/*.whl 2>&1 | grep -vi warning
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args onecopy-env-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" --onecopy-env-args="$4" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
run stagedfp8-1 onecopy-shared_vllm "--torch-compile --staged-step --optimizer adamwfp8" "$W16"
run trl-1 trl-colocate-sleep "" ""
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== learning $(date +%T)"
timeout 900 python3 bench/learning_run.py --out $R/learn_fp8_staged --steps 80 --lr 1e-5 --model $SMOLLM2_DIR --trainer-args "--optimizer adamwfp8 --bf16-inplace --staged-step" > $R/learn.log 2>&1
echo "learning rc=$? $(date +%T)"
echo "== done $(date +%T)"
touch $R/DONE
