"""External inference engines beside this framework, each behind one interface (`engine.Engine`, every one in
`registry.py`): llama.cpp (`llamacpp/`: building and running its executables, its server for batches, the comparison)
and vLLM (`vllm/`: the driver of its CPU build in an environment of its own, the worker it runs there, the comparison
and where a step's time goes). The evaluation imports one module of them alone, llama.cpp's plain decoding
(`llamacpp/plain.py`, its method (l)); the comparisons read the evaluation's prompts and run directory."""
