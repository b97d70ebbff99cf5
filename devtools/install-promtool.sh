#!/usr/bin/env bash
# Installs promtool, which tests/test_alerts.py runs on the alert rules, unless one is already
# on PATH (then it only prints its path). Safe to run again.
#
# From Debian's (or Ubuntu's) `prometheus` package: only its promtool binary is unpacked into
# PROMTOOL_DIR (default /usr/local/bin), so no Prometheus server is installed, enabled or
# started. Needs root (apt-get); elsewhere install promtool from prometheus.io/download.
#
#   devtools/install-promtool.sh            prints promtool's path on its last line
#   PROMTOOL_DIR=DIR devtools/install-promtool.sh
set -euo pipefail
DIR=${PROMTOOL_DIR:-/usr/local/bin}

if command -v promtool >/dev/null 2>&1; then
    command -v promtool
    exit 0
fi
if [ -x "$DIR/promtool" ] && "$DIR/promtool" --version >/dev/null 2>&1; then
    echo "$DIR/promtool"  # installed, but DIR is not on PATH: tests look there too (PROMTOOL)
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-promtool: no apt-get; install promtool from https://prometheus.io/download/" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-promtool: apt-get needs root; run as root or install promtool yourself" >&2
    exit 1
fi
if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    apt-get update -qq
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq -o APT::Sandbox::User=root prometheus)
dpkg-deb --fsys-tarfile "$work"/prometheus_*.deb | tar -x -C "$work" ./usr/bin/promtool
mkdir -p "$DIR"
install -m 0755 "$work/usr/bin/promtool" "$DIR/promtool"
"$DIR/promtool" --version >/dev/null
echo "$DIR/promtool"
