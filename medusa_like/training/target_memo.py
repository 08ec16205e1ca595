"""The frozen target's outputs for the most recent training rows, kept in memory: with data echoing
(`data/echo.py`) a row comes back within one window of batches, and its target outputs (EAGLE-3's features and labels,
Medusa heads' hidden states) are read from here instead of running the target again. Not a cache: it holds one
window's rows and dies with the process (the disk cache of every row is `target_cache.py`, which makes it unneeded).

    memo = TargetMemo(max_rows=64)
    out = memo.get(indices, input_ids, lengths)          # None unless every row of the batch is held
    memo.put(indices, input_ids, lengths, computed)      # each row cut to its length; the oldest rows leave first

A row is held with its token ids and returned only for the same ids, so a row index that meant another text (a new
dataset) never gets another row's labels.
"""

from collections import OrderedDict

import torch


class TargetMemo:
    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"a target memo holds at least one row, got max_rows={max_rows}")
        self.max_rows = max_rows
        self.rows: OrderedDict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.rows)

    def put(self, indices: list[int], input_ids: torch.Tensor, lengths: torch.Tensor, out: dict) -> None:
        """Hold each row b of `out` ([B, T, ...] tensors) cut to lengths[b] (copies: the batch's tensors are freed)."""
        for b, (index, n) in enumerate(zip(indices, lengths.tolist(), strict=True)):
            self.rows[index] = (input_ids[b, :n].clone(), {name: t[b, :n].clone() for name, t in out.items()})
            self.rows.move_to_end(index)
        while len(self.rows) > self.max_rows:
            self.rows.popitem(last=False)

    def get(self, indices: list[int], input_ids: torch.Tensor, lengths: torch.Tensor) -> dict | None:
        """The held rows `indices` as right-padded [B, T, ...] tensors (T = input_ids.shape[1], zeros past each row's
        length), or None when any of them is not held for these token ids."""
        held = [self.rows.get(index) for index in indices]
        if any(
            row is None or row[0].shape[0] != n or not torch.equal(row[0], input_ids[b, :n])
            for b, (row, n) in enumerate(zip(held, lengths.tolist(), strict=True))
        ):
            return None
        width = input_ids.shape[1]
        out: dict[str, torch.Tensor] = {}
        for b, (_, tensors) in enumerate(held):
            for name, row in tensors.items():
                if name not in out:
                    out[name] = row.new_zeros((len(indices), width, *row.shape[1:]))
                out[name][b, : row.shape[0]] = row
        return out
