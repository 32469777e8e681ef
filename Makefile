# Every target creates/refreshes the virtualenv first: a fresh clone needs only Python 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# one distribution per library and service, each with its own pyproject.toml (docs/layout.md)
DISTRIBUTIONS := proto libs/hashing libs/chat libs/ledger libs/telemetry libs/edge libs/registry \
	services/ingest services/index services/gateway tools

.PHONY: venv test lint typecheck unit up proto proto-check bench clean

venv: $(STAMP)

# the ledger's compiled core is built by its (editable) install: a changed C source reinstalls
$(STAMP): $(addsuffix /pyproject.toml,$(DISTRIBUTIONS)) libs/ledger/setup.py libs/ledger/cortex/ledger/_core.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# compat mode: each distribution's source root goes on sys.path, so the cortex.* namespace
	# spans them all and a new module needs no reinstall (a new entry point does)
	$(BIN)/python -m pip install -q $(addprefix -e ,$(filter-out tools,$(DISTRIBUTIONS))) -e 'tools[dev]' \
		--config-settings editable_mode=compat
	# xds-protos (Envoy's messages, the endpoint picker) ships an older copy of the files of
	# opentelemetry-proto (tracing); whichever installs last wins: put the latter's back
	$(BIN)/python -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .

TYPED_PACKAGES := cortex.hashing cortex.chat cortex.ledger cortex.telemetry cortex.edge cortex.ingest cortex.registry cortex.index cortex.gateway cortex.sim cortex.cli cortex.bench cortex.testing

typecheck: venv
	$(BIN)/mypy $(addprefix -p ,$(TYPED_PACKAGES))

unit: venv
	$(BIN)/pytest

## The README's test command: lint, types, generated-code drift, the whole suite.
test: venv lint typecheck proto-check
	$(BIN)/pytest

## The README's dev-cluster command.
up: venv
	$(BIN)/cortex up $(ARGS)

proto: venv
	$(BIN)/python tools/gen_proto.py

proto-check: venv
	$(BIN)/python tools/gen_proto.py --check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
