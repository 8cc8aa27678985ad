#!/usr/bin/env bash
# Make (once) a Debian rootfs that boots under systemd-nspawn: the real systemd the tests drive.
#
#   scripts/make-rootfs.sh SUITE [DEST] [EXTRA_PACKAGES]
#
# SUITE is a Debian suite (bookworm, trixie); DEST defaults to .cache/rootfs/SUITE; EXTRA_PACKAGES
# is a comma-separated list added to the base set (the Ansible tests add python3, for example).
# The tree is built in a temporary directory beside DEST and renamed into place only when
# complete, with a stamp naming the suite and the package list: a half-made tree is never used,
# and a changed package list makes a fresh one. Installs debootstrap and systemd-nspawn (package
# systemd-container) when they are missing. Needs root.
set -euo pipefail

suite=${1:?usage: make-rootfs.sh SUITE [DEST] [EXTRA_PACKAGES]}
dest=${2:-.cache/rootfs/$suite}
extra=${3:-}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

# systemd as PID 1 with D-Bus (systemctl needs it); procps for /bin/kill (ExecReload) and ps;
# the shared libraries that the host's Python (bind-mounted from the host, not installed here)
# loads for ssl, ctypes, sqlite3, bz2, lzma, readline, uuid and curses.
base=systemd,systemd-sysv,dbus,procps,iproute2,ca-certificates
# python3: the interpreter Ansible's modules run on when the Ansible tests use these trees as
# hosts (the agent itself runs on the host's Python, bind-mounted).
base+=,python3
base+=,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libncursesw6,libuuid1,libexpat1,libnsl2
base+=,libcrypt1
case $suite in
    # Debian 13 renamed these for the 64-bit time_t transition; the sonames stayed.
    bookworm) base+=,libssl3,libreadline8,libtirpc3 ;;
    *) base+=,libssl3t64,libreadline8t64,libtirpc3t64 ;;
esac
packages=$base${extra:+,$extra}
want="suite=$suite packages=$packages"

stamp=$dest/.pitstop-rootfs
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "make-rootfs.sh: debootstrap and systemd-nspawn need root; run as root" >&2
    exit 1
fi

missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
if ((${#missing[@]})); then
    echo "make-rootfs.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$(dirname "$dest")"
tmp=$(mktemp -d "$dest.tmp.XXXXXX")
trap 'rm -rf --one-file-system "$tmp"' EXIT

start=$SECONDS
echo "make-rootfs.sh: debootstrap $suite into $dest (about a minute, once)" >&2
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$tmp" "$mirror" \
        >"$tmp.log" 2>&1; then
    tail -n 30 "$tmp.log" >&2
    echo "make-rootfs.sh: debootstrap failed; full log in $tmp.log" >&2
    exit 1
fi
rm -f "$tmp.log"

# A booted container needs no login prompt, no network set-up by itself (it runs with
# loopback only) and no periodic jobs that compete for the 2 CPUs while tests run.
for unit in console-getty.service getty@.service systemd-networkd.service \
        systemd-resolved.service apt-daily.timer apt-daily-upgrade.timer \
        e2scrub_all.timer fstrim.timer systemd-tmpfiles-clean.timer; do
    ln -sf /dev/null "$tmp/etc/systemd/system/$unit"
done
echo pitstop-test >"$tmp/etc/hostname"
# An empty machine-id makes systemd generate a fresh one at every boot (the overlay is thrown
# away afterwards), instead of every container sharing the one baked in here.
: >"$tmp/etc/machine-id"
rm -rf "$tmp/var/cache/apt/archives/"*.deb "$tmp/var/lib/apt/lists/"*

echo "$want" >"$tmp/.pitstop-rootfs"
rm -rf --one-file-system "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "make-rootfs.sh: $dest ready in $((SECONDS - start)) s" >&2
