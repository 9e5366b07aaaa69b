# Two front-door commands; each creates .venv and installs what is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-all demo bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

run: $(STAMP)  ## short data-parallel training run on 8 emulated CPU devices
	$(PY) -m experiments.train --workdir=$${WORKDIR:-runs/default}

test: $(STAMP)  ## the default test suite (what CI runs)
	$(PY) -m pytest -n 2 -q

test-all: $(STAMP)  ## also the tests marked slow
	$(PY) -m pytest -n 2 -q -m ""

demo: $(STAMP)  ## check, time and analyse every all_reduce algorithm
	$(PY) -m experiments.demo_collectives

bench: $(STAMP)  ## nccl-tests-style sweep of every all_reduce algorithm
	$(PY) -m experiments.bench_collectives --collective=all_reduce --algorithms=all

lint: $(STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	$(VENV)/bin/ruff check jaxcoll experiments tests configs

clean:
	rm -rf $(VENV) runs
