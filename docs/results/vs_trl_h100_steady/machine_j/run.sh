#!/usr/bin/env bash
# Machine J: 8B vs TRL, steady-state rates (16 steps, 6 warm-up), onecopy variants.
set -x
source /opt/gpu-env/env.sh
R=/root/res13; W=/root/w13; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site $S/trl/*.whl 2>&1 | grep -vi warning
/usr/bin/time -f "compileall: %e s" python3 -m compileall -q -j 0 /opt/gpu-env/site > /dev/null 2> $R/compileall.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args "$3" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
run trl1 trl-colocate-sleep ""
run base onecopy-shared_vllm ""
run nockpt-ga16 onecopy-shared_vllm "--gradient-checkpointing false --gradient-accumulation-steps 16"
run nockpt-ga8-compile onecopy-shared_vllm "--gradient-checkpointing false --gradient-accumulation-steps 8 --torch-compile"
run ckpt-compile onecopy-shared_vllm "--torch-compile"
run trl2 trl-colocate-sleep ""
echo "== done $(date +%T)"
touch $R/DONE
