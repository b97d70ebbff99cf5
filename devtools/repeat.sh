#!/usr/bin/env bash
# The repetition series: the suite again and again on a loaded machine, to find the tests
# that fail only sometimes. Two busy loops at nice 19 load both cores throughout. Each
# round runs `make test`, the external tier once more (Envoy, valkey-server and engine
# processes; two workers) and the llama tier; then REPEAT_EXTERNAL more external passes.
# One line per pass (exit code, seconds, load, pytest's summary, the failed tests) goes to
# .repeat/log; each pass's whole output to .repeat/<pass>.out.
#   REPEAT_ROUNDS (3), REPEAT_EXTERNAL (4)
set -u
cd "$(dirname "$0")/.."
dir=.repeat
mkdir -p "$dir"
log=$dir/log
: > "$log"
hogs=()
for _ in 1 2; do nice -n 19 python3 -c 'while True: pass' & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
ENVOY_BIN=$(pwd)/.venv-envoy/bin/envoy
LLAMA_SERVER_BIN=$(devtools/build-llama-server.sh | tail -n 1)
export ENVOY_BIN LLAMA_SERVER_BIN
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider -rfE)

pass() {  # name, command...
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    "$@" > "$dir/$name.out" 2>&1
    rc=$?
    echo "$(date -u +%H:%M:%S) $name rc=$rc $(($(date +%s) - t0))s" \
         "load=$(cut -d' ' -f1-3 /proc/loadavg) ::" \
         "$(grep -E '[0-9]+ (passed|failed)' "$dir/$name.out" | tail -n 1)" >> "$log"
    grep -E '^(FAILED|ERROR) ' "$dir/$name.out" >> "$log"
}

echo "series at $(git log --oneline -1)" >> "$log"
for i in $(seq 1 "${REPEAT_ROUNDS:-3}"); do
    pass "make-test-$i" make test
    pass "external-$i" "${pytest[@]}" -n 2 -m 'external and not llama'
    pass "llama-$i" "${pytest[@]}" -m llama
done
for i in $(seq 1 "${REPEAT_EXTERNAL:-4}"); do
    pass "external-more-$i" "${pytest[@]}" -n 2 -m 'external and not llama'
done
echo "series done: $(grep -c ' rc=0 ' "$log") of $(grep -c ' rc=' "$log") passes exited 0" >> "$log"
