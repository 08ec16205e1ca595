"""An EAGLE-3-style draft model: one decoder layer of the target's own family, drafting at the feature level.

Input at position t: the target's residual streams entering a low, a middle and a high layer (by default layers 2,
L/2 and L-3, read from the model's public `hidden_states`), fused by `fc` (3h -> h), together with the embedding of
token t + 1 (the target's frozen embeddings). The layer's attention sees both (q/k/v take [embedding; feature], 2h
wide), then the MLP, a final norm and a projection over the reduced draft vocabulary. Its output state at t predicts
token t + 2; the next draft step feeds that state back in place of the target's fused feature.

    residual = feature                                          # [B, T, h]
    x = cat(input_layernorm(embedding), hidden_norm(feature))   # [B, T, 2h]
    h = residual + self_attn(x)                                 # the family's attention module, rotary at t
    state = h + mlp(post_attention_layernorm(h))                # fed back at later draft steps
    logits = lm_head(norm(state))                               # [B, T, N_draft]

The attention, MLP and norms are built by transformers from the target's config (a one-layer model of the same
family, `AutoModel.from_config`), so every family the core supports gets a drafter without copied modeling code; only
q/k/v are widened to 2h. Attention goes through transformers' SDPA with explicit boolean masks, over the drafter's
own `TreeKVCache` at inference; the proposer (`eagle3_proposer.py`) drafts level by level through `EagerLevel`, or
through the same level compiled where the target's step is (`forward/compiled_draft.py`, set by `compile_drafting`).
"""

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from ..targets import cache_keyword
from .base import LearnedDrafter
from .eagle3_proposer import EagerLevel, Eagle3Proposer
from .kinds import WeightsKind
from .registry import register
from .vocab import DraftVocab

_QKV = ("q_proj", "k_proj", "v_proj")  # the attention's projections, which read [embedding; feature]
# Config fields that describe a target family's decoder layer; anything else (token ids, dtype, names) is dropped.
_DROPPED_FIELDS = ("architectures", "auto_map", "name_or_path", "_name_or_path", "transformers_version", "dtype")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Indices into `hidden_states` (0 = embeddings, i = input of layer i): layers 2, L/2 and L-3."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class Eagle3Config:
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # hidden_states indices fused by fc
    layer: dict = field(repr=False)  # the target family's text config (model_type + fields), for one layer
    norm_aux: bool = False  # RMS-normalise each captured state before fc (EAGLE-3.1's normalised captured states)

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids must name at least one target layer")
        if "model_type" not in self.layer:
            raise ValueError("Eagle3Config.layer must hold the target family's config with its model_type")

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @classmethod
    def for_target(
        cls, target_config: PretrainedConfig, draft_vocab_size: int, aux_layer_ids=None, norm_aux: bool = False
    ) -> "Eagle3Config":
        text = target_config.get_text_config()
        aux = tuple(aux_layer_ids) if aux_layer_ids else default_aux_layers(text.num_hidden_layers)
        if any(not 0 <= i <= text.num_hidden_layers for i in aux):
            raise ValueError(f"aux_layer_ids {list(aux)} must lie in [0, {text.num_hidden_layers}] for this target")
        layer = {k: v for k, v in text.to_dict().items() if k not in _DROPPED_FIELDS}
        return cls(text.hidden_size, text.vocab_size, min(draft_vocab_size, text.vocab_size), aux, layer, norm_aux)

    def to_dict(self) -> dict:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}

    def layer_config(self) -> PretrainedConfig:
        """The family's config for the drafter's single full-attention layer."""
        fields = {**self.layer, "num_hidden_layers": 1, "vocab_size": 1}
        fields.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # no embeddings: no special ids
        if "layer_types" in fields:
            fields["layer_types"] = ["full_attention"]
        fields["use_sliding_window"] = False
        fields["sliding_window"] = None
        config = AutoConfig.for_model(**fields)
        config._attn_implementation = "sdpa"
        return config


_LAYOUT = (  # what the drafter takes from its family's model, by where it lies: Llama's decoder layout
    ("", ("layers", "norm", "rotary_emb")),
    ("layers[0].", ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
    ("layers[0].self_attn.", _QKV),
)


def _one_layer_of(config: Eagle3Config) -> nn.Module:
    """A one-layer base model of the target's family; refused with what it lacks unless it has Llama's decoder layout
    (Llama, Qwen, Mistral, Gemma 3...; not fused or otherwise named attention and norms: Phi-3, OLMo 2, GPT-2...)."""
    family_name = config.layer["model_type"]
    try:
        family = AutoModel.from_config(config.layer_config())
    except (ValueError, KeyError) as err:
        raise ValueError(
            f"an EAGLE-3 drafter for a {family_name} target: transformers cannot build its layer ({err})"
        ) from err
    layer = family.layers[0] if len(getattr(family, "layers", ())) else None
    owners = {"": family, "layers[0].": layer, "layers[0].self_attn.": getattr(layer, "self_attn", None)}
    missing = [prefix + name for prefix, names in _LAYOUT for name in names if not hasattr(owners[prefix], name)]
    if missing:
        raise ValueError(
            f"an EAGLE-3 drafter is built from one decoder layer of the target's family with Llama's layout; the "
            f"{family_name} model lacks {', '.join(missing)}: use drafter='lookup' or 'medusa' (or 'combined' with "
            "learned='medusa') with this target"
        )
    return family


class Eagle3Drafter(LearnedDrafter, nn.Module):
    """The draft model's weights and its one-step forward; `Eagle3Proposer` drives it at inference."""

    kind = "eagle3"
    computes_in_own_dtype = True  # `fuse` and `forward` cast the target's states and embeddings; logits leave in fp32

    def __init__(self, config: Eagle3Config, vocab: DraftVocab | None = None):
        super().__init__()
        self.config = config
        family = _one_layer_of(config)  # one layer of the target's family, random init
        layer, hidden = family.layers[0], config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, hidden, bias=False)
        # one norm of the family per captured state (EAGLE-3.1), or none
        norms = [copy.deepcopy(layer.input_layernorm) for _ in config.aux_layer_ids] if config.norm_aux else []
        self.aux_norms = nn.ModuleList(norms)
        self.self_attn = layer.self_attn
        for name in _QKV:  # attention reads [embedding; feature]
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.norm = family.norm
        self.rotary_emb = family.rotary_emb
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        vocab = vocab or DraftVocab.full(config.vocab_size)
        if vocab.size != config.draft_vocab_size or vocab.target_vocab_size != config.vocab_size:
            raise ValueError(
                f"draft vocabulary of {vocab.size} tokens over {vocab.target_vocab_size} does not match the config "
                f"({config.draft_vocab_size} over {config.vocab_size})"
            )
        self.register_buffer("token_ids", vocab.token_ids.clone(), persistent=False)
        self._rotary_layer_type = "full_attention" if hasattr(self.rotary_emb, "layer_types") else None

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.token_ids.cpu(), self.config.vocab_size)

    max_depth = None  # drafts autoregressively: any depth

    def proposer(self, target) -> "Eagle3Proposer":
        return Eagle3Proposer(self, target)

    def compile_drafting(self, compiler) -> None:
        """Draft through `compiler.level(self)` from now on: the forward room's compiled level of these weights
        (`forward/compiled_draft.py`), with the `EagerLevel` interface."""
        self._compiled_level = None  # cleared first: the compiler copies this module, and must not copy an earlier one
        self._compiled_level = compiler.level(self)

    def level(self):
        """What computes a drafting level: the compiled one where `compile_drafting` set one, else `EagerLevel`."""
        return getattr(self, "_compiled_level", None) or EagerLevel(self)

    @property
    def target_sizes(self) -> tuple[int, int]:
        return self.config.target_hidden_size, self.config.vocab_size

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start the projection from the target's own rows (and its final norm): the drafter's output space is the
        target's, so this is a better start than random for a short training run."""
        weight = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(weight[self.token_ids.to(weight.device)].to(self.lm_head.weight))
        target_norm = target.base_model.norm
        if target_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(target_norm.weight)

    @torch.no_grad()
    def init_layer_from_target(self, target, layer_index: int, embedding_from_feature: Sequence[str] = ()) -> None:
        """Start the decoder layer from the target's layer `layer_index`: its attention, MLP and norms as they are,
        q/k/v reading the feature half of [embedding; feature] with the target's weights, and `fc` passing the last
        aux stream through unchanged. The drafter then starts as one more target layer applied to the high stream, a
        representation the target's own head (`init_from_target`) can read.

        The embedding half of q/k/v starts at zero, except for the projections named in `embedding_from_feature`
        (of q_proj, k_proj, v_proj), whose embedding half starts as a copy of their feature half: the next token's
        embedding then enters through them from the first step."""
        unknown = set(embedding_from_feature) - set(_QKV)
        if unknown:
            raise ValueError(f"embedding_from_feature names projections of {list(_QKV)}, got {sorted(unknown)}")
        layers = target.base_model.layers
        if not 0 <= layer_index < len(layers):
            raise ValueError(f"init_layer_from_target={layer_index}: the target has layers 0..{len(layers) - 1}")
        source, hidden = layers[layer_index], self.config.hidden_size
        if hidden != self.config.target_hidden_size:
            raise ValueError("init_layer_from_target needs the drafter's width to equal the target's")
        own = {name: p for name, p in self.named_parameters()}
        for name, param in source.named_parameters():
            if name.startswith("self_attn.") and name.split(".")[1] in _QKV:
                mine = own[name]
                if name.endswith("weight"):
                    mine[:, hidden:].copy_(param)  # the feature half
                    embedding_half = mine[:, :hidden]
                    if name.split(".")[1] in embedding_from_feature:
                        embedding_half.copy_(param)
                    else:
                        embedding_half.zero_()
                else:
                    mine.copy_(param)
            elif name in own and own[name].shape == param.shape:
                own[name].copy_(param)
        self.hidden_norm.weight.copy_(source.input_layernorm.weight)
        self.fc.weight.zero_()
        self.fc.weight[:, -hidden:].copy_(torch.eye(hidden))  # the last aux stream passes through

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux hidden states [..., n * h_target] -> the drafter's input feature [..., h]."""
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if len(self.aux_norms):
            states = aux_hidden.split(self.config.target_hidden_size, dim=-1)  # n x [..., h_target]
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.aux_norms, states, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def forward(
        self,
        feature: torch.Tensor,
        embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
    ) -> torch.Tensor:
        """feature, embeds [B, T, h], position_ids [B, T], attention_mask [B, 1, T, S] bool -> state [B, T, h].

        Without a mask the T entries attend causally among themselves (and to nothing else).
        """
        residual = feature
        x = torch.cat([self.input_layernorm(embeds.to(feature.dtype)), self.hidden_norm(feature)], dim=-1)
        if self._rotary_layer_type:
            position_embeddings = self.rotary_emb(feature, position_ids, self._rotary_layer_type)
        else:
            position_embeddings = self.rotary_emb(feature, position_ids)
        attn, _ = self.self_attn(
            hidden_states=x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            is_causal=attention_mask is None,
            **{cache_keyword(self.self_attn): past_key_values},
        )
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """state [..., h] -> draft-vocabulary logits [..., N_draft]."""
        return self.lm_head(self.norm(state))


# ---------------------------------------------------------------------------------------------------------------------
# The kind: a fresh drafter; its codec (`formats/eagle3.py`) is attached by its format module


def fresh_eagle3(target, draft_vocab_size: int | None = None, aux_layer_ids=None) -> Eagle3Drafter:
    """A randomly initialised drafter over the full target vocabulary (or its first `draft_vocab_size` tokens)."""
    vocab_size = target.config.get_text_config().vocab_size
    config = Eagle3Config.for_target(target.config, draft_vocab_size or vocab_size, aux_layer_ids)
    return Eagle3Drafter(config, DraftVocab(torch.arange(config.draft_vocab_size), vocab_size))


EAGLE3 = register(WeightsKind("eagle3", fresh_eagle3))
