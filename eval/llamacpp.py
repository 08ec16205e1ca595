"""The EAGLE-3 drafter in llama.cpp on the CPU, against plain llama.cpp and its lookup modes (opt-in, not in tests).

    python -m eval.llamacpp drafter.path=runs/make_run/train/drafter
    python -m eval.llamacpp drafter.path=... llamacpp.chains=[3] llamacpp.precisions=[q8_0] llamacpp.framework=false

Builds llama.cpp once into .llamacpp/ (from the `llama-cpp-python` source distribution on PyPI), exports the drafter
as GGUF (f32, f16, q8_0), runs every setting on the held-out validation prompts and writes llamacpp.json and
llamacpp.md into the run directory. Where llama.cpp cannot be built it says why and exits 0. The work is the llama.cpp
engine's (`medusa_like/engines/llamacpp/comparison.py`).
"""

import hydra
from omegaconf import DictConfig

from medusa_like.config_checks import one_line_errors
from medusa_like.engines.registry import ENGINES


@hydra.main(version_base="1.3", config_path="../conf", config_name="llamacpp")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        ENGINES["llamacpp"].measure(cfg)


if __name__ == "__main__":
    main()
