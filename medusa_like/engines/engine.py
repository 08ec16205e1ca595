"""The one interface of an external engine measured beside this framework: what it is, whether it runs here, and its
comparison run. The entry points (`python -m eval.<name>`, conf/<name>.yaml) and the tests see every engine this way.

    engine = ENGINES["vllm"]                  # registry.py
    engine.unavailable_reason()               # None, or why it cannot run here ("no vLLM environment: run ...")
    engine.measure(cfg)                       # its settings on cfg's drafter and prompts: the report it wrote

How each engine is driven lives in its own package: llama.cpp's executables and server (`llamacpp/`), vLLM's engine
in an environment of its own (`vllm/`).
"""

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class Engine:
    name: str  # its config and command: conf/<name>.yaml, python -m eval.<name>
    what: str  # one line: the engine and what its comparison measures
    unavailable_reason: Callable[[], str | None]  # None when it can run here; else why not, in one line
    # its comparison on the config's drafter and prompts: every setting's rows, written into the run directory
    # (<name>.json and .md) and returned; None where it cannot run here (the reason logged)
    measure: Callable[[DictConfig], dict | None]
