#!/usr/bin/env bash
# Installs the Pitstop plugin for vLLM (the pitstop distribution itself, without its
# dependencies) into vLLM's interpreter, or into a folder that interpreter finds on PYTHONPATH.
#
# --no-deps: the plugin's modules import only the standard library, torch, vLLM and Pitstop's
# tenant side, all of which vLLM's environment already has; nothing vLLM pinned moves.
# Usage: scripts/install-vllm-plugin.sh VLLM_PYTHON [TARGET_DIR]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:?usage: install-vllm-plugin.sh VLLM_PYTHON [TARGET_DIR]}
TARGET=${2:-}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Built from a copy: setuptools writes build/ and *.egg-info beside the sources, and two
# installs from one checkout at once must not share them.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -C "$ROOT" -cf - pyproject.toml README.md agent | tar -C "$work" -xf -
args=(-m pip install -qq --no-deps --no-index --no-build-isolation)
if [[ -n $TARGET ]]; then
    args+=(--upgrade --target "$TARGET")
fi
"$PY" "${args[@]}" "$work" 2> >(grep -v -e 'Setuptools is replacing distutils' -e 'warnings.warn(' >&2)
echo "install-vllm-plugin: pitstop $("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]) if sys.argv[1] else None; import importlib.metadata as m; print(m.version("pitstop"))' "$TARGET") installed for $PY${TARGET:+ in $TARGET}" >&2
