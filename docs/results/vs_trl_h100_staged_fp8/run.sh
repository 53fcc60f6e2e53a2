#!/usr/bin/env bash
# 8B on one H100, MPS on, one engine at a time with the whole GPU, in the order
# onecopy (--staged-step, float8 moments), TRL, TRL, onecopy; then the single-copy
# GPU tests that call the bridge's optimizer hooks. Started in the background from
# the repo root on the device; results in /root/res.
set -x
source /opt/gpu-env/env.sh
R=/root/res; W=/root/w; mkdir -p $R $W
cp -a . $W/ 2>/dev/null; rm -rf $W/.device $W/.trlwheels
echo "${COMMIT:-unknown}" > $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site .trlwheels/*.whl 2>&1 | grep -vi warning
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
run trl-2 trl-colocate-sleep "" ""
run stagedfp8-2 onecopy-shared_vllm "--torch-compile --staged-step --optimizer adamwfp8" "$W16"
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== gpu tests $(date +%T)"
OUT=$R/gpu timeout 600 python3 -m pytest -p no:cacheprovider -ra -s \
  "tests/gpu/test_shared_vllm_gpu.py::test_single_copy_on_gpu[smollm2-135m]" \
  tests/gpu/test_shared_vllm_gpu.py::test_a_killed_vllm_is_restarted_and_given_the_trainers_weights > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(date +%T)"
echo "== done $(date +%T)"
touch $R/DONE
