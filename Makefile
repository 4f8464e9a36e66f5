# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The HF transformers baseline for `make bench` lives in its own venv: torch is not a Sluice dependency.
BENCH_REF := .venv-bench-ref

.PHONY: serve test model bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The CPU kernels (jax.ffi, C++): without a compiler the build says so and the jnp references run instead.
CPU_KERNELS := pallas_kernels/_cpu_qmatmul.so

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

$(CPU_KERNELS): pallas_kernels/cpu_qmatmul.cc pallas_kernels/cpu_build.py $(STAMP)
	$(BIN)/python -m pallas_kernels.cpu_build

model: $(STAMP) $(CPU_KERNELS)
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

clean:
	rm -rf $(VENV) $(BENCH_REF) $(CPU_KERNELS)
