#!/bin/bash
# On the GPU host, once the kit (pack.sh's folder) is at $KIT and every part of the vLLM
# bundle (bundle.sh) with its SHA256SUMS is in $PARTS; run from the checkout's root. Joins
# the parts into $SITE, installs the kit's wheels into $KIT/site, copies the checkout to
# $REPO (the runs read it from there while later calls replace the working tree), disables
# io_uring (CRIU cannot dump it; vLLM's API server sets it up), sets THP and /run as a
# fleet's hosts have them, and checks the imports.
set -euo pipefail
KIT=${KIT:-/tmp/gpu} PARTS=${PARTS:-/tmp/parts} SITE=${SITE:-/tmp/vsite} REPO=${REPO:-/root/repo}
t0=$(date +%s)
(cd "$PARTS" && sha256sum -c --quiet SHA256SUMS)
mkdir -p "$SITE"
if command -v zstd >/dev/null; then
  cat "$PARTS"/site.tar.zst.part* | zstd -d -q -c | tar -C "$SITE" -xf -
else  # no zstd on the host: the kit's zstandard wheel decodes
  python3 -m pip install -q --no-index --no-deps --target "$KIT/zs-site" "$KIT"/zs/*.whl
  cat "$PARTS"/site.tar.zst.part* | PYTHONPATH="$KIT/zs-site" python3 -c \
    "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" \
    | tar -C "$SITE" -xf -
fi
rm -f "$PARTS"/site.tar.zst.part*
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$KIT/site" "$KIT"/whl/*
chmod +x "$KIT"/cc/cuda-checkpoint
sysctl -qw kernel.io_uring_disabled=2
# What the kernel role sets on a fleet's hosts (kernel_transparent_hugepage: always): CRIU
# restores pages faster into huge pages. A step that measures the host's own setting sets it.
echo always > /sys/kernel/mm/transparent_hugepage/enabled
# A systemd host's /run is a tmpfs, where CRIU keeps its kernel probe (/run/criu.kdat)
# between runs (only there: criu/kerndat.c); this host's /run is not, so every criu call
# probed the kernel again (10-40 ms, bench/criu_fixed_costs_bench.py). A tmpfs goes on /run,
# with what was there bound back in (not CRIU's leftover criu.kdat.tmp, which would stop it
# saving the probe).
if [ "$(stat -f -c %T /run)" != tmpfs ]; then
  mkdir -p /tmp/run.disk && mount --bind /run /tmp/run.disk
  mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
  for e in /tmp/run.disk/* /tmp/run.disk/.[!.]*; do
    n=/run/${e##*/}
    case "${e##*/}" in criu.kdat*) continue ;; esac
    if [ -L "$e" ]; then cp -a "$e" "$n"
    elif [ -d "$e" ]; then mkdir -p "$n" && mount --bind "$e" "$n"
    elif [ -e "$e" ]; then touch "$n" && mount --bind "$e" "$n"
    fi
  done
fi
echo "/run is $(stat -f -c %T /run)"
rm -rf "$REPO" && mkdir -p "$REPO" && cp -a . "$REPO/"
source "$KIT/run/env.sh"
(cd "$REPO" && $PY -c "import agent, boto3, moto, sdnotify, vllm, torch
print('imports ok: vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())")
"$KIT/criu/bin/criu" --version | head -n1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "setup took $(( $(date +%s) - t0 )) s"
