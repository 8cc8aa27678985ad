#!/usr/bin/env bash
# Install promtool and the Prometheus server from Debian's `prometheus` package, once.
# The rule tests and the alert test need both; a stamp under .cache/ keeps reruns instant.
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=.cache/prometheus.stamp
mkdir -p .cache

if [ -f "$STAMP" ] && command -v promtool >/dev/null && [ -x /usr/bin/prometheus ]; then
    exit 0
fi

if ! command -v promtool >/dev/null || [ ! -x /usr/bin/prometheus ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-prometheus: need root to apt-get install prometheus" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # An apt list older than a day may name a package version the mirror no longer has.
    if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null)" ]; then
        apt-get update -q
    fi
    # --no-install-recommends: the exporters it recommends are not needed by any test.
    apt-get install -y -q --no-install-recommends prometheus
    # The package enables a system-wide Prometheus on :9090; tests start their own, so
    # stop the packaged one where systemd runs it (a container without systemd has none).
    if command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1; then
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
fi

promtool --version | head -1
touch "$STAMP"
