"""On-disk cache of the target's last hidden states, one safetensors file per dataset row.

The frozen target's forward is the same in every epoch; with the cache on, the first epoch writes each row's hidden
states [T, H] and later epochs read them back instead of running the target. Files are written atomically
(`io.atomic_file`: no temporary survives a failed write, and a killed run's are removed when the cache is opened again),
so several ranks may share one cache directory. It costs T * H * bytes per row (SmolLM2: ~2.3 KB per token in fp32).
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from medusa_like.io import atomic_file, remove_stale_temporaries


class HiddenStateCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.root)

    def _path(self, index: int) -> Path:
        return self.root / f"{index}.safetensors"

    def get(self, indices: list[int], width: int) -> torch.Tensor | None:
        """Hidden states [B, width, H] of rows `indices` (zero past each row's length), or None if any is missing."""
        paths = [self._path(i) for i in indices]
        if not all(p.exists() for p in paths):
            return None
        rows = [load_file(str(p))["hidden"] for p in paths]  # each [T_i, H]
        out = rows[0].new_zeros((len(rows), width, rows[0].shape[-1]))  # [B, width, H]
        for b, row in enumerate(rows):
            n = min(row.shape[0], width)
            out[b, :n] = row[:n]
        return out

    def put(self, indices: list[int], hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """Store hidden [B, T, H] of rows `indices`, each cut to its length (lengths [B])."""
        for index, row, n in zip(indices, hidden.detach().cpu(), lengths.tolist(), strict=True):
            tensors = {"hidden": row[:n].contiguous()}  # [T_i, H]
            atomic_file(self._path(index), lambda tmp, tensors=tensors: save_file(tensors, str(tmp)))

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
