"""What a drafter learns from the frozen target, computed once and read back in every epoch: training's one disk cache
of the target's outputs, for every drafter kind.

    key = cache_key(weights_fingerprint(target), target.dtype, module.cache_content(), max_length)
    cache = TargetCache(dir, key)                       # refused if `dir` holds a cache made for another key
    cache.build(rows, compute, ...)                     # resumable: only rows missing from the manifest run
    fields = cache.get(indices, input_ids, lengths)     # {name: [B, T, ...]} as the key's `fields` name them

A training step needs the target's side of its batch, the same in every epoch: EAGLE-3's aux hidden states and its
labels (the target's top-k draft tokens with their log-probabilities, and which positions are labelled), Medusa heads'
last hidden state. The target's forward costs about as much as the drafter's step or more, so the cache turns every
epoch into drafter-only work. What is stored is the drafter module's choice (`DrafterModule.cacheable_outputs`); for
EAGLE-3 with SmolLM2, 3 aux layers and k = 64, 3456 + 256 + 1 bytes a token.

Rows are written in shards (`shard-XXXXX.safetensors`, tensors named `<row>.<field>`, read lazily with safetensors'
`safe_open`), each written atomically; `manifest.json` (also atomic, rewritten after each shard) lists every finished
row with its shard, length and a checksum of its token ids. A killed build keeps every finished shard and recomputes
the rest; a shard the manifest does not name is never read. The manifest's key (the target's weights fingerprint and
dtype, what the fields depend on, the longest row) must equal the run's, and every row read must match its checksum,
so a cache is never reused for other target weights (another checkpoint of the same architecture, a fine-tuned copy,
another dtype), another drafter's settings or another dataset: it is refused with the differences named. A shard that
cannot be read (truncated, damaged) is refused when the cache is opened, naming the shard; deleting that shard makes
the next run compute its rows again.
"""

import hashlib
import json
import logging
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from medusa_like.io import atomic_file, remove_stale_temporaries, write_json

log = logging.getLogger(__name__)
FORMAT = 2  # 2: keyed by the target's weights (1 was keyed by its architecture alone)
MANIFEST = "manifest.json"
BATCH_TOKENS = 4096  # padded tokens per target forward while a cache is built, unless the caller says otherwise
_WHERE = "drafter.module.target_cache_dir"  # the setting that points a run at a cache


class TargetCacheMismatchError(ValueError):
    """A target cache made for other target weights, other drafter settings or another dataset."""


class TargetCacheCorruptError(ValueError):
    """A target cache whose manifest or shard cannot be read."""


def vocab_digest(token_ids: torch.Tensor) -> str:
    """`<size>:<hash>` of a draft vocabulary's target token ids: equal for the same tokens in the same order only."""
    digest = hashlib.sha256(token_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]
    return f"{token_ids.numel()}:{digest}"


def cache_key(target_weights: str, target_dtype, content: dict, max_length: int = 0) -> dict:
    """What a cache's content depends on besides the rows themselves (checked per row by checksum): the target's
    weights (`targets.weights_fingerprint`) and dtype, the longest row, and the drafter module's `content`, which
    names the stored `fields` and every setting they depend on (`DrafterModule.cache_content`)."""
    if not content.get("fields"):
        raise ValueError(f"a target cache's content must name its fields, got {content!r}")
    return {
        "format": FORMAT,
        "target_weights": str(target_weights),
        "target_dtype": str(target_dtype),
        "max_length": int(max_length),
        **json.loads(json.dumps(content)),  # as the manifest holds it: tuples as lists
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
        remove_stale_temporaries(self.root)  # what a build killed inside a write left: never named by the manifest
        self.key = key
        self.fields = tuple(key["fields"])
        self.rows: dict[int, tuple[str, int, int]] = {}  # row -> (shard, length, checksum)
        manifest = self.root / MANIFEST
        if manifest.exists():
            self.rows = self._read_manifest(manifest)
        self._open: dict[str, object] = {}

    def _read_manifest(self, manifest: Path) -> dict[int, tuple[str, int, int]]:
        """The manifest's rows, after checking its key against the run's and every shard it names; the rows of a
        shard that was deleted are left out (computed again by `build`)."""
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            have, rows = data["key"], {int(i): tuple(v) for i, v in data["rows"].items()}
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
            raise TargetCacheCorruptError(
                f"{manifest} is not a target cache manifest ({err}): delete {self.root} to build the cache again"
            ) from err
        differing = [k for k in {**have, **self.key} if have.get(k) != self.key.get(k)]
        if differing:
            listed = ", ".join(f"{k}: cache {have.get(k)!r}, run {self.key.get(k)!r}" for k in differing)
            raise TargetCacheMismatchError(
                f"target cache {self.root} was made for other settings ({listed}): delete it or point {_WHERE} at "
                "another directory"
            )
        by_shard: dict[str, list[int]] = {}
        for index, (shard, _, _) in rows.items():
            by_shard.setdefault(shard, []).append(index)
        for shard, indices in by_shard.items():
            if not (self.root / shard).is_file():
                log.warning("target cache %s: shard %s is gone; its %d rows are computed again", self.root, shard,
                            len(indices))  # fmt: skip
                for index in indices:
                    del rows[index]
                continue
            names = self._shard_names(shard)
            missing = [i for i in indices for f in self.fields if f"{i}.{f}" not in names]
            if missing:
                self._corrupt(shard, f"it lacks row {missing[0]}, which the manifest places there")
        return rows

    def _shard_names(self, shard: str) -> set[str]:
        """The tensor names of `shard` (safetensors checks its header against the file's size)."""
        try:
            with safe_open(str(self.root / shard), framework="pt") as handle:
                return set(handle.keys())
        except (SafetensorError, OSError) as err:
            self._corrupt(shard, str(err))

    def _corrupt(self, shard: str, reason: str):
        raise TargetCacheCorruptError(
            f"target cache shard {self.root / shard} cannot be read ({reason}): delete that file and start the run "
            f"again to compute its rows again (or delete {self.root} to build the whole cache again)"
        )

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
        `compute(batch)` takes a right-padded batch (as `data.datamodule.PadCollator` makes) and returns the key's
        fields as [B, T, ...] tensors. Rows run in length order, batched up to `batch_tokens` padded tokens, so
        little is spent on padding; a shard is written every `shard_tokens` tokens, all that a kill can lose."""
        from medusa_like.data.datamodule import PadCollator

        cut = self.key["max_length"]  # a row is cached as the loader serves it: cut to the longest row
        todo = [{**r, "input_ids": r["input_ids"][:cut], "loss_mask": r["loss_mask"][:cut]} for r in rows]
        todo = sorted((r for r in todo if r["index"] not in self.rows), key=lambda r: len(r["input_ids"]))
        if not todo:
            return 0
        collate = PadCollator(self.key["max_length"])
        pending: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # row -> (its fields, its checksum)
        pending_tokens = 0
        with tqdm(total=sum(len(r["input_ids"]) for r in todo), desc="target cache", unit="tok") as bar:
            start = 0
            while start < len(todo):
                end = start + 1  # rows sorted by length: the last row of a batch is its widest
                while end < len(todo) and (end - start + 1) * len(todo[end]["input_ids"]) <= batch_tokens:
                    end += 1
                out = compute(collate(todo[start:end]))
                for b, row in enumerate(todo[start:end]):
                    n = len(row["input_ids"])
                    fields = {name: out[name][b, :n].contiguous().cpu() for name in self.fields}
                    pending[row["index"]] = (fields, row_checksum(row["input_ids"]))
                    pending_tokens += n
                    bar.update(n)
                if pending_tokens >= shard_tokens:
                    self._write_shard(pending)
                    pending_tokens = 0
                start = end
            if pending:
                self._write_shard(pending)
        return len(todo)

    def _write_shard(self, pending: dict[int, tuple[dict[str, torch.Tensor], int]]) -> None:
        """Write the pending rows as one shard, then the manifest naming them; empties `pending`. A kill inside the
        shard's write leaves a temporary (removed when the cache is opened again); a kill between the two writes, a
        shard no manifest names (skipped by the numbering, never read)."""
        number = len({shard for shard, _, _ in self.rows.values()})
        while (self.root / f"shard-{number:05d}.safetensors").exists():  # written before a kill, never named
            number += 1
        shard = f"shard-{number:05d}.safetensors"
        tensors = {f"{i}.{name}": t for i, (fields, _) in pending.items() for name, t in fields.items()}
        atomic_file(self.root / shard, lambda tmp: save_file(tensors, str(tmp)))
        for i, (fields, checksum) in pending.items():
            self.rows[i] = (shard, int(next(iter(fields.values())).shape[0]), checksum)
        pending.clear()
        rows = {str(i): list(v) for i, v in sorted(self.rows.items())}
        write_json(self.root / MANIFEST, {"key": self.key, "rows": rows})

    # ---- reading ----------------------------------------------------------------------------------------------
    def get(self, indices: list[int], input_ids: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields of rows `indices` as right-padded [B, T, ...] tensors (T = input_ids.shape[1], zeros past each
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
                    f"dataset or max_length): delete the cache or point {_WHERE} elsewhere"
                )
            for name in self.fields:
                row = self._read(shard, f"{index}.{name}")  # [n, ...]
                if name not in out:
                    out[name] = row.new_zeros((len(indices), width, *row.shape[1:]))
                out[name][b, :n] = row
        return out

    def _read(self, shard: str, name: str) -> torch.Tensor:
        try:
            if shard not in self._open:
                self._open[shard] = safe_open(str(self.root / shard), framework="pt")
            return self._open[shard].get_tensor(name)
        except (SafetensorError, OSError) as err:  # changed on disk since the cache was opened
            self._corrupt(shard, str(err))

    def bytes_per_token(self) -> float:
        """Bytes on disk per cached token (shards only)."""
        tokens = sum(n for _, n, _ in self.rows.values())
        size = sum(p.stat().st_size for p in self.root.glob("shard-*.safetensors"))
        return size / max(tokens, 1)
