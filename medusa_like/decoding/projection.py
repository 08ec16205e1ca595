"""The target's output projection as a fast function of a few hidden states, optionally restricted to some rows."""

import torch

from medusa_like.cpu.few_row_linear import FewRowLinear, few_row_product
from medusa_like.targets import logit_softcap, softcap


class VocabProjection:
    """The target's output projection (and final logit soft-capping, e.g. Gemma's), as `logits = W @ h^T`.

    Same numbers as calling `lm_head`, computed as `few_row_linear.py` computes few rows: for the rows of a tree step
    or of the heads, CPU BLAS runs `W @ h^T` several times faster than `F.linear`'s `h @ W^T` on a large vocabulary
    (docs/results.md), and the output layer's row plan, if it has one, picks the kernel per row count. `rows` [N]
    restricts it to those token ids (a draft vocabulary): logits [..., N] in that order.
    """

    def __init__(self, target, rows: torch.Tensor | None = None):
        output = target.get_output_embeddings()
        weight, bias = output.weight, getattr(output, "bias", None)  # [V, H], [V]
        if rows is not None:
            rows = rows.to(weight.device)
            weight = weight[rows].contiguous()
            bias = bias[rows] if bias is not None else None
        self.weight, self.bias = weight, bias
        self.planned = output if isinstance(output, FewRowLinear) and rows is None else None  # its plan may change
        self.softcap = logit_softcap(target.config)

    @property
    def plan(self) -> tuple[int, ...]:
        return self.planned.plan if self.planned is not None else ()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (or [..., N] for restricted rows)."""
        packs = self.planned.packs if self.planned is not None else None
        prefill = self.planned.prefill if self.planned is not None else 0
        return softcap(few_row_product(hidden, self.weight, self.bias, self.plan, packs, prefill), self.softcap)
