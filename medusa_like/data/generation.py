"""Self-distillation: the frozen target answers the user turns of a conversation set with its own chat template.

Drafters learn what the target will say, so they can be trained on the target's own answers rather than on the
original ones (Medusa-2's self-distillation). The work is cut into chunks of `chunk_size` conversations; each chunk
samples from its own seed and is stored atomically (`storage.py`), so an interrupted and resumed run writes exactly what
an uninterrupted one writes. `shard` / `num_shards` give every process a disjoint set of chunks.

The answers come from an engine: transformers' `generate` on the loaded target (the default), this project's own
batched loop (`loop_generator`, `distill.engine=medusa_like`: each row leaves the batch when it stops, each row's
tokens its prompt's alone), or vLLM (`vllm_generator`, `distill.engine=vllm`), which batches and schedules the prompts
itself. All get the same prompt ids and sampling settings and return new token ids; what is stored is built from them
the same way.
"""

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from medusa_like.data.masks import build_sample, render
from medusa_like.data.sources import load_conversations, user_turns
from medusa_like.data.storage import CHUNK_SIZE, build_chunks, recipe
from medusa_like.targets import eos_token_ids

log = logging.getLogger(__name__)


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


# An engine: (prompt ids, sampling settings, EOS ids, seed, batch size) -> the new token ids of each prompt; prompt i
# samples from seed + i where the engine seeds per prompt, and at most `batch size` prompts decode at once
Generator = Callable[[list[list[int]], GenerationConfig, list[int], int, int], list[list[int]]]
ENGINES = ("transformers", "medusa_like", "vllm")


def check_engine(name) -> str:
    """`name` if it names an engine of ENGINES, else a ValueError saying which ones there are."""
    if name not in ENGINES:
        raise ValueError(f"expected one of {list(ENGINES)}, got {name!r}")
    return name


def run(
    model,
    tokenizer,
    conversations: list[dict],
    out_dir: str | Path,
    gen: GenerationConfig,
    batch_size: int = 32,
    chunk_size: int = CHUNK_SIZE,
    shard: int = 0,
    num_shards: int = 1,
    max_chunks: int | None = None,  # stop after writing this many new chunks (time-boxed runs); the rest resumes later
    target_name: str = "",
    source: str = "",
    progress: bool = True,
    generator: Generator | None = None,  # None: transformers' generate on `model`
    engine: str = "transformers",  # the name of `generator`'s engine, recorded in the data's recipe
) -> Path | None:
    """Distil this shard's missing chunks; combine when every chunk exists. Returns the dataset path or None."""
    settings = recorded_settings(gen, engine)
    made_of = recipe(model, conversations, "distilled", source, settings, chunk_size, target_name)
    turns = {conv["id"]: _num_turns(conv, gen) for conv in conversations}
    generator = generator or transformers_generator(model, tokenizer)

    def rows(chunk: list[dict], index: int, bar) -> list[dict]:
        return distil_chunk(generator, tokenizer, chunk, gen, batch_size, index, bar, eos_token_ids(model, tokenizer))

    return build_chunks(
        out_dir, conversations, chunk_size, made_of, rows, shard, num_shards, max_chunks, progress, "answer", turns
    )


def distil_chunk(
    generator: Generator, tokenizer, conversations, gen: GenerationConfig, batch_size: int, chunk_index: int, bar,
    eos_ids: list[int],
):  # fmt: skip
    """Answer the conversations of one chunk, turn by turn; returns the dataset rows."""
    chunk_seed = _chunk_seed(gen.seed, chunk_index)
    torch.manual_seed(chunk_seed)
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
        per_call = batch_size * BATCHES_PER_CALL
        for b in range(0, len(prompts), per_call):
            called = prompts[b : b + per_call]
            ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for _, text, _ in called]
            seed = chunk_seed + turn * _TURN_SEEDS + b  # prompt b + i of a turn: seed + i, whatever the grouping
            answers = _answers(generator(ids, gen, eos_ids, seed, batch_size), tokenizer, eos_ids)
            for (_, _, s), (text, finished, n_tokens) in zip(called, answers, strict=True):
                s["messages"] += [{"role": "user", "content": s["users"][turn]}, {"role": "assistant", "content": text}]
                s["finished"].append(finished)
                generated += n_tokens
                if not finished:  # a cut-off answer is no history to continue from
                    _stop(s, turn + 1, gen, bar)
            if bar is not None:
                bar.update(len(called))
                bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.0f}", chunk=chunk_index)
    rows = []
    for s in states:
        if s["finished"]:
            input_ids, loss_mask = build_sample(tokenizer, s["messages"], s["finished"])
            rows.append(
                {"id": s["conv"]["id"], "group": s["conv"]["group"], "input_ids": input_ids, "loss_mask": loss_mask}
            )
    return rows


def transformers_generator(model, tokenizer) -> Generator:
    """transformers' `generate` on `model`, `batch_size` left-padded prompts at a time, each batch until its longest
    answer ends (its RNG seeded per chunk)."""

    def generate(prompt_ids: list[list[int]], gen: GenerationConfig, eos_ids: list[int], seed: int, batch_size: int):
        return [
            row
            for b in range(0, len(prompt_ids), batch_size)
            for row in batch(prompt_ids[b : b + batch_size], gen, eos_ids)
        ]

    def batch(prompt_ids: list[list[int]], gen: GenerationConfig, eos_ids: list[int]) -> list[list[int]]:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        enc = tokenizer.pad({"input_ids": prompt_ids}, padding=True, padding_side="left", return_tensors="pt")
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
        return out[:, enc["input_ids"].shape[1] :].tolist()  # [B, new]

    return generate


def loop_generator(model) -> Generator:
    """This project's batched loop (`model`: a `MedusaLikeModel` on the target), plain decoding (`tree="none"`),
    `batch_size` rows at a time, a finished row's place taken by the next prompt (continuous batching); prompt i of a
    call samples from seed + i, as under vLLM. A row's tokens are the ones its prompt gets decoded alone with that
    seed (docs/decoding.md, "Batched decoding"), so a chunk's answers do not depend on the batch size."""

    def generate(prompt_ids: list[list[int]], gen: GenerationConfig, eos_ids: list[int], seed: int, batch_size: int):
        outs = model.generate(
            [torch.tensor(ids) for ids in prompt_ids], gen.max_new_tokens, tree="none", temperature=gen.temperature,
            top_k=gen.top_k, top_p=gen.top_p, seed=[seed + i for i in range(len(prompt_ids))], eos_token_id=eos_ids,
            remember=False, batch_size=batch_size,
        )  # fmt: skip
        return [out.new_tokens.tolist() for out in outs]

    return generate


def vllm_generator(engine) -> Generator:
    """vLLM (an `engines.vllm.driver.VllmEngine` on the same target) given every prompt of a call at once, batched by
    its own scheduler (`batch_size` unused); prompt i of a call samples from seed + i."""

    def generate(prompt_ids: list[list[int]], gen: GenerationConfig, eos_ids: list[int], seed: int, batch_size: int):
        out = engine.generate(
            prompt_ids, gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
            stop_token_ids=eos_ids, seed=seed,
        )  # fmt: skip
        return [o["token_ids"] for o in out.outputs]

    return generate


def recorded_settings(gen: GenerationConfig, engine: str) -> dict:
    """What a distilled data directory's recipe records of how its answers were made: the generation settings, and
    the engine where it is not transformers' (whose directories predate the choice)."""
    return asdict(gen) if engine == "transformers" else {**asdict(gen), "engine": engine}


def until_eos(row: list[int], eos_ids: list[int]) -> tuple[list[int], bool]:
    """A row of new token ids up to its first EOS (excluded; anything after it is a batch's padding), and whether it
    had one."""
    stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
    return (row, False) if stop is None else (row[:stop], True)


def _answers(rows: list[list[int]], tokenizer, eos_ids: list[int]) -> list[tuple[str, bool, int]]:
    """(text, ended with EOS, tokens generated) of each row of new token ids."""
    answers = []
    for row in rows:
        content, ended = until_eos(row, eos_ids)
        answers.append((tokenizer.decode(content, skip_special_tokens=True), ended, len(content) + ended))
    return answers


def _stop(state: dict, next_turn: int, gen: GenerationConfig, bar) -> None:
    if state["alive"] and bar is not None and gen.turns == "all":
        bar.update(len(state["users"]) - next_turn)
    state["alive"] = False


def _num_turns(conv: dict, gen: GenerationConfig) -> int:
    return len(user_turns(conv)[1]) if gen.turns == "all" else 1


_TURN_SEEDS = 1 << 20  # seeds per turn of a chunk: prompt offsets stay below it
# prompts an engine call answers: a continuous batch stays full until its last batch's worth drains, and the progress
# bar moves once a call
BATCHES_PER_CALL = 4


def _chunk_seed(seed: int, chunk_index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{chunk_index}".encode()).digest()[:4], "big")
