"""vLLM's CPU build: `driver.py` starts and talks to `worker.py` (run in vLLM's own environment), `comparison.py`
measures it beside this framework and llama.cpp, `step_profile.py` shows where a step's time goes (conf/vllm.yaml)."""
