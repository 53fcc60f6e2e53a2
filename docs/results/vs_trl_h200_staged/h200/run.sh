#!/usr/bin/env bash
# staged-step GPU test, then 8B onecopy in place vs --staged-step under MPS (ABBA), TRL once, then the rest of tests/gpu.
set -x
source /opt/gpu-env/env.sh
R=/root/res21; W=/root/w21; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site $S/trl/*.whl 2>&1 | grep -vi warning
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
echo "== staged test $(date +%T)"
timeout 300 python3 -m pytest -x -q tests/gpu -k staged -p no:cacheprovider > $R/pytest_staged.log 2>&1
echo "staged test rc=$? $(date +%T)"
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args onecopy-env-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" --onecopy-env-args="$4" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
run inplace-1 onecopy-shared_vllm "--torch-compile" "$W16"
run staged-1 onecopy-shared_vllm "--torch-compile --staged-step" "$W16"
run staged-2 onecopy-shared_vllm "--torch-compile --staged-step" "$W16"
run inplace-2 onecopy-shared_vllm "--torch-compile" "$W16"
run trl-1 trl-colocate-sleep "" ""
run staged-mps85 onecopy-shared_vllm "--torch-compile --staged-step --mps-active-thread-percentage 85" "$W16"
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== rest of tests/gpu $(date +%T)"
timeout 900 python3 -m pytest -q tests/gpu -k "not staged" -p no:cacheprovider > $R/pytest_rest.log 2>&1
echo "rest rc=$? $(date +%T)"
echo "== done $(date +%T)"
touch $R/DONE
