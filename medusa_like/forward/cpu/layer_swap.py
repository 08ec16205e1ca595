"""Copies of a model with some of its layers swapped, sharing every weight: what the compiler traces and baselines run.

    copy = copy_replacing(model, lambda child: replacement_or_None)

The few-row layers go back to `nn.Linear` for transformers' own forward (`few_row_linear.with_stock_linears`), and bf16
layers become the dot-product kernel's `PackedLinear`s for a compiled graph (`bf16_linear.with_packed_linears`).
"""

import copy

from torch import nn


def copy_replacing(model: nn.Module, replace) -> nn.Module:
    """A copy of `model` sharing every parameter and buffer with it (no weight is copied; `model` is unchanged), each
    child module for which `replace(child)` gives a module replaced by that."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    copied = copy.deepcopy(model, memo=shared)
    for parent in list(copied.modules()):
        for name, child in list(parent.named_children()):
            replacement = replace(child)
            if replacement is not None:
                parent.register_module(name, replacement)
    return copied
