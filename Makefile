# Two commands set everything up on a fresh machine: `make serve` and `make test`.
# `make test PYTHON=python3.12` runs under another interpreter, in a venv of its own (.venv-python3.12).
PYTHON ?= python3
# pyenv's shim for python3.N refuses to run unless that version is selected: where pyenv has it, take its
# interpreter directly.
PYTHON_BIN = $(firstword $(if $(filter python3.%,$(1)),$(wildcard $(HOME)/.pyenv/versions/$(patsubst python%,%,$(1))*/bin/$(1))) $(1))
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The HF transformers baseline for `make bench` lives in its own venv: torch is not a Sluice dependency.
BENCH_REF := .venv-bench-ref
# llama.cpp, the CPU peer for `make bench`: built once from the sources vendored in the llama-cpp-python sdist.
LLAMA_CPP := .llama-cpp
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP_SRC := llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
# GGML_NATIVE compiles AMX tile code in wherever the CPU lists AMX, but a VM may list it without enabling the tile
# state (this workplace's Xeon VMs: llama-server dies of SIGILL at its first `tilezero`). So AMX is opt-in:
# `make bench LLAMA_CPP_AMX=on` on a machine whose kernel grants it (remove .llama-cpp to rebuild).
LLAMA_CPP_AMX ?= off
LLAMA_CPP_FLAGS := $(if $(and $(filter off,$(LLAMA_CPP_AMX)),$(filter x86_64,$(shell uname -m))),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

.PHONY: serve test model bench gpu-check check-jax-next check-gpu-image clean

$(BIN)/python:
	$(call PYTHON_BIN,$(PYTHON)) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# What serving and `sluice bench` need, and no more: `make serve` on a laptop waits for no test stack, nor for Ray
# (a wheel some platforms lack; `sluice serve --replicas` says how to add it).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[bench]'
	touch $(STAMP)

# The ray extra too: the tests of `sluice serve --replicas` run when it is there (and skip without it).
$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test,bench,ray]'
	touch $(TEST_STAMP) $(STAMP)

# The CPU kernels (C++, XLA FFI) build for the CPU's best variant (pallas_kernels/cpu_build.py); without them the
# fastest pure-XLA forms run.
model: $(STAMP)
	$(BIN)/python -m sluice.pallas_kernels.cpu_library
	$(BIN)/sluice fetch

serve: model
	$(BIN)/sluice serve --host 127.0.0.1 --port 8000

# The browser tests drive Debian's Chromium through Playwright (which cannot download its own browsers here).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Chromium for the browser tests (apt-get) ..."; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "No $(CHROMIUM) and not root with apt-get: the browser tests will say so (apt-get install chromium)"; \
	fi

# The ARM64 cross compiler: tests/test_kernel_build.py compiles the CPU kernels' ARM64 build with it (to NEON).
ARM64_CXX := /usr/bin/aarch64-linux-gnu-g++
$(ARM64_CXX):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing the ARM64 cross compiler for the kernel build tests (apt-get) ..."; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null; \
	else \
		echo "No $(ARM64_CXX) and not root with apt-get: the ARM64 build test will say so"; \
	fi

# Two pytest-xdist workers, so that one module's waits (server start-ups, Ray's timers, Python between steps) overlap
# another's compute; tests/conftest.py keeps each module on one worker and runs those that cannot share the machine
# alone. `pytest -p no:xdist` runs the suite in one process. Under mimalloc, as the `sluice` command runs (its
# compiles take 10 to 15% less: app/allocator.py); the servers the tests start inherit it.
test: $(TEST_STAMP) model | $(CHROMIUM) $(ARM64_CXX)
	LD_PRELOAD="$$($(BIN)/python -m sluice.app.allocator)" $(BIN)/python -m pytest -q -n 2

# torch first: pip then takes the CPU wheel and keeps it when transformers comes after.
$(BENCH_REF)/.installed:
	$(call PYTHON_BIN,$(PYTHON)) -m venv $(BENCH_REF)
	$(BENCH_REF)/bin/pip install --quiet torch==2.13.0
	$(BENCH_REF)/bin/pip install --quiet transformers gguf accelerate
	touch $@

$(LLAMA_CPP)/.built: | $(BIN)/python
	rm -rf $(LLAMA_CPP) && mkdir -p $(LLAMA_CPP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_CPP)
	tar -xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP) $(LLAMA_CPP_SRC)
	rm $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
	cmake -S $(LLAMA_CPP)/$(LLAMA_CPP_SRC) -B $(LLAMA_CPP)/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_C_FLAGS="$(LLAMA_CPP_FLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMA_CPP_FLAGS)"
	nice -n 10 cmake --build $(LLAMA_CPP)/build -j 2 --target llama-server llama-bench
	touch $@

# llama-quantize writes the Q8_0 GGUF that `make bench` compares in besides the fetched Q4_1.
$(LLAMA_CPP)/build/bin/llama-quantize: $(LLAMA_CPP)/.built
	nice -n 10 cmake --build $(LLAMA_CPP)/build -j 2 --target llama-quantize

bench: $(TEST_STAMP) model $(BENCH_REF)/.installed $(LLAMA_CPP)/.built $(LLAMA_CPP)/build/bin/llama-quantize
	$(BIN)/python bench/compare.py

# On a GPU machine, with the image's python (no venv): kernels, engine and throughput in one command.
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	$(PYTHON) -m sluice.bench.gpu_check --out $(GPU_CHECK_OUT) --require-gpu

# The whole suite, as `make test` runs it, under Python 3.12 and the newest jax on the index, whatever
# pyproject's pin allows (JAX_NEXT_VERSION=X takes that one instead), in a venv of its own: whether the pin may grow.
JAX_NEXT := .venv-jax-next
PYTHON_NEXT ?= python3.12
JAX_NEXT_VERSION ?=
check-jax-next:
	$(MAKE) --no-print-directory PYTHON=$(PYTHON_NEXT) VENV=$(JAX_NEXT) $(JAX_NEXT)/.installed-test
	$(JAX_NEXT)/bin/pip install --quiet --upgrade \
		jax$(if $(JAX_NEXT_VERSION),==$(JAX_NEXT_VERSION)) jaxlib$(if $(JAX_NEXT_VERSION),==$(JAX_NEXT_VERSION))
	$(JAX_NEXT)/bin/python -c 'import sys, jax, jaxlib; print("Python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)'
	$(MAKE) --no-print-directory PYTHON=$(PYTHON_NEXT) VENV=$(JAX_NEXT) test

# The software of a typical GPU machine (Python 3.12, jax 0.11.2; no HTTP stack, gguf, pydantic or llguidance),
# on any machine: the kernel lowering and GPU-check tests, the engine with the host deciding the sampler's plans
# (the GPU's default) and its compile thread, the step audit and the profiler's window, in a venv of its own.
# With jax's CUDA plugin (and JAX_PLATFORMS=cpu, so no GPU is looked for) the step audit also compiles the engine's
# decode programs with XLA:GPU for an abstract H100 (bench/step_audit.py --target h100).
GPU_IMAGE := .venv-gpu-image
GPU_IMAGE_JAX ?= 0.11.2
$(GPU_IMAGE)/.installed:
	$(call PYTHON_BIN,$(PYTHON_NEXT)) -m venv $(GPU_IMAGE)
	$(GPU_IMAGE)/bin/pip install --quiet jax==$(GPU_IMAGE_JAX) jaxlib==$(GPU_IMAGE_JAX) flax orbax-checkpoint \
		numpy safetensors tokenizers jinja2 tqdm prometheus-client httpx pytest
	touch $@

$(GPU_IMAGE)/.cuda-plugin: $(GPU_IMAGE)/.installed
	$(GPU_IMAGE)/bin/pip install --quiet jax-cuda12-plugin==$(GPU_IMAGE_JAX) jax-cuda12-pjrt==$(GPU_IMAGE_JAX)
	touch $@

check-gpu-image: $(GPU_IMAGE)/.cuda-plugin
	JAX_PLATFORMS=cpu $(GPU_IMAGE)/bin/python -m pytest -q tests/test_kernel_lowering.py tests/test_paged_attention.py \
		tests/test_gpu_check.py tests/test_kernel_bench.py tests/test_engine_check.py \
		tests/test_engine_overlap.py tests/test_background_compile.py tests/test_step_audit.py \
		tests/test_device_profile.py

clean:
	rm -rf $(VENV) $(BENCH_REF) $(LLAMA_CPP) $(JAX_NEXT) $(GPU_IMAGE)
