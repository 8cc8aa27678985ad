#!/bin/bash
# Everything but vLLM itself that the GPU benches need on a GPU host without network, in one
# folder (about 45 MB) to carry there: CRIU (binary, ld.so, libraries), CRIU's CUDA plugin,
# NVIDIA's cuda-checkpoint, the agent's Python dependencies the host lacks (wheels for its
# Python), a zstd decoder for the vLLM bundle's parts, and this folder's scripts.
#
#   bench/gpu_host/pack.sh OUT CUDA_CHECKPOINT [PYVER]
#
# CUDA_CHECKPOINT: NVIDIA's binary (github.com/NVIDIA/cuda-checkpoint,
# bin/x86_64_Linux/cuda-checkpoint): carried, never committed. PYVER: the host's Python
# (default 3.12). The wheels are those a host with vLLM's bundle still lacks: boto3 and moto's
# S3 server (fleet_bench's store), bcrypt and sdnotify (the agent's own); the rest comes with
# vLLM or the host.
set -euo pipefail
out=${1:?usage: pack.sh OUT CUDA_CHECKPOINT [PYVER]}
cc=${2:?usage: pack.sh OUT CUDA_CHECKPOINT [PYVER]}
pyver=${3:-3.12}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
mkdir -p "$out/cc" "$out/whl" "$out/zs" "$out/run"
make -C "$repo" -s criu
rm -rf "$out/criu" && "$repo/scripts/install-criu.sh" bundle "$out/criu"
make -C "$repo" -s criu-cuda-plugin
cp "$repo/.cache/criu-cuda-plugin/cuda_plugin.so" "$cc" "$out/cc/"
plat=(--only-binary=:all: --python-version "$pyver" --implementation cp --platform manylinux2014_x86_64)
for n in $(seq 17 39); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
tmp=$(mktemp -d)
python3 -m pip download -q -d "$tmp" "${plat[@]}" bcrypt 'boto3==1.44.8' 'moto[server]==5.2.5'
python3 -m pip download -q -d "$tmp" --no-deps --no-binary=:all: 'sdnotify==0.3.2'
python3 -m pip download -q -d "$out/zs" --no-deps "${plat[@]}" zstandard
# moto[server] drags in CloudFormation, X-Ray and more that its S3 server never imports.
for f in "$tmp"/*; do
  case "$(basename "$f")" in
    boto3-*|botocore-*|s3transfer-*|jmespath-*|moto-*|flask-*|flask_cors-*|blinker-*|itsdangerous-*|\
    werkzeug-*|xmltodict-*|responses-*|py_partiql_parser-*|bcrypt-*|sdnotify-*) mv "$f" "$out/whl/";;
  esac
done
rm -rf "$tmp"
cp "$here"/*.sh "$out/run/"
du -sh "$out"
