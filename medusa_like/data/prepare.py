"""From a Hydra config to what training needs: the frozen target, and its training rows on disk.

Shared by the `train.distill` and `train.train` entry points (and by evaluation for the model): the rule for which
rows a data config means lives here, once. A data directory records its recipe (`storage.recipe`: the source, the
conversation ids, the target's fingerprint, the generation settings); asking for different data in the same
directory is refused before anything is trained or written. Building takes a lock file next to the data directory (one per
shard), so two runs that need the same rows at once build them once: the second waits, then finds them built.
"""

import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from medusa_like.data import conversation_text, generation
from medusa_like.data.storage import build_lock, check_recipe, is_complete, load_distilled, recipe
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.engines.vllm.driver import VllmEngine, target_directory
from medusa_like.model import MedusaLikeModel

log = logging.getLogger(__name__)


def load_model(model_cfg: DictConfig, **overrides):
    """(frozen target, tokenizer) from a `model/` config, with the config's chat template if it sets one.

    `overrides` replace arguments of the config's loader (e.g. dtype=...)."""
    target, tokenizer = instantiate(model_cfg.loader, **overrides)
    if model_cfg.get("chat_template"):
        tokenizer.chat_template = model_cfg.chat_template
    return target, tokenizer


def _generation_config(data: DictConfig) -> generation.GenerationConfig:
    return generation.GenerationConfig(**OmegaConf.to_container(data.generation, resolve=True))


def build_dataset(cfg: DictConfig, target, tokenizer, shard: int = 0, num_shards: int = 1, max_chunks=None):
    """Build (or resume building) the rows `cfg.data` describes into `cfg.data.dir`; the dataset path, or None while
    other shards' chunks are missing. Another process building the same shard of the same directory is waited for."""
    with build_lock(cfg.data.dir, shard, num_shards):
        return _build_dataset(cfg, target, tokenizer, shard, num_shards, max_chunks)


def _build_dataset(cfg: DictConfig, target, tokenizer, shard: int, num_shards: int, max_chunks):
    data = cfg.data
    common = dict(  # what both recipes' builders take alike
        model=target,
        tokenizer=tokenizer,
        out_dir=data.dir,
        chunk_size=data.chunk_size,
        target_name=cfg.model.name_or_path,
        source=str(data.source),
        progress=cfg.distill.progress,
    )
    if data.recipe == "original":
        conversations = conversation_text.select(data.source, data.num_conversations, split=data.split)
        log.info("reading %d conversations from %s into %s", len(conversations), data.source, data.dir)
        return conversation_text.run(conversations=conversations, max_length=data.generation.max_length, **common)
    if data.recipe != "distilled":
        raise ValueError(f"data.recipe must be 'distilled' or 'original', got {data.recipe!r}")
    gen = _generation_config(data)
    engine = generation.check_engine(cfg.distill.get("engine") or "transformers")
    conversations = generation.select_conversations(data.source, data.num_conversations, tokenizer, gen, data.split)
    log.info("distilling %d conversations from %s into %s with %s", len(conversations), data.source, data.dir, engine)
    with _generator(engine, target, tokenizer, gen, cfg.distill.get("vllm_args")) as generator:
        return generation.run(
            conversations=conversations,
            gen=gen,
            batch_size=cfg.distill.batch_size,
            shard=shard,
            num_shards=num_shards,
            max_chunks=max_chunks,
            generator=generator,
            engine=engine,
            **common,
        )


@contextmanager
def _generator(engine: str, target, tokenizer, gen: generation.GenerationConfig, vllm_args=None):
    """The answers' engine for a whole build: None (transformers on `target`), or vLLM started once on the same
    weights (a model built in memory is saved for it to a temporary directory first), with `vllm_args` passed to
    vLLM's `LLM`."""
    if engine == "transformers":
        yield None
        return
    if engine == "medusa_like":
        # plain decoding needs no drafter; the target's own layers are kept (tuned_layers=False): training reads
        # its features from the same model afterwards
        yield generation.loop_generator(MedusaLikeModel(target, tokenizer, LookupDrafter(), tuned_layers=False))
        return
    with tempfile.TemporaryDirectory(prefix="medusa_like_vllm_") as scratch:
        model_dir = target_directory(target, tokenizer, scratch)
        dtype = str(target.dtype).removeprefix("torch.")
        args = dict(vllm_args or {})
        with VllmEngine(model_dir, dtype=dtype, max_model_len=gen.max_length, **args) as vllm:
            yield generation.vllm_generator(vllm)


def ensure_dataset(cfg: DictConfig, target, tokenizer) -> Path:
    """The training rows of `cfg.data`: checked against what `cfg.data.dir` was made from, built if missing (when
    `cfg.distill_if_missing`)."""
    data = cfg.data
    if is_complete(data.dir):
        if data.recipe == "original":
            conversations = conversation_text.select(data.source, data.num_conversations, split=data.split)
            made_of = {"max_length": data.generation.max_length}
        else:
            gen = _generation_config(data)
            conversations = generation.select_conversations(
                data.source, data.num_conversations, tokenizer, gen, data.split
            )
            made_of = generation.recorded_settings(gen, cfg.distill.get("engine") or "transformers")
        check_recipe(
            Path(data.dir),
            recipe(
                target, conversations, data.recipe, str(data.source), made_of, data.chunk_size, cfg.model.name_or_path
            ),
        )
        return Path(data.dir) / "dataset"
    if not cfg.get("distill_if_missing", True):
        load_distilled(data.dir)  # raises with the command to run
    path = build_dataset(cfg, target, tokenizer)
    if path is None:
        raise RuntimeError(f"{data.dir}: the dataset is incomplete (other shards' chunks are missing)")
    log.info("dataset complete: %s (%d rows)", path, len(load_distilled(data.dir)))
    return path
