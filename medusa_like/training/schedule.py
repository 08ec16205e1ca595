"""Learning-rate schedule: linear warmup, then cosine decay to a floor (as a LambdaLR over optimizer steps)."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def cosine_with_warmup(
    optimizer: Optimizer, total_steps: int, warmup_ratio: float = 0.05, min_lr_ratio: float = 0.1
) -> LambdaLR:
    if total_steps < 1 or not 0 <= warmup_ratio < 1 or not 0 <= min_lr_ratio <= 1:
        raise ValueError(
            f"need total_steps >= 1, 0 <= warmup_ratio < 1, 0 <= min_lr_ratio <= 1; "
            f"got {total_steps}, {warmup_ratio}, {min_lr_ratio}"
        )
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
