"""llama.cpp on this CPU: `runner.py` builds it and runs one sequence, `server.py` batches in llama-server, `plain.py`
its plain decoding of the target's own weights (the evaluation's method (l))."""
