"""Learning-rate schedule: linear warmup, then cosine decay to a floor (as a LambdaLR over optimizer steps), over the
whole run or only its last share (`decay_ratio`: the peak held until then, warmup-stable-decay), and the run's length
it is fitted to: its optimizer steps and, under a time budget (`trainer.max_time`), its share of the budget spent.

A budget that ends the epoch early would otherwise stop the run with the learning rate still near its peak (as the
default experiment's budget does on a slow fp32-only CPU, docs/training.md), and a budget far shorter than its epochs
(many epochs on a GPU, `trainer.max_epochs` set high for the budget to stop) inside a warmup sized for all of them. So
the warmup and the decay follow whichever is further along, the steps or the time: the warmup ends by its share of the
budget, and the cosine reaches its floor when the budget runs out. The rate of a step then depends on the machine's
speed, as the number of steps under a budget does already.
"""

import math
from collections.abc import Callable

from lightning.pytorch.callbacks import Timer
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from medusa_like.data.echo import EchoBatchSampler


def cosine_with_warmup(
    optimizer: Optimizer,
    total_steps: int,
    warmup_ratio: float = 0.05,
    min_lr_ratio: float = 0.1,
    time_spent: Callable[[], float] | None = None,
    decay_ratio: float = 1.0,
) -> LambdaLR:
    """`time_spent()`: the share of a time budget used so far (0..1), or None for a schedule over steps alone.
    `decay_ratio`: the last share of the run (after the warmup) over which the cosine decays; before it the rate
    stays at its peak (1.0: a cosine over the whole run; below 1: warmup-stable-decay)."""
    if total_steps < 1 or not 0 <= warmup_ratio < 1 or not 0 <= min_lr_ratio <= 1 or not 0 < decay_ratio <= 1:
        raise ValueError(
            f"need total_steps >= 1, 0 <= warmup_ratio < 1, 0 <= min_lr_ratio <= 1, 0 < decay_ratio <= 1; "
            f"got {total_steps}, {warmup_ratio}, {min_lr_ratio}, {decay_ratio}"
        )
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        spent = time_spent() if time_spent is not None else 0.0
        ramp = (step + 1) / (warmup + 1)
        if warmup_ratio > 0:
            ramp = max(ramp, spent / warmup_ratio)  # the warmup's share of the budget gone: the warmup is over
        if step < warmup and ramp < 1:
            return ramp
        progress = max(0.0, (step - warmup) / max(1, total_steps - warmup), spent)
        progress = min(1.0, max(0.0, progress - (1 - decay_ratio)) / decay_ratio)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def budget_spent(trainer) -> Callable[[], float] | None:
    """The share of `trainer.max_time` its training has used (read from Lightning's Timer, which a resumed run
    restores), or None if the run has no time budget."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is None or timer.time_remaining() is None:
        return None

    def spent() -> float:
        elapsed = timer.time_elapsed()
        return elapsed / max(elapsed + timer.time_remaining(), 1e-9)

    return spent


def total_optimizer_steps(trainer) -> int:
    """The optimizer steps of the whole run, counted as `trainer.estimated_stepping_batches` counts them.

    `estimated_stepping_batches` sets up the fit loop's training dataloader while `configure_optimizers` runs, before
    Lightning restores a checkpoint, and Lightning restores a resumable dataloader's position only into a dataloader
    it sets up afterwards: a mid-epoch resume would then restart the epoch's batches. So the training batches per rank
    are counted on a loader of their own.
    """
    datamodule = trainer.datamodule
    if datamodule is None:
        return int(trainer.estimated_stepping_batches)
    loader = datamodule.train_dataloader()
    samples_per_rank = math.ceil(len(loader.dataset) / trainer.world_size)  # DistributedSampler pads to equal shares
    if isinstance(loader.batch_sampler, EchoBatchSampler):  # each row served several times (data echoing)
        batches = loader.batch_sampler.batches_for(samples_per_rank)
    else:
        batches = math.ceil(samples_per_rank / loader.batch_size)
    limit = trainer.limit_train_batches
    batches = int(batches * limit) if isinstance(limit, float) else min(batches, limit)
    if trainer.max_epochs in (None, -1):  # epochs unbounded: max_steps alone ends the run
        if trainer.max_steps == -1:
            raise ValueError("a learning-rate schedule needs trainer.max_epochs or trainer.max_steps")
        return trainer.max_steps
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * trainer.max_epochs
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps
