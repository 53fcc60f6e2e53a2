#!/usr/bin/env bash
# Machine G: is the bundle's missing bytecode part of the start? Then time to accuracy, onecopy and TRL, with it.
set -x
source /opt/gpu-env/env.sh
R=/root/res11; W=/root/w11; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site $S/trl/*.whl 2>&1 | grep -vi warning
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
TORCH_DIR=$(dirname $(python3 -c "import importlib.util as u;print(u.find_spec('torch').origin)"))
TF_DIR=$(dirname $(python3 -c "import importlib.util as u;print(u.find_spec('transformers').origin)"))
count() { for d in /opt/gpu-env/site/vllm /opt/gpu-env/site/torchao /opt/gpu-env/site/trl $TORCH_DIR $TF_DIR; do
  echo "$d: py=$(find $d -name '*.py' | wc -l) pyc=$(find $d -name '*.pyc' | wc -l) writable=$([ -w $d ] && echo yes || echo no)"; done; }
{
  echo "== before any import"; count
  python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode, 'pycache_prefix', sys.pycache_prefix, sys.version)"
  env | grep "^PYTHON"
  for i in 1 2; do /usr/bin/time -f "import torch: %e s" python3 -c "import torch"; done
  for i in 1 2; do /usr/bin/time -f "import vllm api_server: %e s" python3 -c "import vllm.entrypoints.openai.api_server"; done
  for i in 1 2; do /usr/bin/time -f "import trl GRPOTrainer: %e s" python3 -c "from trl import GRPOTrainer"; done
  echo "== after those imports"; count
  /usr/bin/time -f "compileall site: %e s" python3 -m compileall -q -j 16 /opt/gpu-env/site > /dev/null
  [ -w $TORCH_DIR ] && /usr/bin/time -f "compileall torch+transformers: %e s" python3 -m compileall -q -j 16 $TORCH_DIR $TF_DIR > /dev/null
  echo "== after compileall"; count
  for i in 1 2; do /usr/bin/time -f "import torch: %e s" python3 -c "import torch"; done
  for i in 1 2; do /usr/bin/time -f "import vllm api_server: %e s" python3 -c "import vllm.entrypoints.openai.api_server"; done
  for i in 1 2; do /usr/bin/time -f "import trl GRPOTrainer: %e s" python3 -c "from trl import GRPOTrainer"; done
} > $R/pyc_probe.txt 2>&1
python3 -X importtime -c "import example_trainer.grpo" 2> $R/trainer_importtime.txt
python3 -X importtime -c "import vllm_patching.api_server" 2> $R/vllm_server_importtime.txt
{ export PYTHONPATH=$W:$PYTHONPATH; python3 $S/firstcall_gpu.py plain; python3 $S/firstcall_gpu.py small_first; CUDA_MODULE_LOADING=EAGER python3 $S/firstcall_gpu.py eager_modules; } > $R/firstcall.txt 2>&1
tta_onecopy() { # name, then env assignments
  name=$1; shift
  echo "== tta $name $(date +%T)"
  env "$@" timeout 420 python3 bench/time_to_accuracy.py --out $R/tta_$name --model $SMOLLM2_DIR --systems onecopy-shared_vllm \
    --env-args "--env.max_batches_offpolicy 2" --trainer-args "--max-off-policy-steps 2 --vllm-compile false" > $R/tta_$name.log 2>&1
  echo "tta $name rc=$?"
}
tta_trl() {
  echo "== tta $1 $(date +%T)"
  timeout 480 python3 bench/time_to_accuracy.py --out $R/tta_$1 --model $SMOLLM2_DIR --systems trl-colocate > $R/tta_$1.log 2>&1
  echo "tta $1 rc=$?"
}
tta_onecopy onecopy_v2
tta_trl trl_1
tta_onecopy onecopy_v1 VLLM_USE_V2_MODEL_RUNNER=0
tta_trl trl_2
echo "== done $(date +%T)"
touch $R/DONE
