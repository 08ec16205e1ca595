"""Every external engine by name (`engine.Engine`): what `python -m eval.<name>` compares and the tests go over."""

from .engine import Engine
from .llamacpp import runner as llamacpp
from .vllm import driver as vllm

LLAMACPP = Engine(
    "llamacpp",
    "llama.cpp's CPU build (from the llama-cpp-python sources): our drafter as GGUF against plain llama.cpp and its "
    "lookup modes, one sequence and batches in llama-server",
    llamacpp.unavailable_reason,
)
VLLM = Engine(
    "vllm",
    "vLLM's CPU build in an environment of its own: our EAGLE-3 export and its n-gram speculation against plain "
    "vLLM at batch 1, 8 and 32, joined with this framework's and llama.cpp's rows",
    vllm.unavailable_reason,
)
ENGINES: dict[str, Engine] = {engine.name: engine for engine in (LLAMACPP, VLLM)}
