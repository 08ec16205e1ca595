"""llama.cpp on this CPU: `runner.py` builds it and runs one sequence, `server.py` batches in llama-server,
`comparison.py` is the whole run against plain llama.cpp and its lookup modes (conf/llamacpp.yaml)."""
