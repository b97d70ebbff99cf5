#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from the source vendored in PyPI's llama-cpp-python sdist
# (pinned below) into a cache directory outside the work tree, and reuses it when present.
# Only the server target: no web UI download (LLAMA_USE_PREBUILT_UI=OFF), static libs, no
# tests or examples. About 9 minutes on 2 cores the first time; seconds afterwards.
#
#   devtools/build-llama-server.sh            prints the binary's path on its last line
#   LLAMA_SERVER_CACHE=DIR devtools/build-llama-server.sh
set -euo pipefail
VERSION=0.3.36
CACHE=${LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/priority-gate/llama-server-$VERSION}
BIN=$CACHE/bin/llama-server
PYTHON=${PYTHON:-python3}
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
cmake -S "$src" -B "$work/build" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
    >"$work/configure.log" 2>&1 || { tail -40 "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -60 "$work/build.log" >&2; exit 1; }
mkdir -p "$CACHE/bin"
install -m 0755 "$work/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2 || true
echo "$BIN"
