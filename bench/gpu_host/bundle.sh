#!/bin/bash
# A folder of Python packages (vLLM and what it needs, for the GPU host's Python) as zstd
# parts that each fit one call of a file-carrying runner (58 MiB: 64 MiB a call, less the
# checkout), with their SHA256SUMS. zstd -12: about 3 minutes for vLLM 0.33's 4.2 GB on
# 2 cores (xz -6 took 40), 1.47 GB of parts; setup.sh joins them.
#
#   bench/gpu_host/bundle.sh SITE OUTDIR
set -euo pipefail
site=${1:?usage: bundle.sh SITE OUTDIR}
out=${2:?usage: bundle.sh SITE OUTDIR}
mkdir -p "$out"
rm -f "$out"/site.tar.zst.part* "$out/SHA256SUMS"
tar -C "$site" --sort=name --owner=0 --group=0 --numeric-owner -cf - . \
  | zstd -T0 -12 -q -c | (cd "$out" && split -b 58M -d -a 2 - site.tar.zst.part)
(cd "$out" && sha256sum site.tar.zst.part* > SHA256SUMS)
ls "$out" | wc -l
