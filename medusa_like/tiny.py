"""Tiny randomly initialised targets of several families, built from a config with nothing downloaded.

They stand in for real targets in tests and smoke runs: `tiny_model` for tests (a model alone, any vocabulary size,
real sliding windows), `tiny_chat_target` for the Hydra model configs (`model=tiny_llama`, `model=tiny_qwen2`): a
(model, tokenizer) pair loaded like `targets.load_target`'s, which borrows the embedded default's tokenizer (its chat
template and its 49,152-token vocabulary) so data and templates stay realistic while the model runs in milliseconds.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from medusa_like.targets import DEFAULT_TARGET, freeze, resolve_target

FAMILIES = ("llama", "qwen2", "mistral", "gemma3")


def tiny_config(family: str, vocab_size: int, sliding_window: int | None = None, **fields):
    """A small config of `family`. With `sliding_window`, the windowed families really slide: Qwen2's second layer,
    Mistral's every layer, Gemma 3's first and third of three layers."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny target family {family!r}, expected one of {FAMILIES}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "qwen2" and sliding_window:
        common.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
    elif family == "mistral":
        common.update(sliding_window=sliding_window or 4096)
    elif family == "gemma3":
        family = "gemma3_text"
        common.update(num_hidden_layers=3, head_dim=8, sliding_window=sliding_window or 4096)
        common["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    common.update(fields)
    return AutoConfig.for_model(family, **common)


def tiny_model(family: str = "llama", vocab_size: int = 97, seed: int = 0, sliding_window: int | None = None, **fields):
    """A frozen fp32 CPU model of `family` with random weights fixed by `seed`; `fields` override config fields."""
    config = tiny_config(family, vocab_size, sliding_window, **fields)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.name_or_path = f"tiny_{family}"
    return freeze(model)


def tiny_chat_target(
    family: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer: str = DEFAULT_TARGET,
    dtype: torch.dtype | str | None = None,  # as `load_target`'s, but null means fp32 everywhere
    device: torch.device | str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer): a tiny frozen model with the vocabulary and special tokens of `tokenizer`'s real tokenizer."""
    tok = AutoTokenizer.from_pretrained(resolve_target(tokenizer))
    model = tiny_model(
        family,
        len(tok),
        seed,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return model.to(device=device, dtype=dtype or torch.float32), tok
