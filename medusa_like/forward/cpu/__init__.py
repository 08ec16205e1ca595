"""Machine-specific tuning for CPUs: the few-row linear kernels a tree step runs (`few_row_linear.py`, with the
per-shape row plans of `row_plans.py`). The decoding core reaches them only through the cost model, which asks how
long a forward over n nodes takes and sets what it measured; kernel names stay inside this package."""
