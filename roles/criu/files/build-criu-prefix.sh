#!/bin/sh
# Build a private CRIU prefix: PREFIX/sbin/criu, PREFIX/lib/{ld-linux-x86-64.so.2,libs...}.
#   build-criu-prefix.sh PREFIX SUITE MIRROR
# debootstrap resolves criu's library closure into a scratch root, which is thrown away;
# only the binary, the loader and the libraries the loader lists are kept (about 13 MB).
# The same recipe as the project's scripts/install-criu.sh.
# CRIU_FROM_ROOT=DIR takes criu from an existing root with it installed instead (no debootstrap).
set -eu
prefix=$1 suite=$2 mirror=$3
scratch=$(mktemp -d /var/tmp/criu-prefix.XXXXXX)
from_root=${CRIU_FROM_ROOT:-}

drop_scratch() {
    # Unmount whatever debootstrap left mounted (proc, sys) before removing the root.
    awk -v d="$scratch" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m" || true; done
    rm -f "$scratch/root" 2>/dev/null || true
    rm -rf --one-file-system "$scratch"
}
trap drop_scratch EXIT

if [ -n "$from_root" ]; then
    ln -s "$(cd "$from_root" && pwd)" "$scratch/root"
else
    # An older debootstrap (Debian 12's) has no script for a newer suite by name; forky is
    # built like sid.
    script=
    [ -e "/usr/share/debootstrap/scripts/$suite" ] || script=/usr/share/debootstrap/scripts/sid
    # shellcheck disable=SC2086
    if ! debootstrap --variant=minbase --include=criu "$suite" "$scratch/root" "$mirror" \
        $script >"$scratch/debootstrap.log" 2>&1; then
        tail -n 20 "$scratch/debootstrap.log" >&2
        echo "build-criu-prefix: debootstrap of $suite from $mirror failed" >&2
        exit 1
    fi
fi
multi=$scratch/root/usr/lib/x86_64-linux-gnu
ldso=$multi/ld-linux-x86-64.so.2
tmp=$prefix.tmp
rm -rf "$tmp"
mkdir -p "$tmp/sbin" "$tmp/lib"
cp -L "$scratch/root/usr/sbin/criu" "$tmp/sbin/criu"
cp -L "$ldso" "$tmp/lib/"
# The loader lists the closure; ldd would use this host's (older) loader.
list=$("$ldso" --library-path "$multi:$scratch/root/lib/x86_64-linux-gnu" --list "$tmp/sbin/criu")
if echo "$list" | grep -q 'not found'; then
    echo "build-criu-prefix: libraries missing: $list" >&2
    exit 1
fi
echo "$list" | sed -n 's/.*=> \(\/[^ ]*\) (0x.*/\1/p' | while read -r lib; do
    cp -L "$lib" "$tmp/lib/"
done
# Publish whole: a half-built prefix must never satisfy the role's `creates:` check.
rm -rf "$prefix"
mv "$tmp" "$prefix"
echo "build-criu-prefix: CRIU from $suite in $prefix"
