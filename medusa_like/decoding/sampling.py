"""Lossless sampling verification of a token tree (temperature > 0).

The heads' candidates are deterministic, so each is a draft whose proposal distribution is a point mass. Speculative
sampling with a point-mass draft x accepts x with probability p(x) and, on rejection, continues with p restricted to
the other tokens and renormalised. Trying a node's children one after the other in rank order, each against what is
left of p, and sampling from the remainder when all are rejected, emits every token with exactly the target's
probability (SpecInfer's multi-candidate rule). Accepted children are descended into with their own distribution;
the token sampled where the walk stops is the bonus token.
"""

import torch

from .draft_tree import DraftTree


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
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        drop_by_token = torch.zeros_like(drop).scatter(-1, order, drop)  # back from sorted order to token order
        logits = logits.masked_fill(drop_by_token, float("-inf"))
    return logits.softmax(-1)


def accept_sampling(
    tokens: torch.Tensor, probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the tree from the root; return (accepted nodes root first [n + 1], bonus token []).

    tokens [T]: node tokens; probs [T, V]: the target's (warped) distribution after each node.
    """
    uniform = torch.rand(tree.num_nodes, generator=generator, device=probs.device)  # at most one draw per node
    node, path = 0, [0]
    residual = probs[0].clone()
    while True:
        chosen = None
        for child in tree.children[node]:
            token = tokens[child]
            if uniform[child] < residual[token]:
                chosen = child
                break
            residual[token] = 0.0
            residual /= residual.sum().clamp_min(1e-30)
        if chosen is None:
            bonus = torch.multinomial(residual, 1, generator=generator)[0]
            return torch.tensor(path, device=probs.device), bonus
        path.append(chosen)
        node = chosen
        residual = probs[chosen].clone()
