"""Export a trained drafter: `python -m train.export drafter.path=<dir or .ckpt> format=<format> out=<dir>`.

Medusa heads export as native, medusa, vllm or tgi; the EAGLE-3 drafter as native, eagle3 (vLLM), eagle3_sglang or
gguf (llama.cpp); the block drafter as native or dflash (vLLM and SGLang). The
work is `medusa_like.apps.export` (installed as `medusa-export`; `export(cfg)` is importable from there); this file
keeps the command working from the checkout.
"""

from medusa_like.apps.export import export, main

__all__ = ["export", "main"]

if __name__ == "__main__":
    main()
