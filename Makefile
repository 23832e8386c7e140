# Quick start: `make demo` and `make test`. Both create .venv on first use and
# re-install only when pyproject.toml changed (the stamp file tracks it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Prometheus, Alertmanager and Chromium come from Debian packages (the real
# alert pipeline and the browser check). Installed when missing and apt exists;
# tests that need them skip with a loud reason otherwise.
system-deps:
	@bash .ci/system-deps.sh

demo: $(STAMP)
	$(BIN)/fleetmend demo

# The suite starts hundreds of Python processes (the simulator, workers, the CLI under test): each one
# loads fleetmend's modules from bytecode compiled once here instead of compiling them again, and
# pytest keeps the test modules it rewrote. So a PYTHONDONTWRITEBYTECODE in the caller's environment
# is lifted for the suite (a profile of the whole suite found 8 % of its CPU compiling and rewriting).
PACKAGES := activities fleet gateway kube ledger sim worker workflows tests bench
BYTECODE := $(BIN)/python -m compileall -q -j 0 $(PACKAGES) && env -u PYTHONDONTWRITEBYTECODE

# Tests marked ``alone`` (the peak-load demo, which grades fleetmend's pace) run after the parallel run,
# in one process with nothing beside them. Both runs always run; either failing fails the target.
test: $(STAMP) system-deps
	$(BYTECODE) $(BIN)/python -m pytest -q -ra --durations=30 -n 5 --dist loadfile -m "not alone"; \
	parallel=$$?; \
	$(BYTECODE) $(BIN)/python -m pytest -q -ra -m alone; \
	alone=$$?; \
	test $$parallel -eq 0 && test $$alone -eq 0

# The tests that need no Temporal server, Envoy or fleetmend worker (``quick``: QUICK_PATHS in
# tests/conftest.py): the domain, the ledger, the simulator, configuration. About a minute on 2 cores.
test-fast: $(STAMP)
	$(BYTECODE) $(BIN)/python -m pytest -q -ra -m quick -n 4 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .fleetmend .pytest_cache .mypy_cache .ruff_cache
