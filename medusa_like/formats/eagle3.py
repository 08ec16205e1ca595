"""The EAGLE-3 drafter on disk, both directions: `config.json` + `model.safetensors` in the layout vLLM and SGLang load.

Tensors (h: the drafter's width, h_t: the target's, N: draft vocabulary, V: the target's vocabulary):

    midlayer.self_attn.{q,k,v}_proj.weight   [heads * d, 2h]     q/k/v read [embedding; fused feature]
    midlayer.self_attn.o_proj.weight         [h, heads * d]
    midlayer.mlp.{gate,up}_proj.weight       [I, h]   midlayer.mlp.down_proj.weight [h, I]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight   [h]
    fc.weight [h, 3 h_t]   norm.weight [h]   lm_head.weight [N, h]
    d2t [N] int64 (target id = i + d2t[i])   t2d [V] bool

`format="eagle3"` writes the config the engines read (`LlamaForCausalLMEagle3`, the Llama layer fields,
`draft_vocab_size`, `target_hidden_size`, `eagle_config`), and refuses a layer that is not Llama-shaped.
`format="native"` writes the same tensors plus any the target family's layer adds (e.g. Gemma's q/k norms) and a
`medusa_like` section (the full layer config, the target's name and fingerprint), so every family round-trips.
Reading is strict: names, shapes, dtypes, the vocabulary maps and the fit to the target are all checked.

The aux layer ids are indices into the target's `hidden_states` (i: the residual stream entering layer i). vLLM's
`eagle_aux_hidden_state_layer_ids` use the same convention; SGLang's name layer outputs (it captures the residual
entering layer id + 1), so `format="eagle3_sglang"` writes each id minus one. Both engines default to the streams
entering layers 2, L/2 and L-3, this package's default too. A config without our `medusa_like` section is read in
vLLM's convention.
"""

import json
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import save_file

from medusa_like.drafters.base import CHECKPOINT_KEY, check_fits
from medusa_like.drafters.eagle3 import EAGLE3, Eagle3Config, Eagle3Drafter
from medusa_like.drafters.kinds import Codec
from medusa_like.drafters.vocab import DraftVocab, DraftVocabError
from medusa_like.formats.common import (
    FormatError,
    drafter_from_checkpoint,
    read_config,
    read_safetensors,
    write_export,
)
from medusa_like.formats.gguf import write_gguf
from medusa_like.formats.llama_layer import LAYER_PARTS, llama_refusal
from medusa_like.targets import target_fingerprint, weights_identity

FORMATS = ("native", "eagle3", "eagle3_sglang", "gguf")  # gguf: llama.cpp, in `gguf.py`
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
_LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "hidden_act",
)


def is_eagle3_config(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("medusa_like", {}).get("kind") == "eagle3"


def _engine_name(name: str) -> str:
    return f"midlayer.{name}" if name.startswith(LAYER_PARTS) else name


def eagle3_tensors(drafter: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the engines' names, on the CPU, plus the vocabulary maps."""
    tensors = {
        _engine_name(name): t.detach().cpu().to(dtype or t.dtype).contiguous()
        for name, t in drafter.state_dict().items()
    }
    vocab = drafter.vocab
    tensors["d2t"] = vocab.d2t.cpu().long()
    tensors["t2d"] = vocab.t2d.cpu()
    return tensors


def engine_config(drafter: Eagle3Drafter, dtype: torch.dtype, shift: int = 0) -> dict:
    """The engines' config.json; `shift` is subtracted from the aux layer ids (1 for SGLang's convention)."""
    layer, config = drafter.config.layer, drafter.config
    aux = [i - shift for i in config.aux_layer_ids]
    if min(aux) < 0:
        raise FormatError(
            f"aux layer ids {list(config.aux_layer_ids)} include the embeddings, which SGLang cannot name"
        )
    fields = {key: layer[key] for key in _LLAMA_FIELDS if layer.get(key) is not None}
    fields.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    if "rope_theta" not in fields:
        fields["rope_theta"] = (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **fields,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_eagle3(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    fmt: str,
    target,
    target_name: str,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` as `fmt` ("native", "eagle3" for vLLM, "eagle3_sglang", "gguf" for llama.cpp) into `out_dir`, as one unit (`common.write_export`); returns the directory."""
    if fmt not in FORMATS:
        raise ValueError(f"an EAGLE-3 drafter exports as one of {FORMATS}, not {fmt!r}")
    if fmt == "gguf":
        return write_gguf(drafter, out_dir, target, target_name, dtype, overwrite)
    check_fits(drafter.config.target_hidden_size, drafter.config.vocab_size, target, source="being exported")
    if fmt != "native" and (reason := llama_refusal(drafter)):
        raise FormatError(
            f"cannot export this drafter as format={fmt} for vLLM/SGLang: {reason}; format=native keeps it usable "
            "with this framework"
        )
    aux = list(drafter.config.aux_layer_ids)
    if fmt == "eagle3" and aux != sorted(set(aux)):
        raise FormatError(
            f"cannot export this drafter as format=eagle3 for vLLM: it reads aux layers {aux}, but vLLM captures each "
            f"layer once, in layer order ({sorted(set(aux))}), and would feed it other features; train it with "
            "strictly increasing drafter.module.aux_layer_ids"
        )
    dtype = dtype or next(drafter.parameters()).dtype
    tensors = eagle3_tensors(drafter, dtype)
    if fmt == "eagle3" and drafter.vocab.size == drafter.config.vocab_size:
        # a draft vocabulary that is the whole target vocabulary maps every id to itself; vLLM then builds no
        # draft_id_to_target_id and refuses to load a d2t
        del tensors["d2t"], tensors["t2d"]
    if fmt == "native":
        config = {"architectures": [ARCHITECTURE]}
    else:
        config = engine_config(drafter, dtype, shift=1 if fmt == "eagle3_sglang" else 0)
    config["medusa_like"] = {
        "kind": "eagle3",
        "config": drafter.config.to_dict(),
        "target": target_name,
        "target_fingerprint": target_fingerprint(target.config),
        "target_weights": weights_identity(target),
    }
    files = {
        WEIGHTS: lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
        "config.json": lambda path: path.write_text(json.dumps(config, indent=2) + "\n"),
    }
    return write_export(out_dir, files, {"drafter": "eagle3", "format": fmt}, overwrite)


def read_eagle3(directory: str | Path, target) -> tuple[Eagle3Drafter, dict]:
    """(drafter, meta) from a native or engine EAGLE-3 directory, checked strictly against `target`."""
    directory = Path(directory)
    config = read_config(directory)
    file = directory / WEIGHTS
    tensors = read_safetensors(file)
    ours = config.get("medusa_like") or {}
    text = target.config.get_text_config()
    if ours.get("config"):
        try:
            eagle = Eagle3Config(**{**ours["config"], "aux_layer_ids": tuple(ours["config"]["aux_layer_ids"])})
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(
                f"{directory / 'config.json'}: medusa_like.config is not an EAGLE-3 config: {err}"
            ) from err
    else:
        eagle = _config_from_engine(config, target, directory)
    check_fits(
        eagle.target_hidden_size,
        eagle.vocab_size,
        target,
        ours.get("target_fingerprint"),
        f"from {directory}",
        ours.get("target_weights"),
    )
    if any(not 0 <= i <= text.num_hidden_layers for i in eagle.aux_layer_ids):
        raise FormatError(
            f"{directory}: aux layer ids {list(eagle.aux_layer_ids)} lie outside the target's "
            f"{text.num_hidden_layers} layers"
        )
    if "lm_head.weight" not in tensors:
        raise FormatError(f"{file} has no lm_head.weight: the drafter could propose nothing (acceptance would be 1.0)")
    vocab = _draft_vocab(tensors, eagle, file)
    _check_embeddings(tensors, target, file)
    drafter = build_drafter(eagle, vocab, directory / "config.json")
    expected = {_engine_name(name): t for name, t in drafter.state_dict().items()}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise FormatError(
            f"{file}: tensors do not match an EAGLE-3 drafter of its config: missing {missing}, extra {extra}"
        )
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise FormatError(f"{file}: weights must share one floating-point dtype, found {sorted(map(str, dtypes))}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise FormatError(
                f"{file}: {name} has shape {tuple(t.shape)}, its config needs {tuple(expected[name].shape)}"
            )
    state = {name.removeprefix("midlayer."): t for name, t in tensors.items()}
    drafter = drafter.to(next(iter(dtypes)))
    drafter.load_state_dict(state, strict=True)
    meta = {"format": "native" if "config" in ours else "eagle3", "target": ours.get("target")}
    return drafter.eval(), meta


def _draft_vocab(tensors: dict, config: Eagle3Config, file: Path) -> DraftVocab:
    """The draft vocabulary from d2t/t2d (popped from `tensors`); without them only a full draft vocabulary, which
    maps every id to itself (vLLM's layout for it)."""
    if "d2t" not in tensors and "t2d" not in tensors and config.draft_vocab_size == config.vocab_size:
        return DraftVocab.full(config.vocab_size)
    for name in ("d2t", "t2d"):
        if name not in tensors:
            raise FormatError(f"{file} has no {name}: the draft vocabulary cannot be mapped to the target's")
    try:
        return DraftVocab.from_maps(tensors.pop("d2t"), tensors.pop("t2d"))
    except DraftVocabError as err:
        raise FormatError(f"{file}: {err}") from err


def build_drafter(config: Eagle3Config, vocab: DraftVocab, source) -> Eagle3Drafter:
    """The drafter a stored config describes; a layer config transformers cannot build is a `FormatError` naming
    `source`, not a traceback from inside transformers."""
    try:
        return Eagle3Drafter(config, vocab)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as err:
        raise FormatError(f"{source}: its EAGLE-3 layer config cannot be built by transformers: {err}") from err


def eagle3_from_checkpoint(checkpoint: dict, path: Path, target) -> tuple[Eagle3Drafter, dict]:
    """(drafter, meta) from a loaded training checkpoint (`common.read_checkpoint`), checked against `target`."""
    info = checkpoint[CHECKPOINT_KEY]
    try:
        config = Eagle3Config(**info["config"])
        vocab = DraftVocab(torch.tensor(info["draft_token_ids"], dtype=torch.long), config.vocab_size)
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{path}: {CHECKPOINT_KEY} does not describe an EAGLE-3 drafter: {err}") from err
    sizes = (config.target_hidden_size, config.vocab_size)
    return drafter_from_checkpoint(checkpoint, path, target, sizes, lambda: build_drafter(config, vocab, path))


def _config_from_engine(config: dict, target, directory: Path) -> Eagle3Config:
    """An engine config (no `medusa_like` section): a Llama-shaped layer, rebuilt from its fields."""
    missing = [k for k in ("hidden_size", "draft_vocab_size", "vocab_size", "num_attention_heads") if k not in config]
    if missing:
        raise FormatError(f"{directory / 'config.json'} lacks {missing} for an EAGLE-3 drafter")
    eagle_config = config.get("eagle_config") or {}
    text = target.config.get_text_config()
    aux = (
        eagle_config.get("eagle_aux_hidden_state_layer_ids") or Eagle3Config.for_target(target.config, 1).aux_layer_ids
    )
    layer = {k: config[k] for k in _LLAMA_FIELDS if k in config}
    layer.update(model_type="llama", vocab_size=config["vocab_size"], attention_bias=False, mlp_bias=False)
    layer.setdefault("num_key_value_heads", config["num_attention_heads"])
    return Eagle3Config(
        target_hidden_size=config.get("target_hidden_size", text.hidden_size),
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=tuple(aux),
        layer=layer,
    )


def _check_embeddings(tensors: dict, target, file: Path) -> None:
    """An exported `embed_tokens` is only tolerated when it is the target's own (random ones run silently wrong)."""
    for name in ("embed_tokens.weight", "midlayer.embed_tokens.weight"):
        if name in tensors:
            stored = tensors.pop(name)
            own = target.get_input_embeddings().weight.detach().cpu()
            if stored.shape != own.shape or not torch.allclose(stored.float(), own.float(), atol=1e-2, rtol=1e-2):
                raise FormatError(
                    f"{file}: {name} is not the target's input embedding: a drafter with other embeddings drafts "
                    "from the wrong token vectors"
                )


EAGLE3.attach(Codec(FORMATS, is_eagle3_config, read_eagle3, eagle3_from_checkpoint, write_eagle3))
