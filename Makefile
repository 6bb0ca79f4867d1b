# The two commands a fresh machine needs: `make run` and `make test`. Both create .venv first; each
# installs what it needs (run: distrain; test: distrain with its dev extras), recorded in its own stamp.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(BIN)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(BIN)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(BIN)/.installed-dev

run: $(BIN)/.installed
	$(BIN)/distrain run

# The suite in two parts. First all but the `alone` tests on two pytest-xdist workers, each with its own
# session Ray, given a whole file at a time (a module's fixture runs once) in the collection order
# tests/conftest.py sets (slowest files first), not xdist's by test count: the second worker uses what one
# test leaves of the 2 cores (a test waits on Ray and actor start-up, paced steps, timeouts). Then the
# `alone` files (tests/conftest.py ALONE_FILES: they fail when another test competes for the cores) one
# test at a time. The second part runs even when the first failed; the target fails if either did.
PYTEST_WORKERS := -n 2 --dist loadfile --no-loadscope-reorder

test: $(BIN)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_WORKERS) -m "not alone"; parallel=$$?; \
	$(BIN)/python -m pytest -m alone && exit $$parallel

lint: $(BIN)/.installed-dev
	$(BIN)/ruff check .

# README.md's flag table, rewritten from `distrain run`'s help texts (tests/unit/test_flag_table.py checks it).
docs: $(BIN)/.installed
	$(BIN)/python -m distrain.flag_table

# Side-by-side benchmarks (minutes; run on a quiet machine). They print markdown; RESULTS.md records them.
bench: $(BIN)/.installed
	$(BIN)/python benchmarks/bsp_throughput.py --rounds 3
	$(BIN)/python benchmarks/ps_cost.py --reps 100 --rounds 1 --workers 3 --epochs 4

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
