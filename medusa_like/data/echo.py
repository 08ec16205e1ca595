"""Data echoing (Choi et al., 2019, arXiv 1907.05550): serve each training row `echo` times, so that every costly
read of the frozen target feeds several optimizer steps.

A drafter's training step is mostly the frozen target's forward (its features and labels); the drafter's own
forward and backward cost a fraction of it. `EchoBatchSampler` shuffles its sampler's rows once per epoch, takes
`window` batches of them, serves them, then serves the same rows `echo - 1` more times, each time reshuffled into new
batches, so a repeat rarely meets the rows it came with; the training module keeps the target's outputs of the rows
of one window in memory (`training/target_memo.py`) and reads the target once per row.

    batches = EchoBatchSampler(SequentialSampler(rows), batch_size=4, echo=2, window=8)   # 32 rows a window, twice

Every order is drawn from the sampler's order and a seed, by epoch and window number, so an iterator's state is a few
numbers (the epoch, the window, the batches of it served, the seed) and a resumed run serves exactly the batches the
killed one would have. The sampler it wraps is the order within the epoch before shuffling: sequential on one
process, and under DDP the rank's share that Lightning puts in its place (`sampler` is the argument it replaces).
"""

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import BatchSampler, Sampler
from torchdata.stateful_dataloader import Stateful


class EchoBatchSampler(BatchSampler):
    """Batches of `batch_size` rows from `sampler` (shuffled per epoch when `shuffle`), each window of
    `window * batch_size` rows served `echo` times."""

    def __init__(
        self, sampler: Sampler[int] | Sized, batch_size: int, drop_last: bool = False, echo: int = 2, window: int = 8,
        shuffle: bool = True, seed: int | None = None,
    ):  # fmt: skip
        super().__init__(sampler, batch_size, drop_last)
        if echo < 1 or window < 1:
            raise ValueError(f"need echo >= 1 and window >= 1, got echo={echo}, window={window}")
        self.echo, self.window, self.shuffle = echo, window, shuffle
        # drawn from torch's generator when not given (a seeded run draws the same), and kept in the iterator's state
        self.seed = int(torch.randint(2**31, ()).item()) if seed is None else seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning before each epoch; passed on to a sampler that orders by epoch."""
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return _EchoIterator(self)

    def __len__(self) -> int:
        return self.batches_for(len(self.sampler))

    def batches_for(self, rows: int) -> int:
        """The batches an epoch of `rows` rows makes (every pass of every window)."""
        full = self.window * self.batch_size
        per_window = [full] * (rows // full) + ([rows % full] if rows % full else [])
        batches = (n // self.batch_size if self.drop_last else -(-n // self.batch_size) for n in per_window)
        return self.echo * sum(batches)

    def _generator(self, *keys: int) -> torch.Generator:
        seed = self.seed
        for key in (self.epoch, *keys):
            seed = (seed * 1_000_003 + key) % 2**63
        return torch.Generator().manual_seed(seed)

    def epoch_rows(self) -> list[int]:
        """The sampler's rows in this epoch's order."""
        rows = list(self.sampler)
        if not self.shuffle:
            return rows
        return [rows[i] for i in torch.randperm(len(rows), generator=self._generator(-1)).tolist()]

    def passes(self, rows: list[int], window_number: int) -> list[list[int]]:
        """The batches one window's `rows` make: in the epoch's order first, then `echo - 1` reshuffled passes."""
        generator = self._generator(window_number)
        batches = []
        for echo in range(self.echo):
            order = rows if echo == 0 else [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        return batches


class _EchoIterator(Iterator[list[int]], Stateful):
    """One epoch of an `EchoBatchSampler`: the current window's batches, refilled from the epoch's rows."""

    def __init__(self, owner: EchoBatchSampler):
        self.owner = owner
        self.rows = owner.epoch_rows()
        self.window_number = 0  # the next window to read
        self.pending: list[list[int]] = []  # the current window's batches
        self.served = 0  # how many of them were served

    def _read_window(self) -> None:
        size = self.owner.window * self.owner.batch_size
        rows = self.rows[self.window_number * size : (self.window_number + 1) * size]
        if not rows:
            raise StopIteration
        self.pending, self.served = self.owner.passes(rows, self.window_number), 0
        self.window_number += 1

    def __next__(self) -> list[int]:
        while self.served == len(self.pending):
            self._read_window()  # raises StopIteration at the epoch's end
        self.served += 1
        return self.pending[self.served - 1]

    def state_dict(self) -> dict:
        return {
            "epoch": self.owner.epoch,
            "seed": self.owner.seed,
            "windows_read": self.window_number,
            "served": self.served,
        }

    def load_state_dict(self, state: dict) -> None:
        """The same epoch's order, its last window read again (reshuffled as before), and its batches served skipped."""
        self.owner.epoch, self.owner.seed = state["epoch"], state["seed"]
        self.rows = self.owner.epoch_rows()
        self.window_number, self.pending, self.served = max(state["windows_read"] - 1, 0), [], 0
        if state["windows_read"]:
            self._read_window()
            self.served = state["served"]
