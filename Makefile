# Two commands do all set-up on a fresh machine:
#   make demo   -- venv + install + the tiny end-to-end pipeline on CPU
#   make test   -- venv + install + the CPU test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= /tmp/dice_jax_demo

.PHONY: setup demo test lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel of torch (a plain `torch` would pull a multi-GB CUDA build).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python -m experiments.demo --workdir=$(DEMO_DIR)

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
