"""The one interface of an external engine measured beside this framework: what it is and whether it runs here. The
tests see every engine this way; its comparison with this framework is an app (`apps/<name>_comparison.py`, behind
`python -m eval.<name>` and conf/<name>.yaml).

    engine = ENGINES["vllm"]                  # registry.py
    engine.unavailable_reason()               # None, or why it cannot run here ("no vLLM environment: run ...")

How each engine is driven lives in its own package: llama.cpp's executables and server (`llamacpp/`), vLLM's engine
in an environment of its own (`vllm/`).
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    name: str  # its config and command: conf/<name>.yaml, python -m eval.<name>
    what: str  # one line: the engine and what its comparison measures
    unavailable_reason: Callable[[], str | None]  # None when it can run here; else why not, in one line
