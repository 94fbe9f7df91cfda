# Set-up and entry points. Every target creates the virtual environment if it is missing.
# torch is installed first, pinned, so that no multi-GB CUDA build is pulled in on CPU machines.

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-all test-fast lint format docs docs-serve bench bench-quick clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,notebooks,plot,dali,lint,docs]'
	touch $@

# Bytecode of the source tree's packages, written if missing or stale (benchmarks/bytecode.py: the
# editable install's modules are otherwise compiled again in every Ray process where
# PYTHONDONTWRITEBYTECODE is set).
BYTECODE := $(PY) -m benchmarks.bytecode

demo: $(VENV)/.installed    ## the main job: TorchTrainer on a local Ray cluster, a worker SIGKILLed part-way
	@$(BYTECODE)
	$(VENV)/bin/cf-ray demo

# The suite, slow end-to-end tests included, heavy benchmark jobs (marker `nightly`) left out.
# pytest's exit code 5 means "no test ran": it is reported, not hidden, and does not fail the
# target on its own.
test: $(VENV)/.installed
	@$(PY) -m pytest -q --durations=40 -m "not nightly" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; exit 0; fi; exit $$rc

test-all: $(VENV)/.installed    ## everything, the nightly benchmark jobs included
	@$(PY) -m pytest -q --durations=40 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; exit 0; fi; exit $$rc

test-fast: $(VENV)/.installed    ## everything but the slow end-to-end runs and the nightly jobs
	$(PY) -m pytest -q -m "not slow and not nightly" $(PYTEST_ARGS)

lint: $(VENV)/.installed    ## ruff (lint + format check) over the repo, pyright (basic) over cf_ray/
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

docs: $(VENV)/.installed    ## the documentation site into site/, warnings as errors (mkdocs.yml)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(VENV)/.installed    ## the same, served with live reload on http://127.0.0.1:8000
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-quick: $(VENV)/.installed
	@$(BYTECODE)
	$(VENV)/bin/cf-ray bench --quick

bench: $(VENV)/.installed
	@$(BYTECODE)
	$(VENV)/bin/cf-ray bench

clean:
	rm -rf $(VENV) cf_ray_runs .pytest_cache site
