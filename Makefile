# Set-up and entry points. Every target creates the virtual environment if it is missing.
# torch is installed first, pinned, so that pip does not pick another build for cf_ray's `torch>=2.13`.
# On a machine without a GPU, take the CPU build (about 190 MB against several GB for the CUDA one
# that the public index serves): TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make test
# (the URL is given to pip as --index-url for the torch step only; unset, pip uses its own indexes).
# EXTRAS names the optional dependency groups installed with cf_ray: `dali` (NVIDIA DALI, about 1 GB)
# is there because the default suite runs DALI on the CPU (tests/data/test_dali_iterator.py skips
# without it); `make test EXTRAS=test,notebooks,plot,lint,docs` leaves it out.

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
TORCH_INDEX_URL ?=
EXTRAS  ?= test,notebooks,plot,dali,lint,docs
PYTEST_ARGS ?=

.PHONY: demo test test-all test-promises test-fast lint format docs docs-serve bench bench-quick clean

$(VENV)/.installed: pyproject.toml Makefile
	@echo "set-up 1/4: creating the virtual environment $(VENV) with $(PYTHON)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "set-up 2/4: upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "set-up 3/4: installing $(TORCH) from $(or $(TORCH_INDEX_URL),pip's configured index (no GPU here? TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the 190 MB CPU build instead of the CUDA one))"
	@$(PY) -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(TORCH)
	@echo "set-up 4/4: installing cf_ray (editable), Ray 2.60, pyarrow and the extras [$(EXTRAS)]$(if $(findstring dali,$(EXTRAS)), (NVIDIA DALI among them: about 1 GB))"
	@$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	@$(PY) -c "import torch, ray; print(f'set-up done: torch {torch.__version__}, ray {ray.__version__}')"
	@touch $@

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

# The real runs that prove the README's promises beyond `make test`'s one run of each (marker
# `promise`: tests/conftest.py NIGHTLY less its benchmark jobs): the fault matrix, node loss restored
# from a peer, the HF and Lightning SIGKILL runs, StatefulDataLoader and Ray Data across a failure and
# a resize, the notebook, SIGTERM. -v names each test as it ends (a run stopped part-way still says
# which passed); the benchmark jobs are left to test-all.
test-promises: $(VENV)/.installed    ## the nightly runs that prove the README's promises, no benchmark job
	@$(PY) -m pytest -v --durations=0 -m promise $(PYTEST_ARGS); rc=$$?; \
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
