#!/usr/bin/env bash
# Installs Chromium, which tests/test_status_browser.py runs headless on the status page (a
# screenshot and the rendered DOM), unless one is already on PATH (then it only prints its
# path). Safe to run again.
#
# From Debian's (or Ubuntu's) `chromium` package. Needs root (apt-get); elsewhere install
# Chromium yourself and put it on PATH, or point CHROMIUM at it.
#
#   devtools/install-chromium.sh            prints chromium's path on its last line
set -euo pipefail

for name in "${CHROMIUM:-}" chromium chromium-browser; do
    if [ -n "$name" ] && command -v "$name" >/dev/null 2>&1; then
        command -v "$name"
        exit 0
    fi
done
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: no apt-get; install Chromium and put it on PATH (or set CHROMIUM)" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-chromium: apt-get needs root; run as root or install Chromium yourself" >&2
    exit 1
fi
if ! apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
chromium --version >/dev/null
command -v chromium
