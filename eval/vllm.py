"""vLLM's CPU build serving our EAGLE-3 export, beside this framework and llama.cpp (opt-in, not in tests).

    python -m eval.vllm drafter.path=runs/make_run/train/drafter [join.evaluation=.../report.json]
    make vllm      # the evaluation, llama.cpp and this in a row: one table
    python -m eval.vllm drafter.path=... vllm.profile.batch=8   # where a step's time goes

Needs the vLLM environment (`make vllm-install`). Exports the drafter with format=eagle3, starts vLLM on the default
target for each setting (plain, EAGLE-3 with 1-4 speculative tokens, n-gram), measures batch 1, 8 and 32, and writes
vllm.json and vllm.md into the run directory. The work is `medusa_like.apps.vllm_comparison` (`vllm_step_profile.py`
beside it); this file keeps the command working from the checkout.
"""

from medusa_like.apps.vllm_comparison import compare_vllm, main

__all__ = ["compare_vllm", "main"]

if __name__ == "__main__":
    main()
