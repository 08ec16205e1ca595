"""Lightning datamodule over a training dataset (`input_ids`, `loss_mask`, `id`, `group`), whichever recipe made it:
self-distilled answers or the conversations' own text (`storage.py` stores both alike).

The split is by conversation group (`split.is_validation`), so the validation conversations never reach the training
loader. Each row also carries its position in the full dataset (`index`), its key in the target cache and memo.
Batches are right-padded; padded positions have `attention_mask = loss_mask = 0`. With `echo` > 1 the training loader
serves each row `echo` times (data echoing, `echo.py`).
"""

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from medusa_like.data.echo import EchoBatchSampler
from medusa_like.data.split import is_validation
from medusa_like.data.storage import load_distilled


class TrainingDataModule(L.LightningDataModule):
    def __init__(
        self,
        dataset_dir: str,
        val_fraction: float = 0.05,
        split_seed: int = 0,
        batch_size: int = 8,
        max_length: int = 1024,
        min_supervised: int = 2,  # rows with fewer assistant tokens (after truncation) teach the heads nothing
        shuffle: bool = True,
        num_workers: int = 0,
        echo: int = 1,  # serve each training row this many times (data echoing, `echo.py`): one target read, more steps
        echo_window: int = 8,  # batches whose rows are served again (reshuffled) before the next ones are read
    ):
        super().__init__()
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size must be >= 1 and max_length >= 2, got {batch_size} and {max_length}")
        if echo < 1 or echo_window < 1:
            raise ValueError(f"echo and echo_window must be >= 1, got {echo} and {echo_window}")
        self.dataset_dir = Path(dataset_dir)
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.batch_size = batch_size
        self.max_length = max_length
        self.min_supervised = min_supervised
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.echo, self.echo_window = echo, echo_window
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = load_distilled(self.dataset_dir)
        data = data.add_column("index", list(range(len(data))))
        max_length, min_supervised = self.max_length, self.min_supervised
        data = data.filter(lambda row: sum(row["loss_mask"][:max_length]) >= min_supervised)
        val = [is_validation(g, self.val_fraction, self.split_seed) for g in data["group"]]
        columns = ["index", "input_ids", "loss_mask"]
        self.train_set = data.select([i for i, v in enumerate(val) if not v]).select_columns(columns)
        self.val_set = data.select([i for i, v in enumerate(val) if v]).select_columns(columns)
        if len(self.train_set) == 0:
            raise ValueError(
                f"{self.dataset_dir}: no training rows left after the split (val_fraction={self.val_fraction})"
            )

    @property
    def echo_rows(self) -> int:
        """How many of the latest training rows may be served again (0: none): a training module keeps the target's
        outputs for that many rows (`training/target_memo.py`)."""
        return self.echo_window * self.batch_size if self.echo > 1 else 0

    def train_dataloader(self) -> StatefulDataLoader:
        # the batch sampler shuffles by epoch itself, from a seed and the epoch (resumable from a few numbers, an
        # epoch's end too: a loader's own shuffle draws each epoch's order from torch's global generator, which a
        # resumed run does not restore), echoing or not (echo=1); under DDP Lightning replaces the sequential order
        # with the rank's share
        batches = EchoBatchSampler(
            SequentialSampler(self.train_set), self.batch_size, echo=self.echo, window=self.echo_window,
            shuffle=self.shuffle,
        )  # fmt: skip
        return StatefulDataLoader(
            self.train_set,
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=PadCollator(self.max_length),
        )

    def val_dataloader(self) -> StatefulDataLoader:
        return self.in_order(self.val_set)

    def in_order(self, dataset) -> StatefulDataLoader:
        """`dataset`'s rows in their order, in this module's batches: every epoch the same."""
        return StatefulDataLoader(
            dataset, batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=PadCollator(self.max_length)
        )


class PadCollator:
    """Rows -> right-padded LongTensors input_ids, attention_mask, loss_mask [B, T] and index [B]."""

    def __init__(self, max_length: int, pad_id: int = 0):
        self.max_length = max_length
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [min(len(r["input_ids"]), self.max_length) for r in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            input_ids[i, :n] = torch.as_tensor(row["input_ids"][:n])
            attention_mask[i, :n] = 1
            loss_mask[i, :n] = torch.as_tensor(row["loss_mask"][:n])
        index = torch.tensor([r["index"] for r in rows], dtype=torch.long)  # [B]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "index": index}
