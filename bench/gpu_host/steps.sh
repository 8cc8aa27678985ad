#!/bin/bash
# Runs a steps file on the GPU host, one step after the other, detached from the call that
# starts it (`setsid nohup bash steps.sh FILE &`): each line is `NAME COMMAND...` (blank and
# # lines skipped; $PY, $VL, $VC and $R expand), its output in $R/NAME.log, its start, end and
# status in $R/progress.log. Between steps nothing may hold the GPU: a process a failed step
# left there is killed, and the benches' work folders are removed, with the reference
# engine's models in /dev/shm (gpu_recovery_bench makes each size again in a minute; left
# there, 8 + 32 + 64 GiB of them filled the host's memory and the next make-model was
# OOM-killed). vLLM's models (/dev/shm/models) stay: later steps reuse them. $R/DONE marks
# the end.
source "${KIT:-/tmp/gpu}/run/env.sh"
R=${R:-/root/res}; P=$R/progress.log
mkdir -p "$R"
cd "${REPO:-/root/repo}" || exit 1
while read -r name cmd; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  echo "$(date +%T) start $name: $cmd" >> "$P"
  t0=$(date +%s)
  eval "$cmd" < /dev/null > "$R/$name.log" 2>&1
  echo "$(date +%T) end $name rc=$? $(( $(date +%s) - t0 ))s" >> "$P"
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "$(date +%T) killing $pid left on the GPU" >> "$P"
    kill -9 "$pid" 2>/dev/null
  done
  rm -rf /root/pitstop-bench /root/pitstop-vllm-bench /root/pitstop-fleet-bench /dev/shm/pitstop-models
  echo "$(date +%T) memory free $(free -g | awk '/^Mem:/ {print $7}') GiB, /dev/shm $(du -sh /dev/shm | cut -f1)" >> "$P"
done < "$1"
touch "$R/DONE"
