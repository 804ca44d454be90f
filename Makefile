# Everything a fresh machine needs, in order. `make demo` and `make test` install first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test test-fast lint bench render clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(PY) $(VENV)
	touch $(STAMP)

demo: install
	$(BIN)/rayscale demo

# Two pytest sessions: the e2e controller tests drive their own cluster of `ray start` nodes, while the
# rest share one in-process Ray cluster and one vLLM engine (a process joins one Ray cluster at a time).
# In each, one worker runs every test of the shared cluster and the other the rest beside it: in the first the
# files that need no cluster, in the second test_from_config on a cluster of its own (tests/conftest.py).
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15 --ignore=tests/e2e
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15 tests/e2e

lint: install
	$(BIN)/ruff check rayscale tests bench testing
	$(BIN)/mypy testing/rayscale_testing
	$(BIN)/mypy

render: install
	$(BIN)/rayscale render --out .

bench: install
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
