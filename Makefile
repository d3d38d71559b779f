# The two commands: `make test` and `make demo`. Each bootstraps what it needs:
# a virtual environment, the patched llama-cpp-python wheel (built once, then taken
# from ~/.cache/noderuntime), the project with its test and Transformers dependencies, the demo model.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.bootstrapped
# pytest-xdist workers, each pinned to its share of the cores (tests/conftest.py): while one
# worker's test waits on a deadline, a process start or an import, the other computes
PYTEST_WORKERS ?= 2
# each run ends with where its time went: the suite's budget is 12 minutes on 2 cores
PYTEST_ARGS ?= --durations=25
# `test` compiles the project's modules first: the suite starts a few hundred Python processes,
# and where PYTHONDONTWRITEBYTECODE is set (as in some CI images) none writes its bytecode,
# so each of them compiled every module it imported again; compileall writes it whatever that
# variable says, and every process reads it. pytest runs without that variable: with it, each
# worker parsed and rewrote every test module's asserts again at every run (4-5 CPU-seconds
# a worker), where pytest otherwise keeps them rewritten beside the bytecode

.PHONY: test demo bootstrap lint clean

test: $(STAMP)
	$(PY) -m compileall -q -j 0 noderuntime protocol relay benchmarks
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m noderuntime demo

bootstrap: $(STAMP)

$(STAMP): pyproject.toml kernels_patch/build.py $(wildcard kernels_patch/patches/*.patch)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) kernels_patch/build.py --python $(PY) --install
	$(PY) -m pip install --quiet -e '.[engine,test,transformers]'
	$(PY) -m noderuntime models pull
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
