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

# Side-by-side benchmarks (minutes; run on a quiet machine). They print markdown; RESULTS.md records them.
bench: setup
	$(BIN)/python benchmarks/bsp_throughput.py --rounds 3
	$(BIN)/python benchmarks/ps_cost.py --reps 100 --rounds 1 --workers 3 --epochs 4

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
