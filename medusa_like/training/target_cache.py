"""What an EAGLE-3 drafter learns from the frozen target, computed once and read back in every epoch.

    cache = TargetCache(dir, key)                       # refused if `dir` holds a cache made for another key
    cache.build(target, rows, teacher_fn, ...)          # resumable: only rows missing from the manifest run
    aux, ids, logp, labelled = cache.get(indices, width, input_ids)

A training step needs two things from the target: the aux hidden states (the drafter's input) and the target's
distribution over the draft vocabulary at each supervised position (the labels). Both are the same in every epoch, and
the target's forward costs about as much as the drafter's unrolled steps, so the cache turns every epoch after the
first into drafter-only work. Per token it stores the aux states in bf16 (n_aux * h * 2 bytes), the top-k draft-token
ids (int16 when the draft vocabulary fits, else int32) with their log-probabilities (fp16), and whether the position
is labelled (the target's argmax is a draft token): for SmolLM2 with 3 aux layers and k = 64, 3456 + 256 + 1 bytes.

Rows are written in shards (`shard-XXXXX.safetensors`, tensors named `<row>.<field>`, read lazily with safetensors'
`safe_open`), each written atomically; `manifest.json` (also atomic, rewritten after each shard) lists every finished
row with its shard, length and a checksum of its token ids. A killed build keeps every finished shard and recomputes
the rest. The manifest's key (target fingerprint, draft vocabulary, aux layers, k, longest row, labelled positions)
must equal the run's, and every row read must match its checksum, so a cache is never reused for another target,
vocabulary, dataset or set of labelled positions.
"""

import hashlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from medusa_like.io import atomic_file, remove_stale_temporaries, write_json

FORMAT = 1
MANIFEST = "manifest.json"
FIELDS = ("aux", "topk_ids", "topk_logp", "labelled")
BATCH_TOKENS = 4096  # padded tokens per target forward while a cache is built, unless the caller says otherwise


class TargetCacheMismatchError(ValueError):
    """A target cache made for another target, draft vocabulary, aux layers, top-k or dataset."""


def cache_key(
    target_fingerprint: str,
    draft_token_ids: torch.Tensor,
    aux_layer_ids,
    top_k: int,
    max_length: int,
    train_on: str = "assistant",
):
    """What a cache's content depends on besides the rows themselves (checked per row by checksum). `train_on` names
    the positions that hold labels (`assistant` tokens only, or `all` real tokens), so a cache labelled only on the
    assistant's tokens is never read by a run that trains on every token."""
    vocab = hashlib.sha256(draft_token_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]
    return {
        "format": FORMAT,
        "target_fingerprint": target_fingerprint,
        "draft_vocab": f"{draft_token_ids.numel()}:{vocab}",
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "top_k": int(top_k),
        "max_length": int(max_length),
        "train_on": str(train_on),
    }


def row_checksum(input_ids: list[int] | torch.Tensor) -> int:
    """crc32 of a row's token ids as int64: ties a cached row to the dataset row it was computed from."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64)
    return zlib.crc32(ids.numpy().tobytes())


class TargetCache:
    def __init__(self, root: str | Path, key: dict):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"target cache {self.root} is a file, not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.root)
        self.key = key
        manifest = self.root / MANIFEST
        if manifest.exists():
            try:
                data = json.loads(manifest.read_text(encoding="utf-8"))
                have, rows = data["key"], data["rows"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise TargetCacheMismatchError(f"{manifest} is not a target cache manifest ({err})") from err
            differing = {k: (have.get(k), v) for k, v in key.items() if have.get(k) != v}
            if differing:
                listed = ", ".join(f"{k}: cache {a!r}, run {b!r}" for k, (a, b) in differing.items())
                raise TargetCacheMismatchError(
                    f"target cache {self.root} was made for other settings ({listed}): delete it or point "
                    "drafter.module.target_cache_dir at another directory"
                )
            self.rows = {int(i): tuple(v) for i, v in rows.items()}  # row -> (shard, length, checksum)
        else:
            self.rows = {}
        self._open: dict[str, object] = {}

    # ---- building ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def build(
        self,
        rows: list[dict],
        compute: Callable[[dict], dict[str, torch.Tensor]],
        batch_tokens: int = BATCH_TOKENS,
        shard_tokens: int = 32_768,
    ) -> int:
        """Compute and store every row of `rows` (dicts with `index`, `input_ids`, `loss_mask`; cut here to the key's
        `max_length`, as the training loader cuts them) not yet in the cache; returns how many were computed.
        `compute(batch)` takes a right-padded batch (as `data.datamodule.PadCollator` makes) and returns the FIELDS
        as [B, T, ...] tensors. Rows run in length order, batched up to `batch_tokens` padded tokens, so little is
        spent on padding; a shard is written every `shard_tokens` tokens, all that a kill can lose."""
        from medusa_like.data.datamodule import PadCollator

        cut = self.key["max_length"]  # a row is cached as the loader serves it: cut to the longest row
        todo = [{**r, "input_ids": r["input_ids"][:cut], "loss_mask": r["loss_mask"][:cut]} for r in rows]
        todo = sorted((r for r in todo if r["index"] not in self.rows), key=lambda r: len(r["input_ids"]))
        if not todo:
            return 0
        collate = PadCollator(self.key["max_length"])
        pending: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # row -> (its fields, its checksum)
        with tqdm(total=sum(len(r["input_ids"]) for r in todo), desc="target cache", unit="tok") as bar:
            start = 0
            while start < len(todo):
                end = start + 1  # rows sorted by length: the last row of a batch is its widest
                while end < len(todo) and (end - start + 1) * len(todo[end]["input_ids"]) <= batch_tokens:
                    end += 1
                out = compute(collate(todo[start:end]))
                for b, row in enumerate(todo[start:end]):
                    n = len(row["input_ids"])
                    fields = {name: out[name][b, :n].contiguous().cpu() for name in FIELDS}
                    pending[row["index"]] = (fields, row_checksum(row["input_ids"]))
                    bar.update(n)
                if sum(fields["aux"].shape[0] for fields, _ in pending.values()) >= shard_tokens:
                    self._write_shard(pending)
                start = end
            if pending:
                self._write_shard(pending)
        return len(todo)

    def _write_shard(self, pending: dict[int, tuple[dict[str, torch.Tensor], int]]) -> None:
        """Write the pending rows as one shard, then the manifest naming them; empties `pending`."""
        number = len({shard for shard, _, _ in self.rows.values()})
        while (self.root / f"shard-{number:05d}.safetensors").exists():  # written before a kill, never named
            number += 1
        shard = f"shard-{number:05d}.safetensors"
        tensors = {f"{i}.{name}": t for i, (fields, _) in pending.items() for name, t in fields.items()}
        atomic_file(self.root / shard, lambda tmp: save_file(tensors, str(tmp)))
        for i, (fields, checksum) in pending.items():
            self.rows[i] = (shard, int(fields["aux"].shape[0]), checksum)
        pending.clear()
        rows = {str(i): list(v) for i, v in sorted(self.rows.items())}
        write_json(self.root / MANIFEST, {"key": self.key, "rows": rows})

    # ---- reading ----------------------------------------------------------------------------------------------
    def get(self, indices: list[int], input_ids: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """The FIELDS of rows `indices` as right-padded [B, T, ...] tensors (T = input_ids.shape[1], zeros past each
        row's length); refused when a row is missing or was computed from other token ids."""
        width = input_ids.shape[1]
        out: dict[str, torch.Tensor] = {}
        for b, (index, n) in enumerate(zip(indices, lengths.tolist(), strict=True)):
            if index not in self.rows:
                raise KeyError(f"row {index} is not in the target cache {self.root}: build it first")
            shard, length, checksum = self.rows[index]
            if length != n or row_checksum(input_ids[b, :n].cpu()) != checksum:
                raise TargetCacheMismatchError(
                    f"row {index} of the target cache {self.root} was computed from other token ids (another "
                    "dataset or max_length): delete the cache or point drafter.module.target_cache_dir elsewhere"
                )
            handle = self._handle(shard)
            for name in FIELDS:
                row = handle.get_tensor(f"{index}.{name}")  # [n, ...]
                if name not in out:
                    out[name] = row.new_zeros((len(indices), width, *row.shape[1:]))
                out[name][b, :n] = row
        return out

    def _handle(self, shard: str):
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.root / shard), framework="pt")
        return self._open[shard]

    def bytes_per_token(self) -> float:
        """Bytes on disk per cached token (shards only)."""
        tokens = sum(n for _, n, _ in self.rows.values())
        size = sum(p.stat().st_size for p in self.root.glob("shard-*.safetensors"))
        return size / max(tokens, 1)
