# Pagoda: `make serve` and `make test` install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Where no GPU is present, take the CPU build of torch (a local file on the CI
# machines) instead of letting pip pull the multi-GB CUDA build.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
ARGS ?=

.PHONY: install chromium serve test test-gpu lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

serve: install
	$(PY) -m server $(ARGS)

# The /dashboard test drives headless Chromium (Debian's package). As root (CI) it is
# installed when missing; otherwise that one test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else \
	    echo "chromium is missing (apt-get install chromium): the dashboard browser test will skip"; \
	  fi; }

# Two workers (CI has two cores), a test file to each at a time: a file's module-scoped
# servers and engines are built once.
test: install chromium
	$(PY) -m pytest -q -ra -n 2 --dist loadfile $(ARGS)

# Eight workers share the GPU; one CPU thread each, or the transformers references on
# the CPU fight over the cores.
test-gpu: install
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -q -ra -m gpu -n 8 $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: install
	$(PY) -m benchmarks.offline $(ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
