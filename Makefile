# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The HF transformers baseline for `make bench` lives in its own venv: torch is not a Sluice dependency.
BENCH_REF := .venv-bench-ref

.PHONY: serve test model bench gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The CPU kernels (C++, XLA FFI) are compiled for this machine; without a compiler the jnp references run.
model: $(STAMP)
	$(BIN)/python -m pallas_kernels.cpu_library
	$(BIN)/sluice fetch

serve: model
	$(BIN)/sluice serve --host 127.0.0.1 --port 8000

test: model
	$(BIN)/python -m pytest -q

# torch first: pip then takes the CPU wheel and keeps it when transformers comes after.
$(BENCH_REF)/.installed:
	$(PYTHON) -m venv $(BENCH_REF)
	$(BENCH_REF)/bin/pip install --quiet torch==2.13.0
	$(BENCH_REF)/bin/pip install --quiet transformers gguf accelerate
	touch $@

bench: model $(BENCH_REF)/.installed
	$(BIN)/python bench/compare.py

# On a GPU machine, with the image's python (no venv): kernels, engine and throughput in one command.
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	$(PYTHON) -m bench.gpu_check --out $(GPU_CHECK_OUT) --require-gpu

clean:
	rm -rf $(VENV) $(BENCH_REF)
