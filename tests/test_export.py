"""Export and import of heads in every format: lossless round trips, exact file layouts, and every error.

All on tiny random Llama targets built from a config (nothing downloaded). The expected layouts below are written out
by hand from the serving engines' documentation, not derived from the exporter.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.medusa import MedusaHeads
from medusa_like.formats import load_drafter, read_drafter, save_drafter
from medusa_like.formats.common import FormatError
from medusa_like.formats.heads_io import export_heads, read_heads
from medusa_like.targets import target_fingerprint

from .conftest import HIDDEN, VOCAB, compose_config, random_heads, tiny_target

H, V, K = HIDDEN, VOCAB, 3
SMALL = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def llama(seed: int = 0, **overrides):
    """The tests' tiny llama, one layer, untied lm_head (`overrides` change its config)."""
    model = tiny_target("llama", seed, **{**SMALL, **overrides})
    model.config.name_or_path = f"tiny-llama-{seed}"
    return model


def logits(heads: MedusaHeads, target) -> torch.Tensor:
    hidden = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return heads(hidden, target.get_output_embeddings())


def export(heads, tmp_path, fmt, target, name="out") -> Path:
    return export_heads(heads, tmp_path / name, fmt, target_model=target, target_name="tiny/base")


@pytest.fixture(scope="module")
def target():
    return llama()


# ---- hand-written layouts (K=3 heads, H=32, V=128) ----


def block_spec(prefix_fmt: str, num_layers: int, bias: bool = True) -> dict:
    spec = {}
    for k in range(K):
        for layer in range(num_layers):
            base = prefix_fmt.format(k=k, l=layer)
            spec[f"{base}.weight"] = (H, H)
            if bias:
                spec[f"{base}.bias"] = (H,)
    return spec


EXPECTED = {
    # (format, num_layers, shared): (weights file, {name: shape}, config subset)
    ("native", 2, False): (
        "model.safetensors",
        {**block_spec("blocks.{k}.{l}.linear", 2), **{f"lm_heads.{k}.weight": (V, H) for k in range(K)}},
        {"medusa_like_format": 1, "head_type": "medusa", "num_heads": 3, "num_layers": 2, "hidden_size": H},
    ),
    ("native", 1, True): (
        "model.safetensors",
        block_spec("blocks.{k}.{l}.linear", 1),
        {"shared_lm_head": True, "vocab_size": V, "target": "tiny/base"},
    ),
    ("medusa", 2, True): (
        "medusa_lm_head.safetensors",
        {**block_spec("{k}.{l}.linear", 2), **{f"{k}.2.weight": (V, H) for k in range(K)}},
        {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "tiny/base"},
    ),
    ("medusa", 1, False): (
        "medusa_lm_head.safetensors",
        {**block_spec("{k}.{l}.linear", 1), **{f"{k}.1.weight": (V, H) for k in range(K)}},
        {"medusa_num_heads": 3, "medusa_num_layers": 1},
    ),
    ("vllm", 2, False): (
        "model.safetensors",
        {**block_spec("blocks.{k}.layers.{l}", 2), **{f"lm_heads.{k}.weight": (V, H) for k in range(K)}},
        {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": H,
            "vocab_size": V,
            "num_heads": 3,
            "num_hidden_layers": 2,
            "medusa_fc_bias": True,
        },
    ),
    ("vllm", 1, True): (
        "model.safetensors",
        {**block_spec("blocks.{k}.layers.{l}", 1), "lm_heads.0.weight": (V, H)},
        {"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1, "original_lm_head": True},
    ),
    ("tgi", 1, True): (
        "medusa_lm_head.safetensors",
        block_spec("{k}.{l}.linear", 1),
        {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny/base"},
    ),
}


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: f"{c[0]}-L{c[1]}-{'shared' if c[2] else 'own'}")
def test_round_trip_is_exact_and_layout_matches_spec(case, target, tmp_path):
    fmt, num_layers, shared = case
    weights_file, spec, config_subset = EXPECTED[case]
    heads = random_heads(K, num_layers, shared, seed=1)
    out = export(heads, tmp_path, fmt, target)

    assert sorted(p.name for p in out.iterdir()) == sorted([".medusa_like_export", "config.json", weights_file])
    tensors = load_file(out / weights_file)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == spec
    config = json.loads((out / "config.json").read_text())
    assert {key: config[key] for key in config_subset} == config_subset
    if fmt == "native":
        assert config["target_fingerprint"] == target_fingerprint(target.config)
    if shared and fmt in ("medusa", "vllm"):  # the target's lm_head is stored for the engine
        assert torch.equal(tensors["0.2.weight" if fmt == "medusa" else "lm_heads.0.weight"], target.lm_head.weight)

    loaded, info = read_heads(out, target)
    assert info["format"] == fmt
    assert loaded.config == heads.config
    assert torch.equal(logits(loaded, target), logits(heads, target))


def test_own_projections_equal_to_the_target_import_as_shared(target, tmp_path):
    heads = random_heads(K, 1, shared=False, seed=1)
    heads.init_projections_from(target.lm_head.weight)
    for fmt in ("medusa", "vllm"):
        loaded = load_drafter(export(heads, tmp_path, fmt, target, fmt), target)
        assert loaded.config.shared_lm_head and loaded.lm_heads is None
        hidden = torch.randn(2, 5, H)
        with torch.no_grad():  # the same numbers through the shared path's one batched projection
            assert torch.equal(loaded(hidden, target.lm_head), target.lm_head(heads.features(hidden)))


def test_bf16_export_round_trips_in_bf16(target, tmp_path):
    heads = random_heads(K, 1, shared=True, seed=1)
    out = export_heads(heads, tmp_path / "bf16", "vllm", target_model=target, target_name="t", dtype=torch.bfloat16)
    loaded = load_drafter(out, target)  # the bf16 lm_head still counts as the fp32 target's
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert torch.equal(logits(loaded.float(), target), logits(heads.to(torch.bfloat16).float(), target))


# ---- refusals on export ----


@pytest.mark.parametrize(
    "num_layers, shared, reason",
    [(2, True, "2 residual blocks per head"), (1, False, "their own vocabulary projections")],
)
def test_tgi_refuses_heads_it_cannot_hold(num_layers, shared, reason, target, tmp_path):
    with pytest.raises(ValueError, match=reason):
        export(random_heads(K, num_layers, shared, seed=1), tmp_path, "tgi", target)
    assert not (tmp_path / "out").exists()


def test_export_refuses_other_weight_files_and_unknown_format(target, tmp_path):
    out = export(random_heads(K, seed=1), tmp_path, "native", target)
    with pytest.raises(FileExistsError, match="model.safetensors"):
        export(random_heads(K, seed=1), tmp_path, "medusa", target)
    with pytest.raises(FileExistsError, match="overwrite=true"):
        export(random_heads(K, seed=5), tmp_path, "native", target)  # a previous export stays unless asked
    export_heads(random_heads(K, seed=5), out, "native", target_model=target, target_name="tiny/base", overwrite=True)
    assert torch.equal(logits(load_drafter(out, target), target), logits(random_heads(K, seed=5), target))
    with pytest.raises(ValueError, match="'onnx'"):
        export(random_heads(K, seed=1), tmp_path, "onnx", target, "x")


def test_export_refuses_heads_of_another_target(tmp_path):
    with pytest.raises(DrafterMismatchError, match="hidden size 16"):
        export(random_heads(K, hidden=16, seed=1), tmp_path, "native", llama())


def test_interrupted_write_leaves_the_previous_file(target, tmp_path, monkeypatch):
    out = export(random_heads(K, seed=1), tmp_path, "native", target)
    before = (out / "model.safetensors").read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr("medusa_like.formats.heads_io.save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        export_heads(random_heads(K, seed=2), out, "native", target_model=target, target_name="x", overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [".medusa_like_export", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left beside it


# ---- broken files ----


@pytest.mark.parametrize("fmt", ["native", "medusa", "vllm", "tgi"])
def test_truncated_or_garbage_weights_are_named(fmt, target, tmp_path):
    out = export(random_heads(K, seed=1), tmp_path, fmt, target)
    weights = next(out.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(FormatError, match=rf"{weights.name} is not a readable safetensors file"):
        load_drafter(out, target)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(FormatError, match="truncated or corrupted"):
        load_drafter(out, target)


def rewrite(out: Path, edit) -> None:
    """Apply edit(tensors) to the directory's weights file and save it back."""
    weights = next(out.glob("*.safetensors"))
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)


def test_missing_extra_and_misshapen_tensors_are_named(target, tmp_path):
    out = export(random_heads(K, 2, shared=False, seed=1), tmp_path, "medusa", target)
    rewrite(out, lambda t: t.pop("1.1.linear.bias"))
    with pytest.raises(FormatError, match=r"missing tensors '1\.1\.linear\.bias'"):
        load_drafter(out, target)

    out = export(random_heads(K, 1, seed=1), tmp_path, "native", target, "extra")
    rewrite(out, lambda t: t.update({"lm_heads.0.weight": torch.zeros(V, H)}))
    with pytest.raises(FormatError, match=r"unexpected tensors 'lm_heads\.0\.weight'"):
        load_drafter(out, target)

    out = export(random_heads(K, 1, shared=False, seed=1), tmp_path, "vllm", target, "shape")
    rewrite(out, lambda t: t.update({"lm_heads.2.weight": torch.zeros(V - 1, H)}))
    with pytest.raises(FormatError, match=rf"'lm_heads\.2\.weight' has shape \({V - 1}, {H}\), expected \({V}, {H}\)"):
        load_drafter(out, target)


@pytest.mark.parametrize(
    "fmt, key, pattern",
    [
        ("native", "num_heads", r"num_heads=2.*unexpected tensors 'blocks\.2\.0\.linear\.bias'"),
        ("medusa", "medusa_num_heads", r"medusa_num_heads=2.*unexpected tensors '2\.0\.linear\.bias'"),
        ("vllm", "num_heads", r"num_heads=2.*unexpected tensors 'blocks\.2\.layers\.0\.bias'"),
        ("tgi", "medusa_num_heads", r"medusa_num_heads=2.*unexpected tensors '2\.0\.linear\.bias'"),
    ],
)
def test_config_head_count_disagreeing_with_weights(fmt, key, pattern, target, tmp_path):
    out = export(random_heads(K, 1, seed=1), tmp_path, fmt, target)
    config = json.loads((out / "config.json").read_text())
    config[key] = 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=pattern):
        load_drafter(out, target)
    config[key] = 4
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"missing tensors '(blocks\.)?3\."):
        load_drafter(out, target)


def test_bad_paths_and_configs(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nowhere", target)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FormatError, match="no config.json"):
        load_drafter(empty, target)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_drafter(empty, target)
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FormatError, match="is not a drafter config of any known format"):
        load_drafter(empty, target)
    (empty / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    (empty / "medusa_lm_head.pt").write_bytes(b"pickle")
    with pytest.raises(FormatError, match=r"medusa_lm_head.safetensors is missing.*convert them to safetensors"):
        load_drafter(empty, target)
    out = export(random_heads(K, seed=1), tmp_path, "native", target)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_layers": "1"}))
    with pytest.raises(FormatError, match="field 'num_layers' is '1', expected a int"):
        load_drafter(out, target)
    with pytest.raises(FormatError, match="is a file"):
        load_drafter(out / "config.json", target)


# ---- the target ----


@pytest.mark.parametrize("fmt", ["native", "medusa", "vllm", "tgi"])
def test_target_with_another_hidden_size_or_vocabulary(fmt, target, tmp_path):
    out = export(random_heads(K, seed=1), tmp_path, fmt, target)
    with pytest.raises(DrafterMismatchError, match=r"hidden size 32, but target 'tiny-llama-0' has hidden size 64"):
        load_drafter(out, llama(hidden_size=64))
    if fmt == "tgi":  # TGI's compact form stores no projection, so no vocabulary to disagree with
        assert load_drafter(out, llama(vocab_size=256)).config.vocab_size == 256
        return
    with pytest.raises(DrafterMismatchError, match=rf"vocabulary size {V}, but target .* has vocabulary size 256"):
        load_drafter(out, llama(vocab_size=256))


def test_target_with_another_fingerprint(target, tmp_path):
    out = save_drafter(random_heads(K, seed=1), tmp_path / "native", target, "tiny/base")
    with pytest.raises(DrafterMismatchError, match="fingerprint"):
        load_drafter(out, llama(num_hidden_layers=2))


def test_stored_lm_head_of_another_target(target, tmp_path):
    out = export(random_heads(K, shared=True, seed=1), tmp_path, "vllm", target)
    with pytest.raises(DrafterMismatchError, match=r"lm_heads\.0\.weight \(original_lm_head: true\) differs"):
        load_drafter(out, llama(seed=3))


# ---- training checkpoints ----


def write_checkpoint(path: Path, heads: MedusaHeads, target, fingerprint: str | None = None) -> Path:
    """A checkpoint following the training module's contract (plus the optimizer state it also holds)."""
    torch.save(
        {
            "state_dict": {f"heads.{name}": t for name, t in heads.state_dict().items()},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3}]}],
            "global_step": 12,
            "epoch": 1,
            "medusa_like": {
                "heads_config": heads.config.to_dict(),
                "target": "tiny/base",
                "target_fingerprint": fingerprint or target_fingerprint(target.config),
            },
        },
        path,
    )
    return path


def test_checkpoint_to_every_format(target, tmp_path):
    heads = random_heads(K, 1, shared=True, seed=1)
    ckpt = write_checkpoint(tmp_path / "last.ckpt", heads, target)
    from_ckpt, meta = read_drafter(ckpt, target)
    assert meta["target"] == "tiny/base" and meta["global_step"] == 12 and meta["format"] == "checkpoint"
    assert torch.equal(logits(from_ckpt, target), logits(heads, target))
    for fmt in ("native", "medusa", "vllm", "tgi"):
        out = export(load_drafter(ckpt, target), tmp_path, fmt, target, fmt)
        assert torch.equal(logits(load_drafter(out, target), target), logits(heads, target))


def test_checkpoint_errors(target, tmp_path):
    heads = random_heads(K, 1, seed=1)
    ckpt = write_checkpoint(tmp_path / "other.ckpt", heads, target, fingerprint="0" * 16)
    with pytest.raises(DrafterMismatchError, match="fingerprint 0000000000000000"):
        load_drafter(ckpt, target)
    state = {"state_dict": {"heads.blocks.0.0.linear.weight": torch.zeros(H, H)}, "epoch": 0}
    torch.save(state, tmp_path / "plain.ckpt")
    with pytest.raises(FormatError, match="not a medusa_like training checkpoint"):
        read_drafter(tmp_path / "plain.ckpt", target)
    good = write_checkpoint(tmp_path / "good.ckpt", heads, target).read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(good[: len(good) // 2])
    with pytest.raises(FormatError, match="not a readable training checkpoint"):
        read_drafter(tmp_path / "cut.ckpt", target)
    ckpt = write_checkpoint(tmp_path / "less.ckpt", random_heads(K, 1, seed=1), target)
    checkpoint = torch.load(ckpt, weights_only=True)
    del checkpoint["state_dict"]["heads.blocks.1.0.linear.weight"]
    torch.save(checkpoint, ckpt)
    with pytest.raises(FormatError, match=r"missing tensors 'blocks\.1\.0\.linear\.weight'"):
        read_drafter(ckpt, target)


# ---- the Hydra entry point ----


def save_tiny_target(directory: Path) -> Path:
    """A tiny target directory that `targets.load_target` opens: model and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    llama().save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(V - 1)} | {"[UNK]": V - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(directory)
    return directory


def test_hydra_entry_point_exports_a_checkpoint(target, tmp_path):
    from train.export import export as run_export

    target_dir = save_tiny_target(tmp_path / "target")
    heads = random_heads(K, 1, shared=True, seed=1)
    ckpt = write_checkpoint(tmp_path / "last.ckpt", heads, target)
    cfg = compose_config(  # the hub model's config, its weights replaced by a saved tiny target
        "export",
        tmp_path / "run",
        "model=smollm2_135m",
        f"model.name_or_path={target_dir}",
        f"drafter.path={ckpt}",
        "format=vllm",
        f"out={tmp_path / 'vllm'}",
    )
    out = run_export(cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["original_lm_head"] is True
    assert torch.equal(logits(load_drafter(out, target), target), logits(heads, target))


def test_tied_embeddings_target(tmp_path):
    """A target whose lm_head is its input embedding (SmolLM2, Gemma): the stored lm_head is that shared matrix."""
    tied = llama(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    heads = random_heads(K, 1, shared=True, seed=1)
    for fmt in ("native", "medusa", "vllm", "tgi"):
        loaded = load_drafter(export(heads, tmp_path, fmt, tied, fmt), tied)
        assert loaded.config.shared_lm_head
        assert torch.equal(logits(loaded, tied), logits(heads, tied))


def test_vllm_blocks_without_bias_import_as_zero_bias(target, tmp_path):
    heads = random_heads(K, 2, shared=False, seed=1)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    out = export(heads, tmp_path, "vllm", target)
    rewrite(out, lambda t: [t.pop(name) for name in [n for n in t if n.endswith(".bias")]])
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    assert torch.equal(logits(load_drafter(out, target), target), logits(heads, target))


def test_export_never_overwrites_what_it_did_not_write(target, tmp_path):
    model_dir = tmp_path / "model"
    llama().save_pretrained(model_dir)  # another model's weights and config
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="not a previous export"):
            export_heads(
                random_heads(K, seed=1), model_dir, "native", target_model=target, target_name="x", overwrite=overwrite
            )
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
    out = export(random_heads(K, seed=1), tmp_path, "vllm", target)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"files no export wrote \(\['notes.txt'\]\)"):
        export_heads(random_heads(K, seed=2), out, "vllm", target_model=target, target_name="x", overwrite=True)


def test_temporaries_of_a_killed_export_are_cleaned_up(target, tmp_path):
    dead = tmp_path / ".out.tmp-999999999"  # no such process
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half of a big file")
    out = export(random_heads(K, seed=1), tmp_path, "native", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == [".medusa_like_export", "config.json", "model.safetensors"]
