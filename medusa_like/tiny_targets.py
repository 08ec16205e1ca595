"""Tiny randomly initialised targets of several families, built from a config with nothing downloaded.

They stand in for real targets in tests and smoke runs (`model=tiny_llama`, `model=tiny_qwen2`). They borrow the
embedded default's tokenizer (and so its chat template and its 49,152-token vocabulary), which keeps data, chat
templates and vocabulary sizes realistic while the model itself runs in milliseconds.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from medusa_like.targets import DEFAULT_TARGET, freeze, resolve_target

FAMILIES = ("llama", "qwen2", "mistral")


def tiny_target(
    family: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer: str = DEFAULT_TARGET,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A frozen fp32 CPU model of `family` with random weights (fixed by `seed`) and the tokenizer of `tokenizer`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny target family {family!r}, expected one of {FAMILIES}")
    tok = AutoTokenizer.from_pretrained(resolve_target(tokenizer))
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tok),
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
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.name_or_path = f"tiny_{family}"
    return freeze(model), tok
