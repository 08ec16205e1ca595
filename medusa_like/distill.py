"""Self-distillation: the frozen target answers the user turns of a conversation set with its own chat template.

Heads learn what the target will say, so they are trained on the target's own answers rather than on the original
ones (Medusa-2's self-distillation). The work is cut into chunks of `chunk_size` conversations; each finished chunk is
written atomically (`save_to_disk` into a temporary directory, then a rename), a re-run skips the chunks that exist,
and each chunk samples from its own seed, so an interrupted and resumed run writes exactly what an uninterrupted one
writes. `shard` / `num_shards` give every process a disjoint set of chunks; `combine` concatenates all chunks into
`<out_dir>/dataset` (`load_distilled`). Rows hold `id`, `group`, `input_ids` and `loss_mask` (1 on the assistant's
tokens and on the end-of-turn token of an answer that finished, 0 elsewhere).

Layout of `out_dir`: `recipe.json` (what was generated, checked on every re-run), `chunks/chunk-00000/...`,
`dataset/` (the combined dataset).
"""

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from datasets import Dataset, Features, Sequence, Value, concatenate_datasets, load_from_disk
from tqdm.auto import tqdm

from medusa_like.data.sources import load_conversations, user_turns
from medusa_like.targets import target_fingerprint

log = logging.getLogger(__name__)

FEATURES = Features(
    {
        "id": Value("string"),
        "group": Value("string"),
        "input_ids": Sequence(Value("int32")),
        "loss_mask": Sequence(Value("int8")),
    }
)


@dataclass(frozen=True)
class GenerationConfig:
    temperature: float = 0.3  # Medusa's self-distillation temperature; 0 = greedy
    top_p: float = 0.9
    top_k: int = 0  # 0 disables top-k (transformers would otherwise apply its default of 50)
    max_new_tokens: int = 256
    turns: str = "first"  # "first": answer the first user turn; "all": every turn, on the regenerated history
    max_prompt_tokens: int = 512  # conversations whose first prompt is longer are not selected
    max_length: int = 2048  # later turns stop once prompt + answer could exceed this
    seed: int = 0

    def __post_init__(self):
        if self.turns not in ("first", "all"):
            raise ValueError(f"turns must be 'first' or 'all', got {self.turns!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"need temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1; got {self.temperature}, {self.top_p}, "
                f"{self.max_new_tokens}"
            )


def select_conversations(source: str, num_conversations: int | None, tokenizer, gen: GenerationConfig, split="train"):
    """The first `num_conversations` conversations of `source` whose first prompt fits `gen.max_prompt_tokens`."""
    selected = []
    for conv in load_conversations(source, split=split):
        system, users = user_turns(conv)
        prompt = render(tokenizer, [*system, {"role": "user", "content": users[0]}], add_generation_prompt=True)
        if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= gen.max_prompt_tokens:
            selected.append(conv)
        if num_conversations is not None and len(selected) >= num_conversations:
            break
    if num_conversations is not None and len(selected) < num_conversations:
        log.warning("%s: only %d conversations fit max_prompt_tokens=%d", source, len(selected), gen.max_prompt_tokens)
    return selected


def run(
    model,
    tokenizer,
    conversations: list[dict],
    out_dir: str | Path,
    gen: GenerationConfig,
    batch_size: int = 32,
    chunk_size: int = 256,
    shard: int = 0,
    num_shards: int = 1,
    max_chunks: int | None = None,  # stop after writing this many new chunks (time-boxed runs); the rest resumes later
    target_name: str = "",
    progress: bool = True,
) -> Path | None:
    """Distil this shard's missing chunks; combine when every chunk exists. Returns the dataset path or None."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
    out_dir = Path(out_dir)
    num_chunks = -(-len(conversations) // chunk_size)
    _check_recipe(out_dir, _recipe(model, conversations, gen, chunk_size, num_chunks, target_name))
    todo = [c for c in range(shard, num_chunks, num_shards) if not _chunk_dir(out_dir, c).exists()]
    todo = todo[:max_chunks] if max_chunks is not None else todo
    turns = sum(_num_turns(conv, gen) for c in todo for conv in _chunk(conversations, c, chunk_size))
    bar = tqdm(total=turns, unit="answer", desc=f"distil shard {shard}/{num_shards}", disable=not progress)
    for c in todo:
        _clear_stale_tmp(out_dir, c)
        rows = distil_chunk(model, tokenizer, _chunk(conversations, c, chunk_size), gen, batch_size, c, bar)
        _save_atomic(Dataset.from_list(rows, features=FEATURES), _chunk_dir(out_dir, c))
    bar.close()
    return combine(out_dir, num_chunks) if _all_chunks_done(out_dir, num_chunks) else None


def distil_chunk(model, tokenizer, conversations, gen: GenerationConfig, batch_size: int, chunk_index: int, bar=None):
    """Answer the conversations of one chunk, turn by turn; returns the dataset rows."""
    torch.manual_seed(_chunk_seed(gen.seed, chunk_index))
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    states = []
    for conv in conversations:
        system, users = user_turns(conv)
        states.append({"conv": conv, "users": users, "messages": list(system), "finished": [], "alive": True})
    max_turns = max((len(s["users"]) for s in states), default=0) if gen.turns == "all" else 1
    started = time.perf_counter()
    generated = 0
    for turn in range(max_turns):
        todo = [s for s in states if s["alive"] and turn < len(s["users"])]
        prompts = []
        for s in todo:
            text = render(tokenizer, [*s["messages"], {"role": "user", "content": s["users"][turn]}], True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if turn > 0 and len(ids) + gen.max_new_tokens > gen.max_length:
                _stop(s, turn, gen, bar)
            else:
                prompts.append((len(ids), text, s))
        prompts.sort(key=lambda p: p[0])  # similar lengths per batch: less padding
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            answers = _generate(model, tokenizer, [text for _, text, _ in batch], gen, eos_ids, pad_id)
            for (_, _, s), (text, finished, n_tokens) in zip(batch, answers, strict=True):
                s["messages"] += [{"role": "user", "content": s["users"][turn]}, {"role": "assistant", "content": text}]
                s["finished"].append(finished)
                generated += n_tokens
                if not finished:  # a cut-off answer is no history to continue from
                    _stop(s, turn + 1, gen, bar)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.0f}", chunk=chunk_index)
    rows = []
    for s in states:
        if s["finished"]:
            input_ids, loss_mask = build_sample(tokenizer, s["messages"], s["finished"])
            rows.append(
                {"id": s["conv"]["id"], "group": s["conv"]["group"], "input_ids": input_ids, "loss_mask": loss_mask}
            )
    return rows


def build_sample(tokenizer, messages: list[dict], finished: list[bool]) -> tuple[list[int], list[int]]:
    """Tokenise a conversation with the chat template; the mask covers each answer and, if it finished, its end token."""
    text = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    mask = [0] * len(offsets)
    cursor, answer = 0, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = _locate(
            text, render(tokenizer, messages[:i], add_generation_prompt=True), message["content"], cursor
        )
        cursor = end
        inside = [j for j, (s, _) in enumerate(offsets) if start <= s < end]
        for j in inside:
            mask[j] = 1
        if finished[answer]:
            after = next((j for j, (s, e) in enumerate(offsets) if s >= end and e > s), None)
            if after is not None:
                mask[after] = 1
        answer += 1
    return list(enc["input_ids"]), mask


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template: self-distillation must use the target's own "
            f"template (set model.chat_template in the model config)"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def combine(out_dir: str | Path, num_chunks: int) -> Path:
    """Concatenate chunks 0..num_chunks-1 into `<out_dir>/dataset` (written once, atomically)."""
    out_dir = Path(out_dir)
    final = out_dir / "dataset"
    missing = [c for c in range(num_chunks) if not _chunk_dir(out_dir, c).exists()]
    if missing:
        raise FileNotFoundError(
            f"{out_dir}: cannot combine, {len(missing)} of {num_chunks} chunks missing: {missing[:8]}"
        )
    if not final.exists():
        parts = [load_from_disk(str(_chunk_dir(out_dir, c))) for c in range(num_chunks)]
        _save_atomic(concatenate_datasets(parts), final)
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


def check_finished_recipe(out_dir: str | Path, gen: GenerationConfig, num_conversations: int | None) -> None:
    """Refuse to reuse a finished dataset distilled with other generation settings or another size than requested."""
    path = Path(out_dir) / "recipe.json"
    if not path.exists():
        return
    found = json.loads(path.read_text())
    requested = {"generation": asdict(gen)}
    if num_conversations is not None:
        requested["num_conversations"] = num_conversations
    diff = {k: (found.get(k), v) for k, v in requested.items() if found.get(k) != v}
    if diff:
        raise ValueError(
            f"{out_dir} holds a distillation with another recipe (key: (on disk, requested)): {diff}; "
            f"use another data.name or delete the directory"
        )


def _generate(model, tokenizer, prompts: list[str], gen: GenerationConfig, eos_ids: list[int], pad_id: int):
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    sampling = {"do_sample": False}
    if gen.temperature > 0:
        sampling = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
    with torch.no_grad():
        out = model.generate(
            input_ids=enc["input_ids"].to(model.device),  # [B, P]
            attention_mask=enc["attention_mask"].to(model.device),  # [B, P]
            max_new_tokens=gen.max_new_tokens,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            **sampling,
        )
    answers = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():  # [B, new]
        stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
        content = row if stop is None else row[:stop]
        text = tokenizer.decode(content, skip_special_tokens=True)
        answers.append((text, stop is not None, len(content) + (stop is not None)))
    return answers


def _locate(text: str, prefix: str, content: str, cursor: int) -> tuple[int, int]:
    """Character span of an answer in the rendered conversation."""
    if text.startswith(prefix) and text.startswith(content, len(prefix)):
        return len(prefix), len(prefix) + len(content)
    for needle in (content, content.strip()):  # some templates trim the content
        start = text.find(needle, cursor)
        if start >= 0:
            return start, start + len(needle)
    raise ValueError(f"answer {content[:60]!r} not found in the rendered conversation: the chat template rewrites it")


def _stop(state: dict, next_turn: int, gen: GenerationConfig, bar) -> None:
    if state["alive"] and bar is not None and gen.turns == "all":
        bar.update(len(state["users"]) - next_turn)
    state["alive"] = False


def _num_turns(conv: dict, gen: GenerationConfig) -> int:
    return len(user_turns(conv)[1]) if gen.turns == "all" else 1


def _eos_ids(model, tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _chunk_seed(seed: int, chunk_index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{chunk_index}".encode()).digest()[:4], "big")


def _chunk(conversations: list[dict], index: int, size: int) -> list[dict]:
    return conversations[index * size : (index + 1) * size]


def _chunk_dir(out_dir: Path, index: int) -> Path:
    return out_dir / "chunks" / f"chunk-{index:05d}"


def _all_chunks_done(out_dir: Path, num_chunks: int) -> bool:
    return all(_chunk_dir(out_dir, c).exists() for c in range(num_chunks))


def _clear_stale_tmp(out_dir: Path, index: int) -> None:
    for stale in _chunk_dir(out_dir, index).parent.glob(f".{_chunk_dir(out_dir, index).name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _save_atomic(dataset: Dataset, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    restore = datasets.is_progress_bar_enabled()  # a bar per saved chunk would drown the distillation bar
    datasets.disable_progress_bars()
    try:
        dataset.save_to_disk(str(tmp))
    finally:
        if restore:
            datasets.enable_progress_bars()
    if path.exists():  # another process finished the same output first
        shutil.rmtree(tmp)
    else:
        tmp.rename(path)


def _recipe(model, conversations, gen: GenerationConfig, chunk_size: int, num_chunks: int, target_name: str) -> dict:
    ids = hashlib.sha256("\n".join(c["id"] for c in conversations).encode()).hexdigest()[:16]
    return {
        "target": target_name,
        "target_fingerprint": target_fingerprint(model.config),
        "generation": asdict(gen),
        "num_conversations": len(conversations),
        "conversation_ids_sha256": ids,
        "chunk_size": chunk_size,
        "num_chunks": num_chunks,
    }


def _check_recipe(out_dir: Path, recipe: dict) -> None:
    path = out_dir / "recipe.json"
    if path.exists():
        found = json.loads(path.read_text())
        diff = {k: (found.get(k), v) for k, v in recipe.items() if found.get(k) != v}
        if diff:
            raise ValueError(
                f"{out_dir} holds a distillation with another recipe (key: (on disk, requested)): {diff}; "
                f"use another data.name or delete the directory"
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".recipe.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(recipe, indent=2))
    tmp.replace(path)
