# Two commands do all set-up on a fresh machine:
#   make demo   -- venv + install + the tiny end-to-end pipeline on CPU, SFT then BiC-RL with real
#                  verdicts and updates, eval, HF export (~4-7 min on 2 cores)
#   make test   -- venv + install + the CPU test suite
# and one runs BiC-RL long enough to watch the correct fraction climb:
#   make signal -- venv + install + experiments/rl_signal.py in full: SFT then 30 BiC-RL steps
#                  against the real CPU verifier (about 1-2 h on a 2-core VM; plot in SIGNAL_DIR)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= /tmp/dice_jax_demo
SIGNAL_DIR ?= /tmp/dice_jax_signal
# Test processes: three where there is memory for them, also on two cores, where the tests wait on the
# subprocesses and services they start for a fifth of their time (CI VM, 2 cores, 24 GB, 2026-12-08:
# 39 min 40 s of tests with two workers; 25 min 20 s and 30 min 54 s with three and the slowest files
# first, as the VM's speed varied; 15.9 GB used at the peak, when the TPU compile files run side by side).
TEST_WORKERS ?= $(shell awk '/MemTotal/ {print ($$2 >= 20 * 1048576) ? 3 : 2}' /proc/meminfo)

.PHONY: setup demo signal test lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU wheel of torch (a plain `torch` would pull a multi-GB CUDA build).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# libtpu for the TPU compile tests only: installed, it makes every JAX start without JAX_PLATFORMS
# probe for a TPU (~2 s and libtpu's warnings on stderr), so the demo's venv does not get it.
$(BIN)/.tpu-compile: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e '.[test,tpu-compile]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python -m experiments.demo --workdir=$(DEMO_DIR)

# The run behind docs/rl_signal.png (docs/performance.md, "A real learning signal on CPU"):
# 300 SFT steps, then 30 RL steps; the new plot goes to $(SIGNAL_DIR)/rl_signal.png.
signal: setup
	$(BIN)/python -m experiments.rl_signal --workdir=$(SIGNAL_DIR) --sft_steps=300 --rl_steps=30

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: lint $(BIN)/.tpu-compile
	# one test file per worker at a time (module fixtures such as a warmed verifier stay shared), the
	# slowest files first (tests/conftest.py, SLOW_FIRST)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 tests

clean:
	rm -rf $(VENV) build *.egg-info
