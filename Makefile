# The two commands a fresh machine needs: `make run` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/distrain run

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/bsp_throughput.py --out benchmarks/RESULTS.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
