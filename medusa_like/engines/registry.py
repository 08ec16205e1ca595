"""Every external engine by name (`engine.Engine`): what `python -m eval.<name>` runs and the tests go over."""

from .engine import Engine
from .llamacpp.comparison import LLAMACPP
from .vllm.comparison import VLLM

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (LLAMACPP, VLLM)}
