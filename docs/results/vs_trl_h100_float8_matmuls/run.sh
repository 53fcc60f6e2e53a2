#!/usr/bin/env bash
# 8B on one H100, MPS on, one engine at a time with the whole GPU: onecopy with
# --float8-matmuls backward (on top of the staged step and float8 moments), TRL, TRL,
# onecopy; before it the float8 GPU test, after it the SmolLM2 learning run with the
# same trainer flags. Started in the background from the repo root on the device;
# results in /root/res.
set -x
source /opt/gpu-env/env.sh
R=/root/res; W=/root/w; mkdir -p $R $W
cp -a . $W/ 2>/dev/null; rm -rf $W/.device $W/.trlwheels
echo "${COMMIT:-unknown}" > $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site .trlwheels/*.whl 2>&1 | grep -vi warning
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
echo "== float8 gpu test $(date +%T)"
timeout 400 python3 -m pytest -p no:cacheprovider -ra tests/gpu/test_float8_gpu.py > $R/gpu_float8.log 2>&1
rc=$?; echo "float8 gpu test rc=$rc $(date +%T)"
if [ $rc -ne 0 ]; then touch $R/DONE; exit 1; fi
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args onecopy-env-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" --onecopy-env-args="$4" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
F8="--torch-compile --staged-step --optimizer adamwfp8 --float8-matmuls backward"
run f8-1 onecopy-shared_vllm "$F8" "$W16"
if [ ! -s $R/vs/vs_trl_f8-1.json ]; then echo quit | nvidia-cuda-mps-control; touch $R/DONE; exit 1; fi
run trl-1 trl-colocate-sleep "" ""
run trl-2 trl-colocate-sleep "" ""
run f8-2 onecopy-shared_vllm "$F8" "$W16"
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== learning $(date +%T)"
timeout 900 python3 bench/learning_run.py --out $R/learn_f8 --steps 80 --lr 1e-5 --model $SMOLLM2_DIR \
  --trainer-args "--optimizer adamwfp8 --bf16-inplace --staged-step --float8-matmuls backward" > $R/learn.log 2>&1
echo "learning rc=$? $(date +%T)"
echo "== done $(date +%T)"
touch $R/DONE
