"""vLLM's CPU build: `driver.py` starts and talks to `worker.py` (run in vLLM's own environment)."""
