#!/usr/bin/env bash
# Build CRIU's CUDA plugin (cuda_plugin.so) from Debian's CRIU 4.2.1 source package, once.
#
# vLLM's own `vllm snapshot` (the `vllm-snapshot` rung, and a user running it by hand) needs
# CRIU's CUDA plugin in CRIU_CUDA_PLUGIN_DIR; Debian's criu packages do not ship it, and
# Pitstop's own CRIU backend does not use it (it checkpoints CUDA through the driver API).
# The plugin is built against the same CRIU release that scripts/install-criu.sh installs.
#
#   scripts/build-criu-cuda-plugin.sh [OUTDIR]   (default .cache/criu-cuda-plugin)
#
# What it does: a private apt configuration (nothing under /etc/apt is changed) with a
# deb-src line for Debian forky fetches the criu source package; CRIU's build dependencies
# are installed with apt-get (root); `make cuda_plugin` builds plugins/cuda/cuda_plugin.so,
# which is copied into OUTDIR in one rename. About 2 minutes on 2 cores, most of it the
# build dependencies. The plugin is a host binary: build it on (or for) the GPU host's
# architecture (x86-64 here and there).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$ROOT/.cache/criu-cuda-plugin}
SUITE=${PITSTOP_CRIU_SUITE:-forky}
MIRROR=${PITSTOP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Mirrors install-criu.sh's CRIU: the plugin must come from the same release.
WANT_UPSTREAM=${PITSTOP_CRIU_SOURCE_VERSION:-4.2}
BUILD_DEPS=(build-essential dpkg-dev libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev
    protobuf-compiler libnl-3-dev libnet1-dev libcap-dev pkg-config python3-protobuf
    libbsd-dev libgnutls28-dev libnftables-dev uuid-dev libdrm-dev)

say() { echo "build-criu-cuda-plugin: $*" >&2; }

if [[ -f $OUT/cuda_plugin.so && -f $OUT/SOURCE ]] && grep -q "^criu $WANT_UPSTREAM" "$OUT/SOURCE"; then
    say "already built: $OUT/cuda_plugin.so ($(cat "$OUT/SOURCE"))"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/criu-cuda-plugin.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
echo "deb-src $MIRROR $SUITE main" > "$work/apt/sources.list"
apt_private=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=-"
    -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache")

say "installing CRIU's build dependencies (apt-get)"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${BUILD_DEPS[@]}" >/dev/null

say "fetching the criu source package from $SUITE"
apt-get "${apt_private[@]}" update -qq
# Only the upstream tarball is needed (the plugin is built from CRIU's own Makefile, without
# Debian's packaging), and some mirrors lag on the packaging tarball: take the orig file's URI
# and checksum from the signed index (apt-get source --print-uris) and check what arrives.
line=$(apt-get "${apt_private[@]}" source --print-uris -qq criu | grep -E "criu_[0-9.]+\.orig\.tar\." | head -n1)
[[ -n $line ]] || { say "error: no criu source package in $SUITE"; exit 1; }
read -r uri name _size sum <<<"$line"
uri=${uri//\'/}
orig="$work/src/$name"
curl -fsSL --retry 3 -o "$orig" "$uri"
echo "${sum#SHA256:}  $orig" | sha256sum -c --quiet - || { say "error: $name does not match its checksum"; exit 1; }
version=$(basename "$orig" | sed -n 's/^criu_\([0-9.]*\)\.orig.*/\1/p')
case $version in
    "$WANT_UPSTREAM"*) ;;
    *) say "error: $SUITE has criu $version, not $WANT_UPSTREAM.x; set PITSTOP_CRIU_SOURCE_VERSION"; exit 1 ;;
esac
tar -C "$work/src" -xf "$orig"
tree=$(find "$work/src" -maxdepth 1 -type d -name 'criu-*' | head -n1)

say "building cuda_plugin.so from criu $version"
make -C "$tree" -j"$(nproc)" cuda_plugin >"$work/build.log" 2>&1 || {
    tail -n 40 "$work/build.log" >&2; say "error: make cuda_plugin failed"; exit 1; }
built=$(find "$tree/plugins/cuda" -name cuda_plugin.so | head -n1)
[[ -n $built ]] || { say "error: no cuda_plugin.so after the build"; exit 1; }

mkdir -p "$(dirname "$OUT")"
stage="$OUT.new.$$"
rm -rf "$stage" && mkdir -p "$stage"
cp "$built" "$stage/cuda_plugin.so"
printf 'criu %s (%s, %s)\n' "$version" "$(basename "$orig")" "$SUITE" > "$stage/SOURCE"
rm -rf "$OUT" && mv "$stage" "$OUT"
say "done: $OUT/cuda_plugin.so"
