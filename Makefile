# Two commands matter: `make serve` (the example app on SQLite, no cloud account) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# `make serve` gets an environment of its own with only what it runs (`.[serve]`: SQLite + the ops API)
SERVE_VENV ?= .venv-serve
PORT   ?= 8080
SUM    := $(shell cksum pyproject.toml | cut -d' ' -f1)
STAMP  := $(VENV)/.installed-$(SUM)
SERVE_STAMP := $(SERVE_VENV)/.installed-$(SUM)
NODE   := node_modules/.installed-$(shell cksum package-lock.json | cut -d' ' -f1)
CHECKOV := .checkov-venv/bin/checkov
CHROMIUM := /usr/bin/chromium
NEED_PYTHON := $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python 3.11+ is needed"; exit 1; }

.PHONY: serve serve-env test lint install local-storage checkov docs

# everything: the kit editable with `.[dev]` (every transport, the test and docs tools)
$(STAMP): pyproject.toml
	@$(NEED_PYTHON)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# installed as a user installs it (not editable): any change to the kit's sources installs it again
$(SERVE_STAMP): pyproject.toml $(shell find queueing_core -name '*.py')
	@$(NEED_PYTHON)
	test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --disable-pip-version-check '.[serve]'
	rm -f $(SERVE_VENV)/.installed-* && touch $@

# Azurite, the local Azure Storage emulator the Storage Queues and Tables tests run against
$(NODE): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	rm -f node_modules/.installed-* && touch $@

# the browser the dashboard's tests drive (Debian's chromium, through Playwright)
$(CHROMIUM):
	scripts/chromium.sh

# checkov lives in its own virtual environment (it pins an old pycep-parser and boto3)
$(CHECKOV):
	scripts/checkov.sh

install: $(STAMP) $(NODE)

# the example app and the ops API on SQLite (./queueing.db): `make serve PORT=9000` for another port
serve: serve-env
	$(SERVE_VENV)/bin/queueing serve --port $(PORT)

# only the environment `make serve` runs in
serve-env: $(SERVE_STAMP)

# the example app on Storage Queues over a local Azurite, end to end (same PORT setting)
local-storage: $(STAMP) $(NODE)
	scripts/local-storage.sh --port $(PORT)

checkov: $(CHECKOV)
	scripts/checkov.sh

lint: $(STAMP)
	$(BIN)/ruff check queueing_core functions tests bench infra/checks scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

# the documentation site, into site/; --strict turns every warning (a broken link included) into a failure
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The tests run in TEST_JOBS processes (pytest-xdist; 3 on 2 cores: most of a test's time is waiting on a
# service or a subprocess), then the `disruptive` ones, which stop or restart the shared PostgreSQL or
# RabbitMQ, alone after them (DISRUPTIVE=0 leaves them out; TEST_JOBS=0 runs the first phase in pytest's
# own process, for -s or --pdb). MARKS narrows both by marker (`MARKS=slow`;
# a -m in PYTEST_ARGS would replace a phase's own selection). pytest exits 5 when a selection collects
# nothing (e.g. `make test PYTEST_ARGS="-k nothing"`, or a part with no disruptive test): not a failure
TEST_JOBS ?= 3
DISRUPTIVE ?= 1
MARKS ?=
AND_MARKS = $(if $(MARKS), and ($(MARKS)))
test: lint docs $(NODE) $(CHECKOV) $(CHROMIUM)
	$(BIN)/python -m pytest -n $(TEST_JOBS) -m "not disruptive$(AND_MARKS)" $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; \
	if [ "$(DISRUPTIVE)" != 0 ]; then \
		$(BIN)/python -m pytest -m "disruptive$(AND_MARKS)" $(PYTEST_ARGS); \
		rc2=$$?; if [ $$rc2 -ne 0 ] && [ $$rc2 -ne 5 ] && [ $$rc -eq 0 ]; then rc=$$rc2; fi; \
	fi; exit $$rc
