"""External inference engines beside this framework, as runners that the rest of the package imports, each behind one
interface (`engine.Engine`, every one in `registry.py`): llama.cpp (`llamacpp/`: building and running its
executables, its server for batches, its plain decoding of the target, the evaluation's method (l)) and vLLM (`vllm/`:
the driver of its CPU build in an environment of its own and the worker it runs there; the data's answers can be
generated with it). The comparisons with this framework are apps (`apps/llamacpp_comparison.py`,
`apps/vllm_comparison.py`); nothing here imports the evaluation, the data, training or the apps."""
