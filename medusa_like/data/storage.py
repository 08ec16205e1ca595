"""Chunked, resumable storage of training rows (`id`, `group`, `input_ids`, `loss_mask`) and the recipe check.

Layout of a data directory: `recipe.json` (what the rows were made from, checked on every re-run: any difference is
refused), `chunks/chunk-00000/...` (each written atomically), `dataset/` (all chunks combined, written once). Next to it,
`.<name>.build-shard<i>-of-<n>.lock` is held by the process building that shard (`build_lock`): outside the directory,
so that a build refused before it starts leaves no directory behind.
"""

import hashlib
import json
from contextlib import AbstractContextManager
from pathlib import Path

import datasets
from datasets import Dataset, Features, Sequence, Value, concatenate_datasets, load_from_disk
from tqdm.auto import tqdm

from medusa_like.io import atomic_directory, exclusive_lock, remove_stale_temporaries, write_json
from medusa_like.targets import target_fingerprint

CHUNK_SIZE = 256  # conversations per resumable chunk when a build names no size
FEATURES = Features(
    {
        "id": Value("string"),
        "group": Value("string"),
        "input_ids": Sequence(Value("int32")),
        "loss_mask": Sequence(Value("int8")),
    }
)


def combine(out_dir: str | Path, num_chunks: int) -> Path:
    """Concatenate chunks 0..num_chunks-1 into `<out_dir>/dataset` (written once, atomically)."""
    out_dir = Path(out_dir)
    final = out_dir / "dataset"
    missing = [c for c in range(num_chunks) if not chunk_dir(out_dir, c).exists()]
    if missing:
        raise FileNotFoundError(
            f"{out_dir}: cannot combine, {len(missing)} of {num_chunks} chunks missing: {missing[:8]}"
        )
    if not final.exists():
        parts = [load_from_disk(str(chunk_dir(out_dir, c))) for c in range(num_chunks)]
        save_dataset(concatenate_datasets(parts), final)
    return final


def load_distilled(out_dir: str | Path) -> Dataset:
    path = Path(out_dir) / "dataset"
    if not path.exists():
        raise FileNotFoundError(
            f"no distilled dataset at {path}: run `python -m train.distill` with the same model and data overrides "
            f"(or train with distill_if_missing=true)"
        )
    return load_from_disk(str(path))


def is_complete(out_dir: str | Path) -> bool:
    return (Path(out_dir) / "dataset").exists()


def build_lock(out_dir: str | Path, shard: int = 0, num_shards: int = 1) -> AbstractContextManager:
    """The lock held while shard `shard` of `num_shards` of `out_dir` is built (other shards build alongside)."""
    out_dir = Path(out_dir)
    path = out_dir.with_name(f".{out_dir.name}.build-shard{shard}-of-{num_shards}.lock")
    return exclusive_lock(path, waiting=f"another process is building shard {shard} of {out_dir}")


def chunk_dir(out_dir: Path, index: int) -> Path:
    return out_dir / "chunks" / f"chunk-{index:05d}"


def all_chunks_done(out_dir: Path, num_chunks: int) -> bool:
    return all(chunk_dir(out_dir, c).exists() for c in range(num_chunks))


def recipe(model, conversations, kind: str, source: str, generation: dict | None, chunk_size: int, target_name: str):
    """What a data directory is made from: any difference on a re-run, or before training, is refused."""
    ids = hashlib.sha256("\n".join(c["id"] for c in conversations).encode()).hexdigest()[:16]
    return {
        "recipe": kind,
        "source": source,
        "target": target_name,
        "target_fingerprint": target_fingerprint(model.config),
        "generation": generation,
        "num_conversations": len(conversations),
        "conversation_ids_sha256": ids,
        "chunk_size": chunk_size,
        "num_chunks": -(-len(conversations) // chunk_size),
    }


def build_chunks(
    out_dir: str | Path,
    conversations: list[dict],
    chunk_size: int,
    made_of: dict,
    make_rows,  # (conversations of one chunk, chunk index, progress bar) -> rows
    shard: int = 0,
    num_shards: int = 1,
    max_chunks: int | None = None,
    progress: bool = True,
    unit: str = "conversation",
    work: dict | None = None,  # conversation id -> units of work, for the progress bar (default 1 each)
) -> Path | None:
    """Make and store this shard's missing chunks; combine them when every chunk exists. Returns the dataset path, or
    None while other shards' chunks are missing. Nothing is written before the conversations are found non-empty."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
    if not conversations:
        raise ValueError(f"no conversations to build {out_dir} from: the source is empty or none has a user turn")
    out_dir = Path(out_dir)
    check_recipe(out_dir, made_of)
    num_chunks = made_of["num_chunks"]
    todo = [c for c in range(shard, num_chunks, num_shards) if not chunk_dir(out_dir, c).exists()]
    todo = todo[:max_chunks] if max_chunks is not None else todo
    chunks = {c: conversations[c * chunk_size : (c + 1) * chunk_size] for c in todo}
    total = sum((work or {}).get(conv["id"], 1) for chunk in chunks.values() for conv in chunk)
    bar = tqdm(total=total, unit=unit, desc=f"{out_dir.name} shard {shard}/{num_shards}", disable=not progress)
    for c, chunk in chunks.items():
        remove_stale_temporaries(chunk_dir(out_dir, c).parent)
        save_dataset(make_rows(chunk, c, bar), chunk_dir(out_dir, c))
    bar.close()
    return combine(out_dir, num_chunks) if all_chunks_done(out_dir, num_chunks) else None


def check_recipe(out_dir: Path, recipe: dict) -> None:
    path = out_dir / "recipe.json"
    if path.exists():
        found = json.loads(path.read_text())
        diff = {k: (found.get(k), v) for k, v in recipe.items() if found.get(k) != v}
        if diff:
            raise ValueError(
                f"{out_dir} holds data made with another recipe (key: (on disk, requested)): {diff}; "
                f"use another data.name or delete the directory"
            )
        return
    write_json(path, recipe)


def save_dataset(rows: "list[dict] | Dataset", path: Path) -> None:
    """Write rows as a `datasets` directory at `path`, atomically; a copy another process finished first is kept."""
    dataset = rows if isinstance(rows, Dataset) else Dataset.from_list(rows, features=FEATURES)
    restore = datasets.is_progress_bar_enabled()  # a bar per saved chunk would drown the distillation bar
    datasets.disable_progress_bars()
    try:
        with atomic_directory(path, exist_ok=True) as tmp:
            dataset.save_to_disk(str(tmp))
    finally:
        if restore:
            datasets.enable_progress_bars()
