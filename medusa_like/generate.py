"""The speculative decoding loop: prefill, propose, verify a whole tree in one target forward, accept, commit.

One step, for a compiled `TokenTree` of T nodes (node 0 is the root, the target's own last prediction):

    candidates  root + the heads' top-k tokens gathered per the tree                  [T]
    verify      one target forward over all T nodes, tree mask, depth positions       -> argmax [T]
    accept      the longest root-to-leaf path whose every token equals the target's
                argmax at its parent; the argmax at its last node is the bonus token
    commit      accepted nodes' KV move to contiguous cache slots; the heads' next
                proposals come from the hidden state at the last accepted node (no extra forward)

At temperature 0 the output is the target's own greedy output, token for token: every committed token is the
target's argmax given the committed prefix. tau = generated tokens / target forwards, the prefill included, so plain
decoding has tau = 1 exactly and the bonus token counts (as in Medusa, EAGLE and Spec-Bench).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .attention import tree_attention
from .heads import MedusaHeads
from .kv_cache import CacheOverflowError, TreeKVCache
from .sampling import accept_sampling, warp_logits
from .tree import TokenTree


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    accepted_draft: list[int] = field(default_factory=list)  # draft tokens accepted per tree step (bonus excluded)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Generated tokens per target forward (the bonus token counts)."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def mean_accepted_draft(self) -> float:
        return sum(self.accepted_draft) / max(len(self.accepted_draft), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.tau,
            "mean_accepted_draft": self.mean_accepted_draft,
            "accepted_draft": list(self.accepted_draft),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt + new]
    new_tokens: torch.Tensor  # [new]
    stats: DecodeStats
    finish_reason: str  # "eos", "stop_string" or "length"


# ---------------------------------------------------------------------------------------------------------------------
# The four tensor functions of a step


def target_hidden(target, input_ids, position_ids, cache: TreeKVCache, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """The target's last hidden state [1, T, H] for new tokens, writing their KV into `cache`."""
    out = target.base_model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=tree_mask,
        past_key_values=cache,
        use_cache=True,
    )
    return out.last_hidden_state


class VocabProjection:
    """The target's output projection (and final logit soft-capping, e.g. Gemma's), as `logits = W @ h^T`.

    Same numbers as calling `lm_head`, computed with the weight as the left operand: for the few rows of a tree step
    or of the heads, BLAS on CPUs runs this orientation 2-5x faster than `F.linear`'s `h @ W^T` (measured with
    MKL on 2 cores: 2.4 ms instead of 14 ms for 2 rows of SmolLM2's 49152 x 576 projection).
    """

    def __init__(self, target):
        output = target.get_output_embeddings()
        self.weight = output.weight  # [V, H]
        self.bias = getattr(output, "bias", None)
        self.softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        logits = torch.mm(self.weight, flat.t()).t()  # [N, V]
        if self.bias is not None:
            logits = logits + self.bias
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.reshape(*hidden.shape[:-1], -1)


def propose(heads: MedusaHeads, hidden: torch.Tensor, lm_head, top_k: int, depth: int) -> torch.Tensor:
    """hidden [H] -> the top-k tokens [depth, top_k] of the first `depth` heads (the ones the tree uses)."""
    return heads(hidden, lm_head, num_heads=depth).topk(top_k, dim=-1).indices


def build_candidates(root: torch.Tensor, proposals: torch.Tensor | None, tree: TokenTree) -> torch.Tensor:
    """root [] + proposals [K, top_k] -> the token of every tree node [T]."""
    if tree.num_nodes == 1:
        return root.view(1)
    return torch.cat([root.view(1), proposals[: tree.max_depth].flatten()[tree.candidate_index]])


def accept_greedy(tokens: torch.Tensor, predictions: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """The accepted nodes, root first [n + 1]: the longest path whose tokens equal the target's argmax at the parent.

    tokens, predictions [T]: node tokens and the target's argmax after each node.
    """
    valid = tree.retrieve >= 0  # [P, D+1]
    paths = tree.retrieve.clamp(min=0)
    match = (tokens[paths[:, 1:]] == predictions[paths[:, :-1]]) & valid[:, 1:]  # [P, D]
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = accepted.argmax()
    return paths[best, : int(accepted[best]) + 1]


# ---------------------------------------------------------------------------------------------------------------------
# The loop


class StopChecker:
    """EOS ids and stop strings; `cut(tokens)` returns where to cut the generated tokens, or None to go on."""

    def __init__(self, eos_token_ids=(), stop_strings=(), tokenizer=None):
        self.eos = set(int(t) for t in eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode the generated text")
        self.tokenizer = tokenizer
        self.window = max((len(s) for s in self.stop_strings), default=0) + 2  # a token is at least one character

    def cut(self, generated: list[int], first_new: int) -> tuple[int, str] | None:
        for i in range(first_new, len(generated)):
            if generated[i] in self.eos:
                return i + 1, "eos"
            if self.stop_strings:
                text = self.tokenizer.decode(generated[max(0, i + 1 - self.window) : i + 1])
                if any(s in text for s in self.stop_strings):
                    return i + 1, "stop_string"
        return None


def _emit(streamer, tokens: list[int]) -> None:
    if streamer is None or not tokens:
        return
    if hasattr(streamer, "put"):  # a transformers streamer
        streamer.put(torch.tensor(tokens))
    else:
        streamer(tokens)


@torch.inference_mode()
def speculative_generate(
    target,
    heads: MedusaHeads | None,
    input_ids: torch.Tensor,
    tree: TokenTree,
    max_new_tokens: int,
    backend: str = "sdpa",
    stop: StopChecker | None = None,
    streamer: Callable | None = None,
    max_cache_len: int | None = None,
    proposer: Callable | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Tree speculative decoding of one sequence, lossless: at temperature 0 the output is the target's greedy output
    token for token; above it, every token is drawn from the target's own (temperature, top-k, top-p) distribution.

    `proposer(last_hidden [H], generated: list[int]) -> [K, top_k]` replaces the heads' proposals when given (an
    oracle in tests, or another drafter); verification and acceptance stay the same, so the output does too.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one sequence, input_ids [1, T]; got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if proposer is None and tree.num_nodes > 1 and (heads is None or heads.num_heads < tree.max_depth):
        have = 0 if heads is None else heads.num_heads
        raise ValueError(f"tree of depth {tree.max_depth} needs {tree.max_depth} heads, have {have}")
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    needed = prompt_len + max_new_tokens + tree.num_nodes
    capacity = max_cache_len if max_cache_len is not None else needed
    if needed > capacity:
        raise CacheOverflowError(
            f"KV cache of {capacity} tokens is too small for a {prompt_len}-token prompt, {max_new_tokens} new tokens "
            f"and a {tree.num_nodes}-node tree (needs {needed})"
        )
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and prompt_len + max_new_tokens + tree.max_depth > max_positions:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"max_position_embeddings ({max_positions})"
        )
    stop = stop or StopChecker()
    tree = tree.to(device)
    lm_head = VocabProjection(target)
    if proposer is None:

        def proposer(hidden, _generated):
            return propose(heads, hidden, lm_head, tree.top_k, tree.max_depth)

    cache = TreeKVCache.for_model(target, capacity)
    stats = DecodeStats()
    tree_mask = tree.attention_mask[None, None]  # [1, 1, T, T]

    def next_token(logits):  # [V] -> []
        if temperature == 0:
            return logits.argmax(-1)
        return torch.multinomial(warp_logits(logits, temperature, top_k, top_p), 1, generator=generator)[0]

    with tree_attention(target, backend):
        start = time.perf_counter()
        hidden = target_hidden(target, input_ids, torch.arange(prompt_len, device=device)[None], cache, None)
        cache.commit_all(prompt_len)
        last_hidden = hidden[0, -1]  # [H]
        root = next_token(lm_head(last_hidden))
        stats.target_forwards = 1
        generated = [int(root)]
        stats.prefill_seconds = time.perf_counter() - start
        _emit(streamer, generated)
        finish = stop.cut(generated, 0)

        start = time.perf_counter()
        while finish is None and len(generated) < max_new_tokens:
            proposals = proposer(last_hidden, generated) if tree.num_nodes > 1 else None
            tokens = build_candidates(root, proposals, tree)  # [T]
            prefix = cache.length
            cache.check_room(tree.num_nodes)
            hidden = target_hidden(target, tokens[None], (prefix + tree.depth)[None], cache, tree_mask)[0]  # [T, H]
            logits = lm_head(hidden)  # [T, V]
            if temperature == 0:
                predictions = logits.argmax(-1)  # [T]
                nodes = accept_greedy(tokens, predictions, tree)  # [n + 1]
                root = predictions[nodes[-1]]
            else:
                probs = warp_logits(logits, temperature, top_k, top_p)  # [T, V]
                nodes, root = accept_sampling(tokens, probs, tree, generator)
            cache.commit(prefix + nodes)
            stats.target_forwards += 1
            stats.accepted_draft.append(nodes.numel() - 1)

            last_hidden = hidden[nodes[-1]]
            new = tokens[nodes[1:]].tolist() + [int(root)]
            first_new = len(generated)
            generated.extend(new)
            del generated[max_new_tokens:]
            finish = stop.cut(generated, first_new)
            if finish is not None:
                del generated[finish[0] :]
            _emit(streamer, generated[first_new:])
        stats.decode_seconds = time.perf_counter() - start

    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    reason = finish[1] if finish is not None else "length"
    new_tokens = torch.tensor(generated, dtype=torch.long, device=device)
    stats.new_tokens = len(generated)
    return GenerateOutput(torch.cat([input_ids[0], new_tokens])[None], new_tokens, stats, reason)
