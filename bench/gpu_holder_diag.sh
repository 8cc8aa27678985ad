#!/usr/bin/env bash
# Where does the reference engine's first request stall with CUDA-held weights?
# GPU host only: starts a cuda holder and the engine with --holder, sends one request with
# a timeout, then SIGABRTs the engine (python -X faulthandler) so every thread's stack lands
# in OUT/engine.log.
set -u
OUT=${1:?OUT}; MODEL=${2:?MODEL}
mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
python3 -m agent holder --backend cuda --gpu "$GPU" --dir /tmp/hd > "$OUT/holder.log" 2>&1 &
HP=$!
sleep 5
python3 -X faulthandler -m agent.engines.refengine --model "$MODEL" --uds /tmp/e.sock \
  --served-model-name m --device cuda --kv-slots 2 --max-model-len 512 \
  --holder "/tmp/hd/$GPU/holder.sock" --weights-digest sha256-diag > "$OUT/engine.log" 2>&1 &
EP=$!
for i in $(seq 120); do curl -s --unix-socket /tmp/e.sock http://x/health >/dev/null && break; sleep 0.5; done
echo "healthy after ~$((i/2)) s"
curl -s -m 20 --unix-socket /tmp/e.sock http://x/v1/completions -H 'content-type: application/json' \
  -d '{"model":"m","prompt":"Hello","max_tokens":4,"temperature":0}'; echo " rc=$?"
kill -ABRT $EP; sleep 2; kill -9 $EP $HP 2>/dev/null
tail -80 "$OUT/engine.log"
