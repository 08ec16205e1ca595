"""One name per setting and one home per rule on the training side: the target's dtype is `model.dtype`, `distill:` is
defined once, config checks refuse keys the config lacks, and the draft vocabulary comes from the training split."""

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from medusa_like.cli import DISTILL_CHECKS, TRAIN_CHECKS, ConfigError, Number, check_config, computes_in_bf16
from medusa_like.data.prepare import load_model
from medusa_like.data.split import draft_vocab_from_training_split, is_validation
from medusa_like.data.storage import save_dataset

from .conftest import compose_config

MODELS = ("smollm2_135m", "tiny_llama", "tiny_qwen2", "llama3_8b_instruct", "qwen2_5_7b_instruct", "vicuna_7b")


def keys(node, prefix: str = "") -> set[str]:
    """Every dotted key of a config, without resolving interpolations."""
    out = set()
    if isinstance(node, DictConfig):
        for k in node.keys():
            out |= {f"{prefix}{k}"} | keys(node._get_node(k), f"{prefix}{k}.")
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node._iter_ex(resolve=False)):
            out |= keys(item, f"{prefix}{i}.")
    return out


@pytest.mark.parametrize("model", MODELS)
def test_the_target_dtype_has_one_name_model_dtype(tmp_path, model):
    for name in ("train", "distill"):
        cfg = compose_config(name, tmp_path, f"model={model}", "model.dtype=bfloat16")
        assert OmegaConf.to_container(cfg.model.loader, resolve=True)["dtype"] == "bfloat16"
        assert not [k for k in keys(cfg) if k.rsplit(".", 1)[-1] == "target_dtype"]


def test_model_dtype_reaches_the_loaded_target(tmp_path, train_cfg):
    target, _ = load_model(train_cfg("model.dtype=bfloat16").model)
    assert target.dtype == torch.bfloat16
    target, _ = load_model(train_cfg().model)
    assert target.dtype == torch.float32
    eagle3 = compose_config("train", tmp_path, "experiment=smollm2_eagle3")
    # the default experiment trains in bf16 only where the machine computes in it natively (else fp32 is ~10x faster)
    native = computes_in_bf16()
    assert eagle3.model.dtype == ("bfloat16" if native else "float32") and eagle3.drafter.kind == "eagle3"
    assert eagle3.trainer.precision == ("bf16-mixed" if native else "32-true")


def test_distill_settings_are_defined_once_and_shared(tmp_path, train_cfg):
    train = train_cfg().distill
    distill = compose_config("distill", tmp_path, "model=tiny_llama", "data=tiny", "distill.progress=false").distill
    assert train == distill and set(train) == {"batch_size", "shard", "num_shards", "max_chunks", "progress"}
    full = compose_config("distill", tmp_path, "experiment=smollm2_medusa_full")
    assert full.distill.batch_size == 64 and full.distill.num_shards == 1  # an experiment changes one key


def test_debug_configs_set_only_keys_the_train_config_has(train_cfg):
    plain = keys(train_cfg())
    for debug in ("default", "fdr", "overfit"):
        cfg = train_cfg(f"debug={debug}")
        assert cfg.export_drafter is False
        new = {k for k in keys(cfg) - plain if not k.startswith(("callbacks", "logger", "trainer"))}
        assert not new, (debug, new)


def test_the_default_drafter_is_eagle3_and_every_checked_key_exists(tmp_path, train_cfg):
    assert train_cfg().drafter.kind == "eagle3"
    for drafter in ("eagle3", "medusa", "medusa_own_lm_head"):
        check_config(train_cfg(f"drafter={drafter}"), TRAIN_CHECKS)
    check_config(compose_config("distill", tmp_path, "model=tiny_llama", "data=tiny"), DISTILL_CHECKS)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["drafter=medusa", "drafter.heads.num_heads=0"], r"drafter.heads.num_heads: expected an integer >= 1, got 0"),
        (
            ["drafter=eagle3", "drafter.module.ttt_steps=0"],
            r"drafter.module.ttt_steps: expected an integer >= 1, got 0",
        ),
        (["~data.chunk_size"], r"config key data.chunk_size: checked, but the config has no such key"),
        (
            ["drafter=eagle3", "~drafter.draft_vocab_size"],
            r"drafter.draft_vocab_size \(checked where drafter.kind=eagle3",
        ),
    ],
)
def test_checks_refuse_bad_values_and_missing_keys(train_cfg, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_config(train_cfg(*overrides), TRAIN_CHECKS)


def test_a_checked_key_with_a_typo_is_refused_not_skipped(train_cfg):
    cfg = train_cfg("drafter=medusa")
    with pytest.raises(ConfigError, match="drafter.num_heads"):
        check_config(cfg, {"drafter.num_heads": Number(min=1)})
    check_config(cfg, {"drafter.module.ttt_steps": Number(min=1, when=("drafter.kind", "eagle3"))})  # not medusa's


def test_the_draft_vocabulary_comes_from_the_training_split_alone(tmp_path):
    groups = [f"conv{i}" for i in range(40)]
    held_out = [g for g in groups if is_validation(g, 0.25)]
    assert 0 < len(held_out) < len(groups)
    # every training conversation supervises tokens 1 and 2; each held-out one its own token, more often than those
    rows = [
        {"id": g, "group": g, "input_ids": [0, 1, 2], "loss_mask": [0, 1, 1]} for g in groups if g not in held_out
    ] + [
        {"id": g, "group": g, "input_ids": [0] + [10 + i] * 50, "loss_mask": [0] + [1] * 50}
        for i, g in enumerate(held_out)
    ]
    save_dataset(rows, tmp_path / "dataset")
    vocab = draft_vocab_from_training_split(tmp_path, 2, 64, val_fraction=0.25)
    assert vocab.token_ids.tolist() == [1, 2] and vocab.target_vocab_size == 64
    everything = draft_vocab_from_training_split(tmp_path, 2, 64, val_fraction=0.0)
    assert everything.token_ids.tolist() != [1, 2]  # with no split, the held-out tokens would win
    with pytest.raises(ValueError, match="training data directory"):
        draft_vocab_from_training_split(None, 2, 64, 0.25)
