#!/bin/sh
# Install CRIU >= 4.2 for Pitstop, idempotently, and give it one fixed path:
# .cache/criu/bin/criu. CRIU 4.1 fails to dump any process holding a TCP socket on
# Linux >= 6.16 ("sockets: Can't get 1:16 opt", CRIU issue 2705, fixed in 4.2); older
# ones fail on kernels >= 6.13 ("vdso: Unexpected rt vDSO area bounds").
#
#   scripts/install-criu.sh            install (or find) CRIU, write the wrapper
#   scripts/install-criu.sh bundle DIR copy a self-contained CRIU (binary, ld.so,
#                                      libraries) into DIR, to carry to a GPU host
#
# Where CRIU comes from, first match wins:
#   1. a `criu` >= 4.2 already on PATH (or in /usr/sbin);
#   2. apt offers criu >= 4.2: `apt-get install criu`;
#   3. otherwise (Debian 12 and 13; any apt system whose criu is older): Debian
#      forky's package and the libraries it needs, fetched by debootstrap into a
#      scratch root, then copied into a private prefix (.cache/criu/{sbin,lib})
#      and run through that prefix's own ld.so. CRIU is not run inside a chroot:
#      it must see the real /proc and mounts.
# The new prefix is built beside DEST and moved into place in one rename, so a
# CRIU in use (by tests, by another checkout sharing .cache) is never half-written.
set -eu

# Mirrors agent/checkpoint/criu_locate.py MIN_VERSION (tests/test_criu_locate.py checks).
MIN_VERSION=4.2
# The Debian suite whose criu is >= MIN_VERSION; debootstrap may not know it by name
# (Debian 12's does not), so its script is named: forky is built like sid.
SUITE=${PITSTOP_CRIU_SUITE:-forky}
SUITE_SCRIPT=/usr/share/debootstrap/scripts/sid
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${PITSTOP_CRIU_CACHE:-$ROOT/.cache/criu}
MIRROR=${PITSTOP_DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { echo "install-criu: $*" >&2; }
die() { say "error: $*"; exit 1; }

# criu_version BIN...: print "4.1.1" from `criu --version` ("Version: 4.1.1").
criu_version() {
    "$@" --version 2>/dev/null | sed -n 's/^Version: *\([0-9.]*\).*/\1/p' | head -n1
}

# version_ok V: whether V >= MIN_VERSION.
version_ok() {
    [ -n "$1" ] && [ "$(printf '%s\n%s\n' "$MIN_VERSION" "$1" | sort -V | head -n1)" = "$MIN_VERSION" ]
}

# write_wrapper DIR BODY: DIR/bin/criu, written atomically.
write_wrapper() {
    mkdir -p "$1/bin"
    {
        echo '#!/bin/sh'
        echo "# Written by scripts/install-criu.sh; runs CRIU >= $MIN_VERSION for Pitstop."
        echo "$2"
    } > "$1/bin/criu.tmp"
    chmod 0755 "$1/bin/criu.tmp"
    mv -f "$1/bin/criu.tmp" "$1/bin/criu"
}

# The wrapper of a private prefix: the prefix's ld.so loads the prefix's libraries.
PREFIX_WRAPPER='here=$(cd "$(dirname "$0")/.." && pwd)
exec "$here/lib/ld-linux-x86-64.so.2" --library-path "$here/lib" "$here/sbin/criu" "$@"'

# copy_closure BIN LDSO LIBPATH OUT: copy BIN, LDSO and every library LDSO lists
# for BIN into OUT/{sbin,lib}. `ld.so --list` is used rather than ldd so that a
# Debian 13 binary can be listed on Debian 12 (ldd would use the host's loader).
copy_closure() {
    bin=$1 ldso=$2 libpath=$3 out=$4
    mkdir -p "$out/sbin" "$out/lib"
    cp -L "$bin" "$out/sbin/criu"
    cp -L "$ldso" "$out/lib/ld-linux-x86-64.so.2"
    if [ -n "$libpath" ]; then
        list=$("$ldso" --library-path "$libpath" --list "$bin")
    else
        list=$("$ldso" --list "$bin")
    fi
    echo "$list" | grep -q 'not found' && die "libraries missing for $bin: $list"
    echo "$list" | sed -n 's/.*=> \(\/[^ ]*\) (0x.*/\1/p' | while read -r lib; do
        cp -L "$lib" "$out/lib/"
    done
}

wrapper_ok() {
    [ -x "$DEST/bin/criu" ] && version_ok "$(criu_version "$DEST/bin/criu")"
}

from_path() {
    for c in "$(command -v criu 2>/dev/null || true)" /usr/sbin/criu /usr/local/sbin/criu; do
        [ -n "$c" ] && [ -x "$c" ] || continue
        [ "$c" = "$DEST/bin/criu" ] && continue
        if version_ok "$(criu_version "$c")"; then
            say "using $c ($(criu_version "$c"))"
            write_wrapper "$DEST" "exec $c \"\$@\""
            return 0
        fi
    done
    return 1
}

apt_ready=
apt_update() {
    [ -n "$apt_ready" ] && return 0
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt_ready=1
}

# apt_candidate PKG: the upstream version apt would install ("4.1.1"), or "".
apt_candidate() {
    apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p' |
        sed 's/^[0-9]*://; s/[-+~].*//; s/^(none)$//'
}

from_apt() {
    say "apt-get install criu ($1)"
    apt-get install -y -q criu >/dev/null
    v=$(criu_version /usr/sbin/criu)
    version_ok "$v" || die "the distribution's criu is $v, Pitstop needs >= $MIN_VERSION"
    write_wrapper "$DEST" 'exec /usr/sbin/criu "$@"'
}

# drop_scratch DIR: remove the scratch root; unmount first anything debootstrap
# left mounted in it (proc, sys) so that rm never walks into the host's /proc.
drop_scratch() {
    awk -v d="$1" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m" || true; done
    rm -rf --one-file-system "$1"
}

# from_debian: build the private prefix from Debian $SUITE in a staging folder beside
# DEST, then swap it in with renames (the old prefix stays whole until the swap).
from_debian() {
    if ! command -v debootstrap >/dev/null 2>&1; then
        say "apt-get install debootstrap"
        apt-get install -y -q debootstrap >/dev/null
    fi
    # Debian's archive key (on Ubuntu, a separate package) verifies what is fetched.
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    if [ ! -f "$keyring" ]; then
        say "apt-get install debian-archive-keyring"
        apt-get install -y -q debian-archive-keyring >/dev/null
    fi
    script=
    [ -e "/usr/share/debootstrap/scripts/$SUITE" ] || script=$SUITE_SCRIPT
    stage="$DEST.new.$$"
    scratch="$stage/.rootfs"
    rm -rf "$stage"
    mkdir -p "$stage"
    trap 'drop_scratch "$scratch"; rm -rf "$stage"' EXIT
    say "debootstrap $SUITE + criu into $scratch (1-3 minutes; touches nothing outside it)"
    # minbase resolves criu's library closure for us; the root is thrown away below.
    # shellcheck disable=SC2086
    if ! debootstrap --keyring="$keyring" --variant=minbase --include=criu "$SUITE" \
        "$scratch" "$MIRROR" $script \
        >"$stage/debootstrap.log" 2>&1; then
        tail -n 20 "$stage/debootstrap.log" >&2
        cp "$stage/debootstrap.log" "$DEST.debootstrap.log" 2>/dev/null || true
        die "debootstrap failed; the log is $DEST.debootstrap.log"
    fi
    multi="$scratch/usr/lib/x86_64-linux-gnu"
    copy_closure "$scratch/usr/sbin/criu" "$multi/ld-linux-x86-64.so.2" \
        "$multi:$scratch/lib/x86_64-linux-gnu" "$stage"
    drop_scratch "$scratch"
    write_wrapper "$stage" "$PREFIX_WRAPPER"
    v=$(criu_version "$stage/bin/criu")
    version_ok "$v" || die "the private CRIU reports version '$v'; see $stage"
    swap "$stage"
    trap - EXIT
    say "CRIU $v in $DEST"
}

# swap STAGE: STAGE becomes DEST. Two renames: a reader sees the old prefix or the new
# one, and only between the renames no prefix (a missing file, never a mixed one).
swap() {
    old="$DEST.old.$$"
    if [ -e "$DEST" ]; then
        mv "$DEST" "$old"
    fi
    mv "$1" "$DEST"
    rm -rf "$old"
}

install() {
    if wrapper_ok; then
        return 0
    fi
    mkdir -p "$(dirname "$DEST")"
    if from_path; then
        return 0
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "no CRIU >= $MIN_VERSION and no apt-get here; install CRIU >= $MIN_VERSION and put it on PATH"
    # A distribution whose criu is new enough: its own. Otherwise (Debian 12 and 13,
    # Ubuntu 24.04: all older than 4.2 in 2026): Debian forky's, in a private prefix.
    apt_update
    candidate=$(apt_candidate criu)
    if version_ok "$candidate"; then
        from_apt "$candidate"
    else
        say "apt offers criu '${candidate:-none}' (< $MIN_VERSION): using Debian $SUITE's in a private prefix"
        from_debian
    fi
    wrapper_ok || die "$DEST/bin/criu does not run or is older than $MIN_VERSION"
}

# bundle OUT: a folder that runs on any x86-64 Linux with no CRIU installed.
bundle() {
    out=$1
    install
    real=$DEST/sbin/criu
    rm -rf "$out.tmp"
    if [ -x "$real" ]; then
        mkdir -p "$out.tmp"
        cp -a "$DEST/sbin" "$DEST/lib" "$out.tmp/"
    else
        bin=$(sed -n 's/^exec \([^ ]*\) .*/\1/p' "$DEST/bin/criu")
        copy_closure "$bin" /lib64/ld-linux-x86-64.so.2 "" "$out.tmp"
    fi
    write_wrapper "$out.tmp" "$PREFIX_WRAPPER"
    rm -rf "$out"
    mv "$out.tmp" "$out"
    say "bundle in $out ($(du -sh "$out" | cut -f1)); run $out/bin/criu"
}

case "${1:-install}" in
    install) install ;;
    bundle) [ $# -eq 2 ] || die "usage: $0 bundle DIR"; bundle "$2" ;;
    *) die "usage: $0 [install | bundle DIR]" ;;
esac
