#!/bin/sh
# Build (once per pyproject.toml) a wheelhouse: the pitstop wheel and every wheel it and its
# reference extra depend on (the test hosts run the reference engine), torch from this
# machine's local CPU wheel. The Ansible tests' hosts install from it
# with `pip install --no-index --find-links`, the way hosts without PyPI access would.
#   scripts/ansible-wheelhouse.sh DEST
set -eu
dest=$1
root=$(cd "$(dirname "$0")/.." && pwd)
want=$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-16)
[ -f "$dest/.stamp" ] && [ "$(cat "$dest/.stamp")" = "$want" ] && exit 0
python=${PYTHON:-python3}
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp"
# pip wheel builds the project and any sdist-only dependency into wheels; the hosts then
# need no compiler and no network.
"$python" -m pip wheel -q --wheel-dir "$dest.tmp" --find-links /opt/wheels \
    "torch==2.13.0" "$root[reference]"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "$want" > "$dest/.stamp"
echo "ansible-wheelhouse: $(ls "$dest" | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1))"
