"""The target's output projection as a function of a few hidden states, optionally restricted to some rows."""

import torch
import torch.nn.functional as F

from medusa_like.targets import logit_softcap, output_logits, softcap


class VocabProjection:
    """The target's output projection and final logit soft-capping (e.g. Gemma's), as the target computes them.

    Unrestricted, it calls the target's own output layer (whatever `medusa_like.forward` made of it on this machine).
    `rows` [N] restricts it to those token ids (a draft vocabulary): their rows are copied once, and the logits come
    back [..., N] in that order.
    """

    def __init__(self, target, rows: torch.Tensor | None = None):
        self.target, self.rows = target, rows
        if rows is not None:
            output = target.get_output_embeddings()
            rows = rows.to(output.weight.device)
            self.weight = output.weight[rows].contiguous()  # [N, H]
            self.bias = output.bias[rows] if getattr(output, "bias", None) is not None else None
            self.softcap = logit_softcap(target.config)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (or [..., N] for restricted rows)."""
        if self.rows is None:
            return output_logits(self.target, hidden)
        return softcap(F.linear(hidden.to(self.weight.dtype), self.weight, self.bias), self.softcap)
