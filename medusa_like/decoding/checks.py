"""`generate`'s arguments, checked before any work: numbers of the right type and range, token ids of the target,
a prompt of one sequence, and room for the answer and the tree in the KV cache and the target's positions. Each
refusal is one line naming the bad value and what was expected."""

import math
from contextlib import contextmanager
from numbers import Integral, Real

import torch

from .kv_cache import CacheOverflowError
from .sampling import check_top_p
from .tree import check_drafter, reach


def check_integer(name: str, value, minimum: int, maximum: int | None = None, optional: bool = False) -> None:
    """`value` must be an integer in [minimum, maximum] (None too when `optional`); a bool is not an integer here."""
    if value is None and optional:
        return
    if not isinstance(value, Integral) or isinstance(value, bool):
        expected = "an integer or None" if optional else "an integer"
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum or (maximum is not None and value > maximum):
        within = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {within}, got {value!r}")


def check_number(name: str, value) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    check_number("temperature", temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    check_integer("top_k", top_k, 0)  # 0 disables it
    check_number("top_p", top_p)
    check_top_p(top_p)


def check_lengths(max_new_tokens: int, max_cache_len: int | None) -> None:
    check_integer("max_new_tokens", max_new_tokens, 1)
    check_integer("max_cache_len", max_cache_len, 1, optional=True)


def sampling_generator(seed: int | None, device) -> torch.Generator | None:
    """A generator on `device` seeded with `seed` (None: None, so torch's default generator draws)."""
    check_integer("seed", seed, 0, 2**64 - 1, optional=True)
    return None if seed is None else torch.Generator(device).manual_seed(seed)


def row_seeds(seed, rows: int, batch: bool) -> list:
    """Each row's seed: `seed` (an int or None) for every row, or a batch's list of one per prompt."""
    if not isinstance(seed, (list, tuple)):
        return [seed] * rows
    if not batch or len(seed) != rows:
        what = f"a batch of {rows} prompts" if batch else "one prompt"
        raise ValueError(f"seed: a list of {len(seed)} seeds for {what}; give one seed, or one per prompt of a batch")
    return list(seed)


def token_ids(name: str, ids, vocab: int) -> list[int]:
    """`ids` (one id or a list of them) as a list of the target's token ids, or a TypeError/ValueError naming `name`."""
    listed = [ids] if isinstance(ids, Integral) and not isinstance(ids, bool) else ids
    if not isinstance(listed, (list, tuple)) or not all(
        isinstance(t, Integral) and not isinstance(t, bool) for t in listed
    ):
        raise TypeError(f"{name} must be a token id or a list of token ids, got {ids!r}")
    if any(not 0 <= t < vocab for t in listed):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}) (the target's vocabulary), got {ids!r}")
    return [int(t) for t in listed]


def prompt_tensor(input_ids) -> torch.Tensor:
    """A prompt as token ids [1, T]: a tensor [1, T] or [T], or a list of ints (a list of lists is a batch:
    `batch_prompts`)."""
    if isinstance(input_ids, (list, tuple)):
        if len(input_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        try:
            input_ids = torch.tensor(input_ids)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"input_ids must be a tensor or a list of token ids, got {str(input_ids)[:60]}: {err}"
            ) from err
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        input_ids = input_ids[None]
    return input_ids


def check_prompt(target, input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [1, T], got {type(input_ids).__name__}")
    if input_ids.numel() == 0:  # before the dtype: an empty list becomes a float tensor
        raise ValueError("the prompt is empty: give at least one token")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}")
    if input_ids.device.type == "meta":  # before any value is read: torch's own error would say nothing of the prompt
        raise ValueError(
            f"input_ids is on the meta device, which holds shapes, not values: give the prompt's token ids on the CPU "
            f"or the target's device ({target.device})"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids [1, T] is one sequence; got {tuple(input_ids.shape)}: to decode several prompts at once, pass "
            "a list of prompts (each a tensor [T] or [1, T], or a list of token ids)"
        )
    vocab = target.config.get_text_config().vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(
            f"prompt token ids must lie in [0, {vocab}) (the target's vocabulary), got {int(input_ids.min())}.."
            f"{int(input_ids.max())}"
        )


def check_context(target, prompt_len: int, max_new_tokens: int, spec) -> None:
    """Refuse a prompt whose answer cannot fit the target's positions. The target reads the prompt, then per step the
    last token (at most the (max_new_tokens - 1)-th new one: the last new token is never read) and the tree's nodes
    up to `tree.reach` past it; one new token is the prefill's alone. So prompt + max_new_tokens - 1 + that reach
    must stay within `max_position_embeddings`."""
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    ahead = reach(spec) if max_new_tokens > 1 else 0
    if max_positions is not None and prompt_len + max_new_tokens - 1 + ahead > max_positions:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) - 1 + the positions a tree step reaches past "
            f"the last token ({ahead}) exceeds the target's max_position_embeddings ({max_positions})"
        )


def check_room(target, prompt_len: int, spec, max_new_tokens: int, max_cache_len: int | None) -> int:
    """Refuse an answer that cannot fit the KV cache or the target's positions; return the KV cache capacity."""
    needed = prompt_len + max_new_tokens + spec.max_nodes
    capacity = max_cache_len if max_cache_len is not None else needed
    if needed > capacity:
        raise CacheOverflowError(
            f"KV cache of {capacity} tokens is too small for a {prompt_len}-token prompt, {max_new_tokens} new tokens "
            f"and a {spec.max_nodes}-node tree (needs {needed})"
        )
    check_context(target, prompt_len, max_new_tokens, spec)
    return capacity


def check_inputs(
    target,
    proposer,
    input_ids,
    spec,
    max_new_tokens: int,
    max_cache_len: int | None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> int:
    """Refuse, before anything runs, what cannot work (the one check of the loop's arguments); return the KV cache
    capacity."""
    check_lengths(max_new_tokens, max_cache_len)
    check_sampling(temperature, top_k, top_p)
    check_prompt(target, input_ids)
    check_spec(spec, [proposer])
    return check_room(target, input_ids.shape[1], spec, max_new_tokens, max_cache_len)


def check_spec(spec, proposers: list) -> None:
    """`spec` must be a tree spec every proposer can fill."""
    if not hasattr(spec, "learned_part"):  # a preset's name, a dict or a file: `generate` resolves those, not the loop
        raise TypeError(
            f"tree {str(spec)[:60]!r}: the loop takes a tree spec (decoding/tree.py); MedusaLikeModel.generate, or "
            "its resolve_tree, turns presets, dicts, rank paths and tree files into one"
        )
    for proposer in proposers:
        check_drafter(spec, proposer.max_depth, proposer.max_rank)


# ---------------------------------------------------------------------------------------------------------------------
# A batch of prompts


def is_batch(input_ids) -> bool:
    """Whether `input_ids` is a list of prompts (its first a tensor or a list of ids), not one prompt's token ids."""
    return (
        isinstance(input_ids, (list, tuple))
        and len(input_ids) > 0
        and isinstance(input_ids[0], (torch.Tensor, list, tuple))
    )


def batch_prompts(prompts) -> list[torch.Tensor]:
    """A batch's prompts as token ids [1, T] each (`prompt_tensor`'s forms), refused with the prompt's index."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"a batch is a non-empty list of prompts, got {str(prompts)[:60]}")
    out = []
    for index, prompt in enumerate(prompts):
        with naming_prompt(index):
            out.append(prompt_tensor(prompt))
    return out


@contextmanager
def naming_prompt(index: int):
    """A refusal raised in the block names prompt `index` of the batch."""
    try:
        yield
    except (TypeError, ValueError) as err:
        raise type(err)(f"prompt {index} of the batch: {err}") from err


def check_batch_room(target, lengths: list[int], spec, max_new_tokens: int, max_cache_len: int | None) -> int:
    """Refuse a batch whose longest row cannot fit the KV cache (every row gets the same capacity) or the target's
    positions, saying which prompt and what fits; return the capacity."""
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    needed = lengths[longest] + max_new_tokens + spec.max_nodes
    capacity = max_cache_len if max_cache_len is not None else needed
    if needed > capacity:
        raise CacheOverflowError(
            f"KV cache of {capacity} tokens per row is too small for prompt {longest} of the batch ({lengths[longest]} "
            f"tokens) + {max_new_tokens} new tokens + a {spec.max_nodes}-node tree (needs {needed}): prompts of up to "
            f"{capacity - max_new_tokens - spec.max_nodes} tokens fit, or max_cache_len={needed} fits this batch"
        )
    with naming_prompt(longest):
        check_context(target, lengths[longest], max_new_tokens, spec)
    return capacity


def check_batch(
    target,
    proposers: list,
    prompts: list[torch.Tensor],
    spec,
    max_new_tokens: int,
    max_cache_len: int | None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> int:
    """`check_inputs` for a batch of prompts [1, T_b] with one proposer per row, before any work; returns the KV
    cache capacity of every row."""
    check_lengths(max_new_tokens, max_cache_len)
    check_sampling(temperature, top_k, top_p)
    if len(proposers) != len(prompts):
        raise ValueError(f"a batch needs one proposer per prompt: {len(proposers)} for {len(prompts)} prompts")
    for index, prompt in enumerate(prompts):
        with naming_prompt(index):
            check_prompt(target, prompt)
    if len({p.device for p in prompts}) > 1:
        raise ValueError(f"a batch's prompts must share a device, got {sorted({str(p.device) for p in prompts})}")
    layers = {tuple(p.feature_layers) if p.feature_layers is not None else None for p in proposers}
    if len(layers) > 1:
        raise ValueError(
            f"a batch's proposers read the same target features, got feature layers {sorted(map(str, layers))}"
        )
    check_spec(spec, proposers)
    return check_batch_room(target, [p.shape[1] for p in prompts], spec, max_new_tokens, max_cache_len)
