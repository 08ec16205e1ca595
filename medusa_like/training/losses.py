"""Head targets, losses and accuracies: pure tensor functions used by the Lightning modules (`shift_left` and
`decay_weights` by both drafters', the rest by the Medusa heads').

Head k (1-based) reads the target's last hidden state at position t and is trained on token t + 1 + k, where that
token is an assistant token (`loss_mask`). The optional soft label for head k at t is the target's own next-token
distribution at position t + k, which predicts the same token t + 1 + k.
"""

import torch
import torch.nn.functional as F

IGNORE = -100
DECAY = 0.8  # `decay_weights`' ratio when a drafter's module names none


def head_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """input_ids, loss_mask [B, T] -> labels [K, B, T]: labels[k-1, b, t] = input_ids[b, t+1+k] or IGNORE."""
    labels = torch.full((num_heads, *input_ids.shape), IGNORE, dtype=torch.long, device=input_ids.device)
    width = input_ids.shape[1]
    for k in range(1, num_heads + 1):
        shift = 1 + k
        if shift >= width:
            break
        future = input_ids[:, shift:]  # [B, T - shift]
        labels[k - 1, :, : width - shift] = future.masked_fill(loss_mask[:, shift:] == 0, IGNORE)
    return labels


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x [B, T, ...] -> out[:, t] = x[:, t + k], `fill` past the end."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)


def decay_weights(count: int, decay: float, first: int = 0, device=None) -> torch.Tensor:
    """[count]: decay ** i for i = first .. first + count - 1. A draft stops at its first miss, so later steps (and
    later heads) matter less: Medusa weighs head k = 1..K by decay^k, EAGLE-3 step j = 0..S-1 by decay^j."""
    return decay ** torch.arange(first, first + count, dtype=torch.float32, device=device)


def head_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [K, N, V], labels [K, N] -> (mean loss per head [K], supervised count per head [K]).

    The loss is (1 - kl_weight) * cross-entropy + kl_weight * KL(teacher || head) at `temperature` (scaled by T^2).
    A head with no supervised position gets loss 0 and count 0.
    """
    valid = labels != IGNORE  # [K, N]
    counts = valid.sum(-1)  # [K]
    denom = counts.clamp(min=1).float()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none")
    loss = ce.view(labels.shape).sum(-1) / denom  # [K]
    if teacher_logits is not None and kl_weight > 0:
        student = F.log_softmax(logits.float() / temperature, dim=-1)  # [K, N, V]
        teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # [K, N, V]
        kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)  # [K, N]
        kl = (kl * valid).sum(-1) / denom * temperature**2  # [K]
        loss = (1 - kl_weight) * loss + kl_weight * kl
    return loss, counts


@torch.no_grad()
def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[int, torch.Tensor]:
    """logits [K, N, V], labels [K, N] -> {k: number of supervised positions whose label is in the top k, per head [K]}."""
    valid = labels != IGNORE  # [K, N]
    top = logits.topk(max(ks), dim=-1).indices  # [K, N, max_k]
    hits = top == labels.unsqueeze(-1)  # [K, N, max_k]
    return {k: (hits[..., :k].any(-1) & valid).sum(-1) for k in ks}
