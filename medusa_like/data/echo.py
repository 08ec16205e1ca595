"""Data echoing (Choi et al., 2019, arXiv 1907.05550): serve each training row `echo` times, so that every costly
read of the frozen target feeds several optimizer steps.

A drafter's training step is mostly the frozen target's forward (its features and labels); the drafter's own
forward and backward cost a fraction of it. `EchoBatchSampler` takes `window` batches of rows from its sampler, serves
them, then serves the same rows `echo - 1` more times, each time reshuffled into new batches, so a repeat rarely
meets the rows it came with; the training module keeps the target's outputs of the rows of one window in memory
(`training/target_memo.py`) and reads the target once per row.

    batches = EchoBatchSampler(RandomSampler(rows), batch_size=4, echo=2, window=8)   # 64 rows per window served

Resumable: its iterator's state names the window it was in and how many of that window's batches it served; the
sampler's own state is taken at the window's start, and the reshuffles are seeded by the window's number, so a
resumed run serves exactly the batches the killed one would have.
"""

import itertools
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import BatchSampler, Sampler
from torchdata.stateful_dataloader import Stateful


class EchoBatchSampler(BatchSampler):
    """Batches of `batch_size` rows from `sampler`, each window of `window * batch_size` rows served `echo` times."""

    def __init__(
        self, sampler: Sampler[int] | Sized, batch_size: int, drop_last: bool = False, echo: int = 2, window: int = 8,
        seed: int | None = None,
    ):  # fmt: skip
        super().__init__(sampler, batch_size, drop_last)
        if echo < 1 or window < 1:
            raise ValueError(f"need echo >= 1 and window >= 1, got echo={echo}, window={window}")
        # the reshuffles' seed: drawn from torch's generator when not given (seeded runs draw the same), and kept in
        # the iterator's state, so a resumed run reshuffles as the killed one did
        self.seed = int(torch.randint(2**31, ()).item()) if seed is None else seed
        self.echo, self.window = echo, window
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning before each epoch; passed on to a sampler that shuffles by epoch (DDP's)."""
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

    def passes(self, rows: list[int], window_number: int) -> list[list[int]]:
        """The batches one window's `rows` make: in the sampler's order first, then `echo - 1` reshuffled passes."""
        seed = ((self.seed * 1_000_003 + self.epoch) * 1_000_003 + window_number) % 2**63
        generator = torch.Generator().manual_seed(seed)
        batches = []
        for echo in range(self.echo):
            order = rows if echo == 0 else [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        return batches


class _EchoIterator(Iterator[list[int]], Stateful):
    """One epoch of an `EchoBatchSampler`: the current window's batches, refilled from the sampler's rows."""

    def __init__(self, owner: EchoBatchSampler):
        self.owner = owner
        self.rows = iter(owner.sampler)
        self.window_number = 0  # the windows begun this epoch
        self.rows_before = 0  # rows taken from the sampler before the current window
        self.start_state = self._rows_state()  # the sampler's state at the current window's start
        self.pending: list[list[int]] = []  # the current window's batches
        self.served = 0  # how many of them were served

    def _rows_state(self) -> dict | None:
        return self.rows.state_dict() if isinstance(self.rows, Stateful) else None

    def _next_window(self) -> None:
        self.rows_before += len({i for batch in self.pending for i in batch})
        self.start_state = self._rows_state()
        rows = list(itertools.islice(self.rows, self.owner.window * self.owner.batch_size))
        if not rows:
            raise StopIteration
        self.pending, self.served = self.owner.passes(rows, self.window_number), 0
        self.window_number += 1

    def __next__(self) -> list[int]:
        while self.served == len(self.pending):
            self._next_window()  # raises StopIteration at the epoch's end
        self.served += 1
        return self.pending[self.served - 1]

    def state_dict(self) -> dict:
        return {
            "in_window": bool(self.pending),
            "window_number": self.window_number - bool(self.pending),  # the current window's
            "rows_before": self.rows_before,
            "start_state": self.start_state,
            "served": self.served,
            "seed": self.owner.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Back to the current window's start (the sampler's state then, or its rows skipped), the window re-read
        and reshuffled as before, and its batches already served skipped."""
        self.owner.seed = state["seed"]
        self.rows = iter(self.owner.sampler)
        if state["start_state"] is not None:
            self.rows.load_state_dict(state["start_state"])
        else:  # a sampler without state (DDP's, which shuffles by epoch alone): skip the rows taken before
            for _ in itertools.islice(self.rows, state["rows_before"]):
                pass
        self.window_number, self.rows_before = state["window_number"], state["rows_before"]
        self.pending, self.served = [], 0
        if state["in_window"]:
            self._next_window()
            self.served = state["served"]
