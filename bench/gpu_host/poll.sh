#!/bin/bash
# poll.sh SECS: waits until the steps end or SECS pass, prints the progress and each log's
# last lines, and packs $R (without images or weights) into $OUT/res.tgz for the call to
# bring back. Keep calls back to back: the host is given back after 30 s without one.
R=${R:-/root/res}
end=$(( $(date +%s) + ${1:-300} ))
while [ "$(date +%s)" -lt "$end" ] && ! [ -e "$R/DONE" ]; do sleep 5; done
tail -n 20 "$R/progress.log" 2>/dev/null
for f in "$R"/*.log; do
  [ "$f" = "$R/progress.log" ] || { echo "== $f"; tail -n 3 "$f"; }
done 2>/dev/null | tail -n 40
mkdir -p "$OUT" && tar -C "$(dirname "$R")" -czf "$OUT/res.tgz" --exclude='*.img' \
  --exclude='*.safetensors' "$(basename "$R")"
