# Sourced by setup.sh and steps.sh: the environment the benches run in on the GPU host, and
# the bench arguments every vLLM step repeats ($VL: vLLM's interpreter and packages; $VC:
# what vLLM's own snapshot needs).
KIT=${KIT:-/tmp/gpu} SITE=${SITE:-/tmp/vsite}
export PYTHONPATH=$SITE:$KIT/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
export PITSTOP_CRIU=$KIT/criu/bin/criu PATH=$KIT/cc:$PATH CRIU_CUDA_PLUGIN_DIR=$KIT/cc
PY=$(command -v python3)
VL="--python $PY --site $SITE --engine-env VLLM_USE_FLASHINFER_SAMPLER=0 --engine-env PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1"
VC="--criu $KIT/criu/bin/criu --cuda-checkpoint $KIT/cc/cuda-checkpoint --cuda-plugin-dir $KIT/cc"
