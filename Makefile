# Two commands matter: `make serve` (the example app on SQLite, no cloud account) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
NODE   := node_modules/.installed-$(shell cksum package-lock.json | cut -d' ' -f1)
CHECKOV := .checkov-venv/bin/checkov

.PHONY: serve test lint install local-storage checkov

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python 3.11+ is needed"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# Azurite, the local Azure Storage emulator the Storage Queues and Tables tests run against
$(NODE): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	rm -f node_modules/.installed-* && touch $@

# checkov lives in its own virtual environment (it pins an old pycep-parser and boto3)
$(CHECKOV):
	scripts/checkov.sh

install: $(STAMP) $(NODE)

serve: $(STAMP)
	$(BIN)/queueing serve

# the example app on Storage Queues over a local Azurite, end to end (SPEC E6)
local-storage: $(STAMP) $(NODE)
	scripts/local-storage.sh

checkov: $(CHECKOV)
	scripts/checkov.sh

lint: $(STAMP)
	$(BIN)/ruff check queueing_core functions examples tests bench infra/checks
	$(BIN)/mypy
	$(BIN)/lint-imports

# pytest exits 5 when a selection collects nothing (e.g. `make test PYTEST_ARGS="-k nothing"`): not a failure
test: lint $(NODE) $(CHECKOV)
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc
