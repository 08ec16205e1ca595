"""Shared fixtures: tiny random targets of several families, built from configs (nothing downloaded)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from medusa_like.heads import HeadsConfig, MedusaHeads

VOCAB = 97
HIDDEN = 32
SLIDING_WINDOW = 6  # far below the test sequence lengths, so sliding layers really slide

# Tiny models gain nothing from intra-op threads, and OpenMP workers spinning on a busy 2-core machine make each small
# matmul up to 50x slower.
torch.set_num_threads(1)

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = {
    "llama": lambda: LlamaConfig(**_COMMON),
    # first layer full attention, second sliding
    "qwen2": lambda: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1
    ),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW),
    "gemma3": lambda: Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        head_dim=8,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def tiny_target(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config).eval()


def random_heads(num_heads: int = 4, num_layers: int = 1, shared: bool = True, seed: int = 0) -> MedusaHeads:
    """Heads with random (non-zero) weights, so their proposals are wrong in varied ways."""
    torch.manual_seed(seed)
    heads = MedusaHeads(HeadsConfig(HIDDEN, VOCAB, num_heads, num_layers, shared))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return heads.eval()


def random_prompts(n: int, seed: int = 0, min_len: int = 2, max_len: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, VOCAB, (1, int(length)), generator=g) for length in lengths]


def greedy_reference(target, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation through transformers' generate."""
    out = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, input_ids.shape[1] :]


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param
