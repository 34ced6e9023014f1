# Setup and entry points. Every target creates its own virtual environment (.venv) first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup run test test-slow parity-tests bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

setup: $(STAMP)

## the main job on its built-in default: oracle vs llama.cpp on the default model and prompts
run: setup
	$(VENV)/bin/harness parity

## the test suite (what CI runs)
test: setup
	$(PY) -m pytest -q

## slow tests kept out of the default run
test-slow: setup
	$(PY) -m pytest -q -m slow

parity-tests: setup
	$(PY) -m pytest -q -m parity

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
