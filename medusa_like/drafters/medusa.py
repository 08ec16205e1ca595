"""Medusa draft heads: K small residual MLPs on the target's last hidden state.

Head k (1-based) predicts the token k positions after the target's own next token, i.e. from the hidden state at
position t it guesses token t + 1 + k. Each head is N residual blocks `x + SiLU(Linear(x))`, zero-initialised so an
untrained head reproduces the target's next-token distribution, followed by a vocabulary projection that is either
the target's frozen `lm_head` (shared, the default) or the head's own copy of it. Beside a compiled target the heads
and the projection draft compiled (`compile_drafting`: `forward/compiled_draft.py`).
"""

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.decoding.projection import VocabProjection
from medusa_like.decoding.tree import TreeSpec
from medusa_like.decoding.tree_presets import target_ranks
from medusa_like.drafters.base import LearnedDrafter
from medusa_like.drafters.kinds import WeightsKind
from medusa_like.drafters.registry import register
from medusa_like.drafters.vocab import DraftVocab

NUM_HEADS = 4  # heads, when a config or a caller names no number


@dataclass(frozen=True)
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = NUM_HEADS
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = True  # reuse the target's frozen lm_head instead of one projection per head

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadsConfig.{name} must be a positive integer, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(LearnedDrafter, nn.Module):
    """K draft heads. `forward(hidden, lm_head)` returns logits [K, ..., V] for hidden [..., H].

    `draft_vocab`, when set, restricts the heads' projection to its rows at inference (FR-Spec-style)."""

    kind = "medusa"
    computes_in_own_dtype = False  # they read the target's last hidden state through its own projection

    def __init__(self, config: HeadsConfig, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.draft_vocab: DraftVocab | None = None
        # one nn.Sequential of N separate blocks per head: stacked blocks never share weights
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        if config.shared_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if lm_head_weight is not None:
                self.init_projections_from(lm_head_weight)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    max_depth = num_heads  # the deepest static tree they fill: head d fills depth d

    def proposer(self, target) -> "MedusaProposer":
        return MedusaProposer(self, target, self.draft_vocab)

    def compile_drafting(self, compiler) -> None:
        """Draft through the heads and the target's projection (over the draft vocabulary's rows, if set) compiled by
        `compiler` (`forward/compiled_draft.py`) from now on: compiled on the first draft, or loaded."""
        self._compiled = None  # cleared first: the compiler copies these modules, and must not copy an earlier one
        rows = None if self.draft_vocab is None else self.draft_vocab.token_ids
        self._compiled = compiler.heads(self, rows)

    def compiled_logits(self, rows: torch.Tensor | None):
        """hidden [H] -> every head's logits [K, N] over `rows` (token ids; None: the whole vocabulary), compiled,
        where `compile_drafting` compiled them for these rows; else None."""
        compiled = getattr(self, "_compiled", None)
        if compiled is None or (compiled.rows is None) != (rows is None):
            return None
        if rows is not None and not torch.equal(compiled.rows.cpu(), rows.cpu()):
            return None
        return compiled

    @property
    def target_sizes(self) -> tuple[int, int]:
        return self.config.hidden_size, self.config.vocab_size

    @torch.no_grad()
    def init_projections_from(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's lm_head into every head's own projection."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != expected:
            raise ValueError(f"lm_head weight has shape {tuple(lm_head_weight.shape)}, heads expect {expected}")
        for proj in self.lm_heads:
            proj.weight.copy_(lm_head_weight)

    def features(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., H] -> per-head features [K, ..., H] (before the vocabulary projection), first `num_heads`."""
        return torch.stack([block(hidden) for block in self.blocks[:num_heads]])

    def forward(self, hidden: torch.Tensor, lm_head=None, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [K, ..., V] of the first `num_heads` heads (all by default).

        `lm_head` maps features to logits with the target's projection; it is needed when the projection is shared.
        """
        feats = self.features(hidden, num_heads)  # [K, ..., H]
        if self.lm_heads is None:
            if lm_head is None:
                raise ValueError("these heads share the target's lm_head: pass it as `lm_head`")
            return lm_head(feats)
        return torch.stack([proj(f) for proj, f in zip(self.lm_heads, feats, strict=False)])


# ---------------------------------------------------------------------------------------------------------------------
# Inference: the heads' side of the decoding protocol


class MedusaProposer:
    """Proposes from the heads on the target's last hidden state at the last accepted token (see
    `drafters/protocol.py`). Head d's top-k fills depth d, whatever the path above it; a dynamic tree ranks paths by
    the sum of the heads' log-probabilities. With a `DraftVocab` the heads' projection is restricted to its rows."""

    feature_layers = None  # the last hidden state

    def __init__(self, heads: MedusaHeads, target, vocab: DraftVocab | None = None):
        self.heads = heads
        self.compiled = heads.compiled_logits(None if vocab is None else vocab.token_ids)  # None: eager
        self.max_depth = heads.num_heads
        self.projection = VocabProjection(target, None if vocab is None else vocab.token_ids)
        self.token_ids = None if vocab is None else vocab.token_ids.to(target.device)
        self.max_rank = heads.config.vocab_size if vocab is None else vocab.size

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        self.hidden, self.root = features[-1], root

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        self.hidden, self.root = features[-1], bonus

    def propose(self, spec: TreeSpec) -> DraftTree:
        return spec.grow(self.root, self._expand_from(spec) if spec.max_depth else None)

    def _expand_from(self, spec: TreeSpec):
        if self.compiled is not None:
            logits = self.compiled(self.hidden)[: spec.max_depth]  # [D, V]: every head computed, the first D kept
        else:
            logits = self.heads(self.hidden, self.projection, num_heads=spec.max_depth)  # [D, V]
        top = logits.float().log_softmax(-1).topk(spec.top_k, dim=-1)  # [D, k]
        tokens = top.indices if self.token_ids is None else self.token_ids[top.indices]

        def expand(frontier, _tokens, _parents, depth):  # the same children after every node of a depth
            return tokens[depth - 1].expand(frontier.numel(), -1), top.values[depth - 1].expand(frontier.numel(), -1)

        return expand


# ---------------------------------------------------------------------------------------------------------------------
# The kind: fresh heads, and their per-head accuracy for static trees; the codec (`formats/heads_io.py`) is attached
# by its format module


def fresh_heads(target, num_heads: int = NUM_HEADS, num_layers: int = 1, shared_lm_head: bool = True) -> MedusaHeads:
    """Zero-initialised heads: they reproduce the target's next-token distribution (lossless, only slower)."""
    config = target.config.get_text_config()
    return MedusaHeads(
        HeadsConfig(config.hidden_size, config.vocab_size, num_heads, num_layers, shared_lm_head),
        target.get_output_embeddings().weight,
    )


@torch.inference_mode()
def head_ranks(heads: MedusaHeads, target, sequence: torch.Tensor, prompt_len: int, chunk: int = 64):
    """Per head k (1-based), the rank of the right token among head k's logits at every answer position of one
    sequence [1, L], teacher-forced: from the target's last hidden state at position t (t >= prompt_len - 1), head k
    predicts token t + 1 + k; positions whose token falls past the end are skipped."""
    lm_head = target.get_output_embeddings()
    hidden = target.base_model(input_ids=sequence).last_hidden_state[0]  # [L, H]
    length = sequence.shape[1]
    ranks: list[list[torch.Tensor]] = [[] for _ in range(heads.num_heads)]
    positions = torch.arange(prompt_len - 1, length - 2)  # t with t + 2 < L: head 1 has a label
    for start in range(0, positions.numel(), chunk):
        t = positions[start : start + chunk]
        logits = heads(hidden[t], lm_head)  # [K, n, V]
        for k in range(1, heads.num_heads + 1):
            valid = t + 1 + k < length
            ranks[k - 1].append(target_ranks(logits[k - 1][valid], sequence[0, t[valid] + 1 + k]))  # [n_k]
    return [torch.cat(r) if r else torch.zeros(0, dtype=torch.long) for r in ranks]


def restrict_heads(heads: MedusaHeads, vocab: DraftVocab) -> None:
    heads.draft_vocab = vocab  # FR-Spec: the heads score only these rows of the target's projection


MEDUSA = register(WeightsKind("medusa", fresh_heads, ranks=head_ranks, restrict=restrict_heads))
