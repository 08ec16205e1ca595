"""The block drafter on disk, both directions: `config.json` + `model.safetensors` in the layout vLLM and SGLang load for
DFlash drafters, and a training checkpoint.

Tensors (h: the drafter's width, h_t: the target's, n: feature layers, N: draft vocabulary, V: the target's):

    layers.{i}.self_attn.{q,k,v,o}_proj.weight  layers.{i}.self_attn.{q_norm,k_norm}.weight   (Qwen3's layer)
    layers.{i}.mlp.{gate,up,down}_proj.weight  layers.{i}.{input_layernorm,post_attention_layernorm}.weight
    fc.weight [h, n h_t]   hidden_norm.weight [h]   norm.weight [h]   lm_head.weight [N, h]
    mask_embedding [h]     the learned mask embedding (a target without a mask token), else absent
    d2t [N] int64          target id = i + d2t[i], where the draft vocabulary is not the target's whole

With a learned mask embedding, format="dflash" also writes it as `mask_embedding.pt` ({"mask_token_id", "embedding"}):
vLLM reads the embedding from that file only, and drops a `mask_embedding` tensor of the weights file (then its
drafts fill the block with `mask_token_id`'s own embedding and are rarely accepted, lossless but slow).

`config.json` is a Qwen3 config of the drafter's layers (`architectures: ["DFlashDraftModel"]`) with `dflash_config`:
`target_layer_ids` (layer outputs: each feature layer's `hidden_states` index minus one), `block_size`,
`mask_token_id` (with a learned mask embedding, a token id the mask positions are filled with, whose embedding the
engines replace by `mask_embedding`), plus `draft_vocab_size` and `num_target_layers`, and a `medusa_like` section (the
drafter's own config, the target's name and fingerprint). `format="native"` writes the same tensors with the
`medusa_like` section alone, so that any drafter round-trips (feature layers that include the embeddings, which
`target_layer_ids` cannot name, are refused by `format="dflash"` only). Reading is strict: names, shapes, dtypes, the
vocabulary map, the mask token and the fit to the target are all checked. A DFlash directory without `lm_head` (the
reference drafters share the target's head) is read with the target's own rows as the drafter's head.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from medusa_like.drafters.base import CHECKPOINT_KEY, check_fits
from medusa_like.drafters.block import BLOCK, LAYER_FAMILY, BlockConfig, BlockDrafter
from medusa_like.drafters.kinds import Codec
from medusa_like.drafters.vocab import DraftVocab, DraftVocabError
from medusa_like.formats.common import (
    FormatError,
    drafter_from_checkpoint,
    read_config,
    read_safetensors,
    write_export,
)
from medusa_like.targets import target_fingerprint, weights_identity

FORMATS = ("native", "dflash")
WEIGHTS = "model.safetensors"
MASK_EMBEDDING = "mask_embedding.pt"  # where vLLM reads a DFlash drafter's own mask embedding
ARCHITECTURE = "DFlashDraftModel"
_LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "hidden_act", "max_position_embeddings", "rope_parameters", "num_hidden_layers",
)  # fmt: skip


def is_block_config(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("medusa_like", {}).get("kind") == "block"


def export_mask_token(drafter: BlockDrafter, target) -> int:
    """The id an engine fills the mask positions with: the drafter's mask token, or with a learned embedding (which the
    engines substitute for that id's) the target's pad token where it has one apart from EOS, else the last id."""
    if drafter.config.mask_token_id is not None:
        return drafter.config.mask_token_id
    text = target.config.get_text_config()
    pad, eos = getattr(text, "pad_token_id", None), getattr(text, "eos_token_id", None)
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    if isinstance(pad, int) and pad not in eos and 0 <= pad < drafter.config.vocab_size:
        return pad
    return drafter.config.vocab_size - 1


def engine_config(drafter: BlockDrafter, target, dtype: torch.dtype) -> dict:
    """DFlash's config.json: the layers' Qwen3 fields and `dflash_config`."""
    config = drafter.config
    if min(config.feature_layers) < 1:
        raise FormatError(
            f"feature layers {list(config.feature_layers)} include the embeddings, which DFlash's target_layer_ids "
            "(layer outputs) cannot name"
        )
    layer = {key: config.layer[key] for key in _LAYER_FIELDS if key in config.layer}
    rope = layer.get("rope_parameters") or {}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": LAYER_FAMILY,
        **layer,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "attention_bias": False,
        "is_causal": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "num_target_layers": target.config.get_text_config().num_hidden_layers,
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in config.feature_layers],
            "block_size": config.block_size,
            "mask_token_id": export_mask_token(drafter, target),
        },
        "dtype": str(dtype).removeprefix("torch."),
    }


def write_block(
    drafter: BlockDrafter,
    out_dir: str | Path,
    fmt: str,
    target,
    target_name: str,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` as `fmt` ("native", or "dflash" for vLLM and SGLang) into `out_dir`, as one unit
    (`common.write_export`); returns the directory."""
    if fmt not in FORMATS:
        raise ValueError(f"a block drafter exports as one of {FORMATS}, not {fmt!r}")
    check_fits(drafter.config.target_hidden_size, drafter.config.vocab_size, target, source="being exported")
    if fmt == "dflash" and drafter.config.predecessor_rank:
        raise FormatError(
            "cannot export this drafter as format=dflash for vLLM/SGLang: its predecessor head (predecessor_rank="
            f"{drafter.config.predecessor_rank}) has no place in the DFlash layout; format=native keeps it usable with "
            "this framework"
        )
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {name: t.detach().cpu().to(dtype).contiguous() for name, t in drafter.state_dict().items()}
    if drafter.vocab.size != drafter.config.vocab_size:
        tensors["d2t"] = drafter.vocab.d2t.cpu().long()
    config = engine_config(drafter, target, dtype) if fmt == "dflash" else {"architectures": [ARCHITECTURE]}
    config["medusa_like"] = {
        "kind": BLOCK.name,
        "config": drafter.config.to_dict(),
        "target": target_name,
        "target_fingerprint": target_fingerprint(target.config),
        "target_weights": weights_identity(target),
    }
    files = {
        WEIGHTS: lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
        "config.json": lambda path: path.write_text(json.dumps(config, indent=2) + "\n"),
    }
    if fmt == "dflash" and "mask_embedding" in tensors:
        mask = {"mask_token_id": config["dflash_config"]["mask_token_id"], "embedding": tensors["mask_embedding"]}
        files[MASK_EMBEDDING] = lambda path: torch.save(mask, path)
    return write_export(out_dir, files, {"drafter": BLOCK.name, "format": fmt}, overwrite)


def read_block(directory: str | Path, target) -> tuple[BlockDrafter, dict]:
    """(drafter, meta) from a native or DFlash directory, checked strictly against `target`."""
    directory = Path(directory)
    config = read_config(directory)
    file = directory / WEIGHTS
    tensors = read_safetensors(file)
    if "mask_embedding" not in tensors and (directory / MASK_EMBEDDING).is_file():
        tensors["mask_embedding"] = _mask_embedding_file(directory / MASK_EMBEDDING, config)
    ours = config.get("medusa_like") or {}
    if ours.get("config"):
        try:
            block = BlockConfig(**{**ours["config"], "feature_layers": tuple(ours["config"]["feature_layers"])})
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(
                f"{directory / 'config.json'}: medusa_like.config is not a block drafter config: {err}"
            ) from err
    else:
        block = _config_from_engine(config, tensors, target, directory)
    check_fits(
        block.target_hidden_size,
        block.vocab_size,
        target,
        ours.get("target_fingerprint"),
        f"from {directory}",
        ours.get("target_weights"),
    )
    layers = target.config.get_text_config().num_hidden_layers
    if any(not 0 <= i <= layers for i in block.feature_layers):
        raise FormatError(f"{directory}: feature layers {list(block.feature_layers)} lie outside the target's {layers}")
    if "lm_head.weight" not in tensors:  # the reference drafters project through the target's own head
        if block.draft_vocab_size != block.vocab_size:
            raise FormatError(f"{file} has no lm_head.weight for its draft vocabulary of {block.draft_vocab_size}")
        head = target.get_output_embeddings().weight.detach().cpu()
        tensors["lm_head.weight"] = head.to(next(iter(tensors.values())).dtype)
    vocab = _draft_vocab(tensors, block, file)
    drafter = build_drafter(block, vocab, directory / "config.json")
    _load(drafter, tensors, file)
    meta = {"format": "native" if ours else "dflash", "target": ours.get("target")}
    return drafter.eval(), meta


def _mask_embedding_file(path: Path, config: dict) -> torch.Tensor:
    """The mask embedding [h] of a DFlash directory's `mask_embedding.pt` (a tensor, or {"mask_token_id",
    "embedding"} for the config's mask token)."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:  # torch raises several types for a truncated or foreign file
        raise FormatError(f"{path} is not a mask embedding torch can read: {err}") from err
    if isinstance(state, dict):
        expected = (config.get("dflash_config") or {}).get("mask_token_id")
        if state.get("mask_token_id", expected) != expected:
            raise FormatError(
                f"{path} is the embedding of mask token {state.get('mask_token_id')}, the config's is {expected}"
            )
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor):
        raise FormatError(f"{path} holds no mask embedding tensor")
    return state.reshape(-1)


def _config_from_engine(config: dict, tensors: dict, target, directory: Path) -> BlockConfig:
    """A DFlash config without our section: the layers' fields, `dflash_config`, and the mask embedding if shipped."""
    dflash = config.get("dflash_config") or {}
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size") if k not in config]
    missing += [f"dflash_config.{k}" for k in ("target_layer_ids", "block_size") if k not in dflash]
    if missing:
        raise FormatError(f"{directory / 'config.json'} lacks {missing} for a DFlash drafter")
    text = target.config.get_text_config()
    layer = {key: config[key] for key in _LAYER_FIELDS if key in config}
    layer.setdefault("num_key_value_heads", config["num_attention_heads"])
    layer.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    layer.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": config.get("rope_theta", 1e6)})
    layer.setdefault("rms_norm_eps", 1e-6)
    layer.setdefault("intermediate_size", 4 * config["hidden_size"])
    layer.setdefault("max_position_embeddings", text.max_position_embeddings)
    layer["model_type"] = LAYER_FAMILY
    fc = tensors.get("fc.weight")
    width = config.get("target_hidden_size") or (
        fc.shape[1] // len(dflash["target_layer_ids"]) if fc is not None else text.hidden_size
    )
    mask = None if "mask_embedding" in tensors else dflash.get("mask_token_id", config.get("mask_token_id"))
    try:
        return BlockConfig(
            target_hidden_size=int(width),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            feature_layers=tuple(int(i) + 1 for i in dflash["target_layer_ids"]),
            block_size=int(dflash["block_size"]),
            mask_token_id=None if mask is None else int(mask),
            layer=layer,
        )
    except (TypeError, ValueError) as err:
        raise FormatError(f"{directory / 'config.json'}: not a usable DFlash drafter config: {err}") from err


def _draft_vocab(tensors: dict, config: BlockConfig, file: Path) -> DraftVocab:
    """The draft vocabulary from d2t (popped from `tensors`); without it the whole target vocabulary."""
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # EAGLE-style exports carry it too; d2t alone says which tokens
    if d2t is None:
        if config.draft_vocab_size != config.vocab_size:
            raise FormatError(f"{file} has no d2t: its draft vocabulary of {config.draft_vocab_size} cannot be mapped")
        return DraftVocab.full(config.vocab_size)
    try:
        ids = d2t.long() + torch.arange(d2t.numel())
        vocab = DraftVocab(ids, config.vocab_size)
    except DraftVocabError as err:
        raise FormatError(f"{file}: d2t {err}") from err
    if vocab.size != config.draft_vocab_size:
        raise FormatError(f"{file}: d2t maps {vocab.size} tokens, its config says {config.draft_vocab_size}")
    return vocab


def build_drafter(config: BlockConfig, vocab: DraftVocab, source) -> BlockDrafter:
    """The drafter a stored config describes; a layer config transformers cannot build is a `FormatError`."""
    try:
        return BlockDrafter(config, vocab)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise FormatError(f"{source}: its block drafter config cannot be built by transformers: {err}") from err


def _load(drafter: BlockDrafter, tensors: dict, file) -> None:
    """`tensors` into `drafter`, strictly: the same names, shapes and one floating dtype."""
    expected = drafter.state_dict()
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise FormatError(
            f"{file}: tensors do not match a block drafter of its config: missing {missing}, extra {extra}"
        )
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise FormatError(f"{file}: weights must share one floating-point dtype, found {sorted(map(str, dtypes))}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise FormatError(
                f"{file}: {name} has shape {tuple(t.shape)}, its config needs {tuple(expected[name].shape)}"
            )
    drafter.to(next(iter(dtypes)))
    drafter.load_state_dict(tensors, strict=True)


def block_from_checkpoint(checkpoint: dict, path: Path, target) -> tuple[BlockDrafter, dict]:
    """(drafter, meta) from a loaded training checkpoint (`common.read_checkpoint`), checked against `target`."""
    info = checkpoint[CHECKPOINT_KEY]
    try:
        config = BlockConfig(**{**info["config"], "feature_layers": tuple(info["config"]["feature_layers"])})
        vocab = DraftVocab(torch.tensor(info["draft_token_ids"], dtype=torch.long), config.vocab_size)
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{path}: {CHECKPOINT_KEY} does not describe a block drafter: {err}") from err
    sizes = (config.target_hidden_size, config.vocab_size)
    return drafter_from_checkpoint(checkpoint, path, target, sizes, lambda: build_drafter(config, vocab, path))


BLOCK.attach(Codec(FORMATS, is_block_config, read_block, block_from_checkpoint, write_block))
