"""The EAGLE-3 drafter in llama.cpp on the CPU, against plain llama.cpp and its lookup modes (opt-in, not in tests).

    python -m eval.llamacpp drafter.path=runs/make_run/train/drafter
    python -m eval.llamacpp drafter.path=... llamacpp.chains=[3] llamacpp.precisions=[q8_0] llamacpp.framework=false

Builds llama.cpp once into .llamacpp/ (from the `llama-cpp-python` source distribution on PyPI), exports the drafter
as GGUF (f32, f16, q8_0), runs every setting on the held-out validation prompts and writes llamacpp.json and
llamacpp.md into the run directory. Where llama.cpp cannot be built it says why and exits 0. The work is
`medusa_like.apps.llamacpp_comparison`; this file keeps the command working from the checkout.
"""

from medusa_like.apps.llamacpp_comparison import compare_llamacpp, main

__all__ = ["compare_llamacpp", "main"]

if __name__ == "__main__":
    main()
