"""EAGLE-3's training-time test: the drafting loop unrolled over whole sequences, as pure tensor functions.

Step 0 reads the target's fused features: entry t = (feature at t, token t + 1) at position t, predicting token t + 2.
Step j >= 1 feeds back step j-1's output state at row t with token t + 1 + j at position t + j, predicting token
t + 2 + j: exactly what the drafter sees at depth j + 1 when it drafts after a prefix ending at t. So the attention of
step j at row t covers step 0's entries 0..t (the committed prefix) and the entries of steps 1..j at row t (the
drafted path), which is the mask `unrolled_mask` builds over the concatenated keys of all steps.

The label of step j at row t is the target's own distribution after token t + 1 + j, restricted to the draft
vocabulary; rows whose predicted token is not an assistant token (`supervised_rows`), or whose target argmax lies
outside the draft vocabulary (`Eagle3Module`, which computes that argmax), are left out (EAGLE-3's recipe).
"""

import torch

from medusa_like.training.losses import shift_left


def unrolled_mask(attention_mask: torch.Tensor, step: int) -> torch.Tensor:
    """attention_mask [B, T] (1 = real token) -> bool [B, 1, T, (step + 1) * T] over the keys of steps 0..step."""
    batch, width = attention_mask.shape
    real = attention_mask.bool()
    causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()  # [T, T]
    blocks = [causal[None] & real[:, None, :]]  # step 0: the committed prefix, no padding
    diagonal = torch.eye(width, dtype=torch.bool, device=real.device)[None].expand(batch, -1, -1)
    blocks += [diagonal] * step  # steps 1..step: the row's own drafted entries
    return torch.cat(blocks, dim=-1)[:, None]


def supervised_rows(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask, attention_mask [B, T] -> [B, T] bool: position s may have a label (the target's distribution after
    token s, for token s + 1) iff token s + 1 is a real assistant token."""
    return shift_left(loss_mask.bool() & attention_mask.bool(), 1, fill=False)


def drafter_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's log-probabilities of the teacher's k tokens: logits [n, N] over the draft vocabulary, ids [n, k]
    -> [n, k] in fp32. One log_softmax over N serves every term of a loss, q at the k tokens being its exponential:
    no term makes a pass of its own over [n, N], forward or backward."""
    return logits.float().log_softmax(-1).gather(-1, ids)


def topk_soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum p_teacher * log q, the teacher kept as its k most likely tokens: logits [n, N], ids and logp [n, k]
    (the teacher's log-probabilities of those tokens) -> []. The k probabilities are renormalised, so where they hold
    the teacher's whole mass this equals the loss with the full distribution."""
    return loss_function("soft_ce")(logits, ids, logp)


def topk_total_variation(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the total variation 1/2 sum |p_teacher - q| over the draft vocabulary, the teacher kept as its
    k most likely tokens (renormalised, zero elsewhere): logits [n, N], ids and logp [n, k] -> []. 1 - TV = sum min(p, q)
    is the rate at which speculative sampling accepts a draft from q, so this loss optimises acceptance directly."""
    return loss_function("tv")(logits, ids, logp)


def topk_log_acceptance(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """LK-style loss: the mean over rows of -log sum min(p_teacher, q), minus the log of the acceptance rate (same
    shapes as `topk_total_variation`). Its gradient weights each row by 1 / its acceptance, where TV's weights them
    equally, so rows the drafter gets badly wrong pull harder."""
    return loss_function("lk")(logits, ids, logp)


def _overlap(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """[n]: sum_i min(p_i, q_i) over the teacher's k tokens (its mass elsewhere is zero, where min is zero too)."""
    return torch.minimum(logp.float().softmax(-1), logq.exp()).sum(-1)


# name -> term(logq [n, k], logp [n, k]) -> []: logq the drafter's log-probabilities of the teacher's k tokens
# (`drafter_log_probs`), logp the teacher's; `Eagle3Module(loss=...)` picks one or a "+"-joined weighted mix such as
# "0.1*soft_ce+0.9*tv", DSpark's (`loss_function`)
LOSSES = {
    "soft_ce": lambda logq, logp: -(logp.float().softmax(-1) * logq).sum(-1).mean(),
    "tv": lambda logq, logp: 1.0 - _overlap(logq, logp).mean(),
    "lk": lambda logq, logp: -_overlap(logq, logp).clamp(min=1e-6).log().mean(),
}


def loss_function(spec: str):
    """'soft_ce', 'tv', 'lk' or a weighted sum of them ('0.1*soft_ce+0.9*tv') -> loss(logits [n, N], ids [n, k],
    logp [n, k]) -> [] (the mean over rows; 0 with a gradient for no rows)."""
    terms = []
    for term in str(spec).replace(" ", "").split("+"):
        weight, _, name = term.rpartition("*")
        if name not in LOSSES:
            raise ValueError(
                f"unknown drafter loss {name!r} in {spec!r}: choose from {sorted(LOSSES)}, or a weighted sum like '0.1*soft_ce+0.9*tv'"
            )
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"drafter loss {spec!r}: weight {weight!r} of {name!r} is not a number") from None
        if not value > 0:
            raise ValueError(f"drafter loss {spec!r}: weight {weight!r} of {name!r} must be positive")
        terms.append((value, LOSSES[name]))

    def loss(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits.sum() * 0.0
        logq = drafter_log_probs(logits, ids)  # [n, k], once for every term
        return sum(weight * term(logq, logp) for weight, term in terms)

    return loss


def simulated_tau(accuracy: list) -> float:
    """The expected acceptance length (tokens per target forward, bonus token included) of a chain of drafts whose
    depth-d draft is accepted with probability accuracy[d-1] given the shallower ones were: 1 + sum_d prod_{i<=d} a_i.
    The per-depth top-1 accuracies of the training-time test are such conditional rates (each depth is fed the true
    earlier tokens and the drafter's own earlier states, as a draft that survived to that depth is)."""
    tau, reach = 1.0, 1.0
    for a in accuracy:
        reach *= float(a)
        tau += reach
    return tau
