# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test model bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/sluice fetch

serve: model
	$(BIN)/sluice serve --host 127.0.0.1 --port 8000

test: model
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/python bench/compare.py

clean:
	rm -rf $(VENV)
