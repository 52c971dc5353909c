# Two commands matter: `make serve` (the example app on SQLite, no cloud account) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: serve test lint install local-storage

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python 3.11+ is needed"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/queueing serve

# the example app on Storage Queues over a local Azurite, end to end (SPEC E6)
local-storage: $(STAMP)
	scripts/local-storage.sh

lint: $(STAMP)
	$(BIN)/ruff check queueing_core functions examples tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

# pytest exits 5 when a selection collects nothing (e.g. `make test PYTEST_ARGS="-k nothing"`): not a failure
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc
