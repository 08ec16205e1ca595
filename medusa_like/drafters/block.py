"""A block drafter (DFlash-style): a few decoder layers that draft a whole block of positions in one forward.

The committed context enters as keys and values only: the target's residual streams at a low, a middle and a high
layer (`feature_layers`, indices into its `hidden_states`, EAGLE-3's by default), fused by `fc` and an RMSNorm into
one state per token, which each layer's k/v projections (with its key norm and rotary embedding) turn into that
layer's keys and values, kept in the drafter's own cache and appended at each accept. The block is B positions: the
root (the target's own next token, embedded by the target's embeddings) followed by B - 1 mask embeddings, attending
each other bidirectionally and the whole context. One forward gives the B - 1 positions' distributions over the draft
vocabulary:

    context = hidden_norm(fc(features))                             # [T, h]: the committed tokens' fused states
    keys_l, values_l = rope(k_norm(k_proj_l(context))), v_proj_l(context)    # per layer, cached
    x = [embed(root), mask, ..., mask]                              # [B, h] at positions p .. p + B - 1
    x = layer_l(x, attending [keys_l; own keys], bidirectional)     # each of the L layers
    logits = lm_head(norm(x[1:]))                                   # [B - 1, N]: position p + j for j = 1 .. B - 1

Position j's distribution is conditioned on the context and the root only, never on the token drafted at j - 1: a
tree from one block branches by each position's top-k, the same candidates after every node of a depth (as Medusa
heads'), and a node's score is the product of its positions' probabilities. The target verifies every tree, so the
output is the target's whatever the drafter proposes.

The layers are transformers' Qwen3 decoder layers (q/k norms, no biases: the layout vLLM and SGLang load for DFlash
drafters) built from the target's dimensions and rotary settings, whatever the target's family, and called through
their public forward over a cache whose keys are the context's followed by the block's own. A target without a mask
token (most) gets a learned mask embedding. The attention over context and block is `block_attention.py`'s; the
proposer that drafts with it at inference, its context cache and its compiled step are `block_proposer.py`'s.
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, PretrainedConfig
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from ..targets import cache_keyword
from .base import DrafterMismatchError, LearnedDrafter, target_name
from .block_attention import ATTENTION, PrefixedCache
from .block_proposer import MAX_CONTEXT, MAX_ROWS, MIN_ROWS, BlockGraph, BlockProposer
from .eagle3 import default_aux_layers
from .kinds import WeightsKind
from .registry import register
from .vocab import DraftVocab

DEFAULT_BLOCK_SIZE = 8  # the root and 7 drafted positions
LAYER_FAMILY = "qwen3"  # the layers' transformers family: DFlash's layout, what the serving engines load


@dataclass(frozen=True)
class BlockConfig:
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    feature_layers: tuple[
        int, ...
    ]  # the target's hidden_states fused into the context (i: the stream entering layer i)
    block_size: int  # B: the root and B - 1 drafted positions
    mask_token_id: int | None  # the target's mask token, whose embedding fills the block; None: a learned embedding
    layer: dict = field(repr=False)  # the layers' config (model_type + fields)
    # the predecessor head's rank (DSpark's low-rank Markov head: each position's logits rescored by the token before
    # it, so that a tree's branches differ by their parent); 0: none, every node of a depth gets the same candidates
    predecessor_rank: int = 0

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(
                f"block_size must be an integer >= 2 (the root and a drafted position), got {self.block_size!r}"
            )
        if not self.feature_layers:
            raise ValueError("feature_layers must name at least one target layer")
        if (
            isinstance(self.predecessor_rank, bool)
            or not isinstance(self.predecessor_rank, int)
            or self.predecessor_rank < 0
        ):
            raise ValueError(
                f"predecessor_rank must be an integer >= 0 (0: no predecessor head), got {self.predecessor_rank!r}"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} lies outside the target's vocabulary of {self.vocab_size} tokens"
            )
        if "model_type" not in self.layer or int(self.layer.get("num_hidden_layers", 0)) < 1:
            raise ValueError("BlockConfig.layer must hold the layers' config: a model_type and num_hidden_layers >= 1")

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.layer["num_hidden_layers"])

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        draft_vocab_size: int,
        feature_layers=None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_layers: int = 1,
        mask_token_id: int | None = None,
        predecessor_rank: int = 0,
    ) -> "BlockConfig":
        text = target_config.get_text_config()
        layers = tuple(feature_layers) if feature_layers else default_aux_layers(text.num_hidden_layers)
        if any(not 0 <= i <= text.num_hidden_layers for i in layers):
            raise ValueError(f"feature_layers {list(layers)} must lie in [0, {text.num_hidden_layers}] for this target")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"a block drafter has at least one layer, got num_layers={num_layers!r}")
        layer = {
            "model_type": LAYER_FAMILY,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "hidden_act": getattr(text, "hidden_act", "silu"),
            "max_position_embeddings": text.max_position_embeddings,
            "rope_parameters": _rope_parameters(text),
            "num_hidden_layers": num_layers,
        }
        vocab = min(draft_vocab_size, text.vocab_size)
        return cls(text.hidden_size, text.vocab_size, vocab, layers, block_size, mask_token_id, layer, predecessor_rank)

    def to_dict(self) -> dict:
        return {**asdict(self), "feature_layers": list(self.feature_layers)}

    def layer_config(self) -> PretrainedConfig:
        """The layers' transformers config: full attention, no embeddings of their own."""
        fields = {**self.layer, "vocab_size": 1, "attention_bias": False, "use_sliding_window": False}
        fields.update(pad_token_id=None, bos_token_id=None, eos_token_id=None, sliding_window=None)
        config = AutoConfig.for_model(**fields)
        config.layer_types = ["full_attention"] * self.num_layers
        config._attn_implementation = ATTENTION
        return config


def _rope_parameters(text) -> dict:
    """The target's rotary settings for full-attention layers (a family with per-layer-type settings, such as Gemma
    3, keeps one dict per type)."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
    return rope


class BlockDrafter(LearnedDrafter, nn.Module):
    """The block drafter's weights and its forward; `BlockProposer` drives it at inference."""

    kind = "block"
    computes_in_own_dtype = True  # `context` and `forward` cast what they read; logits leave in fp32

    def __init__(self, config: BlockConfig, vocab: DraftVocab | None = None):
        super().__init__()
        self.config = config
        family = AutoModel.from_config(config.layer_config())  # the layers, random init; its embeddings dropped
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = type(family.norm)(hidden, eps=config.layer["rms_norm_eps"])
        self.layers = family.layers
        self.norm = family.norm
        self.rotary_emb = family.rotary_emb
        # the block's mask positions: a learned embedding, or the target's embedding of its mask token
        self.mask_embedding = nn.Parameter(torch.randn(hidden) * 0.02) if config.mask_token_id is None else None
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # the predecessor head: logits_j += S (P[token before j] * W h_j), S over the draft vocabulary, P over the
        # target's (any token may precede, the root too); S starts at zero, so the head starts as no change
        rank = config.predecessor_rank
        self.predecessor = nn.Embedding(config.vocab_size, rank) if rank else None
        self.successor = nn.Parameter(torch.zeros(config.draft_vocab_size, rank)) if rank else None
        self.predecessor_projection = nn.Linear(hidden, rank, bias=False) if rank else None
        vocab = vocab or DraftVocab.full(config.vocab_size)
        if vocab.size != config.draft_vocab_size or vocab.target_vocab_size != config.vocab_size:
            raise ValueError(
                f"draft vocabulary of {vocab.size} tokens over {vocab.target_vocab_size} does not match the config "
                f"({config.draft_vocab_size} over {config.vocab_size})"
            )
        self.register_buffer("token_ids", vocab.token_ids.clone(), persistent=False)
        self.register_buffer("mask_token_embedding", torch.zeros(hidden), persistent=False)  # `use_target_embeddings`
        self._cache_keyword = cache_keyword(self.layers[0])
        self._compiled = None  # the block's graph compiled where the target's step is (`compile_drafting`)

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.token_ids.cpu(), self.config.vocab_size)

    @property
    def max_depth(self) -> int:
        return self.config.block_size - 1  # the deepest a tree from one block reaches

    @property
    def target_sizes(self) -> tuple[int, int]:
        return self.config.target_hidden_size, self.config.vocab_size

    def proposer(self, target) -> "BlockProposer":
        return BlockProposer(self, target)

    def check_fits(self, target) -> None:
        super().check_fits(target)
        positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        if positions is not None and self.config.block_size > positions:
            raise DrafterMismatchError(
                f"a block drafter drafts a block of {self.config.block_size} positions, more than target "
                f"{target_name(target)!r}'s max_position_embeddings ({positions})"
            )

    def compile_drafting(self, compiler) -> None:
        """Draft through the block's graph compiled by `compiler` (`forward/compiled_draft.DraftCompiler.graph`),
        with the target's step's settings, from now on: compiled on its first draft, or loaded."""
        self._compiled = None  # cleared first: the compiler copies this module, and must not copy an earlier one
        graph = BlockGraph(self)
        rows, live = ("rows", MIN_ROWS, MAX_ROWS), ("live", MIN_ROWS, MAX_CONTEXT)
        dynamic = {"features": {0: rows}, "context_positions": {0: rows}, "real": {0: rows}, "seen": {0: live},
                   "buffer": {3: ("capacity", MIN_ROWS, MAX_CONTEXT)}}  # fmt: skip
        self._compiled = compiler.graph(graph, self, graph.example_inputs(), dynamic, "the block drafter's block")

    def block_step(self):
        """The compiled block graph where `compile_drafting` set one, else None (the proposer runs it eagerly)."""
        return self._compiled

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start the projection from the target's rows and the final norm from the target's, and the learned mask
        embedding from the target's mean input embedding: the drafter's output space is the target's."""
        weight = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(weight[self.token_ids.to(weight.device)].to(self.lm_head.weight))
        target_norm = getattr(target.base_model, "norm", None)
        if target_norm is not None and target_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(target_norm.weight)
        if self.mask_embedding is not None:
            embeddings = target.get_input_embeddings().weight
            self.mask_embedding.copy_(embeddings.float().mean(0).to(self.mask_embedding))

    @torch.no_grad()
    def init_layers_from_target(self, target, layer_indices: list[int] | str) -> None:
        """Start drafter layer i from target layer `layer_indices[i]`: its attention's projections, MLP and norms where
        the shapes match (the drafter's layers have the target's dimensions); the q/k norms a target layer lacks start
        at one, and biases the drafter's layers lack are left out. "high": the layers the highest feature stream
        enters and those after it, with `fc` passing that stream through and the context's norm as the first's input
        norm, so that the context's keys and values start as that target layer's own (but for the key norm)."""
        layers = target.base_model.layers
        if layer_indices == "high":
            first = max(self.config.feature_layers)
            if first + len(self.layers) > len(layers):
                raise ValueError(
                    f"init_layers_from_target=high: the highest feature stream enters layer {first}, and the target has "
                    f"no {len(self.layers)} layers from there"
                )
            layer_indices = list(range(first, first + len(self.layers)))
            hidden, slot = self.config.hidden_size, self.config.feature_layers.index(first)
            if hidden == self.config.target_hidden_size:
                self.fc.weight.zero_()
                self.fc.weight[:, slot * hidden : (slot + 1) * hidden].copy_(torch.eye(hidden))
                self.hidden_norm.weight.copy_(layers[first].input_layernorm.weight)
        if len(layer_indices) != len(self.layers) or any(not 0 <= i < len(layers) for i in layer_indices):
            raise ValueError(
                f"init_layers_from_target={layer_indices}: one target layer index in [0, {len(layers) - 1}] per drafter "
                f"layer ({len(self.layers)})"
            )
        for mine, index in zip(self.layers, layer_indices, strict=True):
            own = dict(mine.named_parameters())
            for name, param in layers[index].named_parameters():
                if name in own and own[name].shape == param.shape:
                    own[name].copy_(param)

    # ---- the forward, as pure tensor functions of the context and the block ----------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated features [..., n * h_target] -> the context's fused states [..., h]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_keys(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context [B, T, h] at positions [B, T] -> every layer's (keys, values) [B, H_kv, T, D], rotated at their
        positions as the layers' attention rotates its own keys."""
        cos, sin = self.rotary_emb(context, positions)
        heads, out = self.config.layer["num_key_value_heads"], []
        for layer in self.layers:
            attn = layer.self_attn
            shape = (*context.shape[:-1], heads, attn.head_dim)
            keys = attn.k_norm(attn.k_proj(context).view(shape)).transpose(1, 2)  # [B, H_kv, T, D]
            values = attn.v_proj(context).view(shape).transpose(1, 2)
            keys, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
            out.append((keys, values))
        return out

    def block_embeddings(self, roots: torch.Tensor) -> torch.Tensor:
        """The roots' embeddings [..., h] (the target's) -> the blocks' inputs [..., B, h]: each root, then B - 1 mask
        embeddings (`mask`)."""
        dtype = self.fc.weight.dtype
        masks = self.mask.to(dtype).expand(*roots.shape[:-1], self.config.block_size - 1, -1)  # [..., B - 1, h]
        return torch.cat([roots.to(dtype)[..., None, :], masks], dim=-2)

    @property
    def mask(self) -> torch.Tensor:
        """The mask positions' input [h]: the learned embedding, or the target's embedding of its mask token (which
        `use_target_embeddings` keeps)."""
        return self.mask_embedding if self.mask_embedding is not None else self.mask_token_embedding

    def use_target_embeddings(self, embed: nn.Module) -> None:
        """With a mask token, keep its embedding from the target's (`embed`) as a buffer of this drafter."""
        if self.config.mask_token_id is not None:
            token = torch.tensor(self.config.mask_token_id, device=embed.weight.device)
            self.mask_token_embedding = embed(token).detach().to(self.mask_token_embedding)

    def forward(self, block: torch.Tensor, positions: torch.Tensor, context_keys, visible) -> torch.Tensor:
        """block [B, R, h] (the rows of one or several blocks) at positions [B, R], the layers' context keys
        (`context_keys`, over T positions), `visible`: a dense [B, 1, R, T + R] bool mask (which context keys, then
        which block rows, each row sees) or a `BlockMask` -> the rows' output states [B, R, h] after the final norm."""
        position_embeddings = self.rotary_emb(block, positions)
        cache = PrefixedCache(context_keys)
        x = block
        for layer in self.layers:
            x = layer(
                x, attention_mask=visible, position_embeddings=position_embeddings, **{self._cache_keyword: cache}
            )
        return self.norm(x)

    def logits(self, state: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """state [..., h] -> draft-vocabulary logits [..., N]; with the predecessor head, rescored by the token before
        each position, `previous` [...] (target ids)."""
        logits = self.lm_head(state)
        if self.predecessor is None:
            return logits
        return logits + self.rescoring(self.predecessor_projection(state), previous)

    def rescoring(self, projected: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The predecessor head's term [..., N] for positions whose states' projection is `projected` [..., r] and
        whose preceding tokens are `previous` [...]."""
        return (self.predecessor(previous).to(projected.dtype) * projected) @ self.successor.to(projected.dtype).T


# ---------------------------------------------------------------------------------------------------------------------
# The kind: a fresh drafter; its codec (`formats/block.py`) is attached by its format module


def fresh_block(
    target,
    draft_vocab_size: int | None = None,
    feature_layers=None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_layers: int = 1,
    mask_token_id: int | None = None,
    predecessor_rank: int = 0,
) -> BlockDrafter:
    """A randomly initialised drafter over the full target vocabulary (or its first `draft_vocab_size` tokens)."""
    vocab_size = target.config.get_text_config().vocab_size
    config = BlockConfig.for_target(
        target.config,
        draft_vocab_size or vocab_size,
        feature_layers,
        block_size,
        num_layers,
        mask_token_id,
        predecessor_rank,
    )
    return BlockDrafter(config, DraftVocab(torch.arange(config.draft_vocab_size), vocab_size))


BLOCK = register(WeightsKind("block", fresh_block))
