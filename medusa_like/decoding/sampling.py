"""Lossless sampling verification of a token tree (temperature > 0), by the exponential race.

Each generated position gets its own noise, E [V] ~ Exp(1) per token, and its token is argmax_v p(v) / E_v: the race
that token v wins with probability exactly p(v) (the way gpt-fast samples). The noise belongs to the position, not to
a tree node: in a step, every node at depth d picks the token after it with the noise of position committed + d + 1.
Verification is then the greedy rule (`generate.accept_greedy`): a node is accepted iff its token is the one its
parent's distribution picks with that noise, and the token picked after the last accepted node is the bonus token.

Whatever the tree, the token committed at a position is the race's winner under the target's distribution given the
committed prefix, with noise independent of that prefix: each token follows the target's distribution exactly. The
drafts decide only how many tokens a forward commits, never which, so a seeded generation gives the same tokens with
any drafter, tree or output store, and as plain decoding. A node's children are accepted with total probability the
sum of p over their tokens, as under SpecInfer's multi-candidate rule, so trees accept as many tokens as under it.
"""

import torch


def check_top_p(top_p: float) -> None:
    """The nucleus is the smallest prefix of tokens whose probability reaches `top_p`: a number in (0, 1]."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering."""
    if temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    check_top_p(top_p)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(~nucleus(logits.softmax(-1), top_p), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_CANDIDATES = 64  # the likeliest tokens searched first for the nucleus; a full sort only where they fall short


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] -> the nucleus [..., V] (bool): each row's smallest prefix of tokens, likeliest first, whose
    probability reaches `top_p`. Found among the row's likeliest `NUCLEUS_CANDIDATES` where they reach it (a sampled
    row at a low temperature: a sort of the whole vocabulary was most of a batched sampling step), else by a full sort:
    the same set either way."""
    count = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    top, order = probs.topk(count, dim=-1)  # [..., C], descending
    if bool((top.sum(-1) < top_p).any()):
        top, order = probs.sort(dim=-1, descending=True)  # [..., V]
    kept = top.cumsum(-1) - top < top_p  # a token is kept while the likelier ones have not reached top_p
    return torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter(-1, order, kept)


class PositionNoise:
    """The race's noise [V] of each generated position, drawn when first needed, one position per draw and in position
    order from `generator` (None: torch's default generator): a position's noise depends only on the generator's seed
    and how many positions came before it, never on the trees that were verified."""

    def __init__(self, vocab: int, device, generator: torch.Generator | None = None):
        self.vocab, self.device, self.generator = vocab, device, generator
        self.first = 0  # the position of rows[0], counted from the first generated token
        self.rows: list[torch.Tensor] = []  # [V] each

    def take(self, first: int, count: int) -> torch.Tensor:
        """The noise of positions first .. first + count - 1 [count, V]; positions before `first` are committed and
        forgotten."""
        while self.first + len(self.rows) < first + count:
            row = torch.empty(self.vocab, device=self.device).exponential_(generator=self.generator)
            self.rows.append(row.clamp_min_(torch.finfo(row.dtype).tiny))  # never 0: p / 0 would win or be NaN
        del self.rows[: first - self.first]
        self.first = first
        return torch.stack(self.rows[:count])


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs, noise [T, V] -> the token each row picks [T]: v with probability probs[v] over the noise."""
    return (probs / noise).argmax(-1)
