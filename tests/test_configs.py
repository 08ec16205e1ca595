"""Every config composes, in every entry point where it belongs, and everything it describes instantiates."""

from functools import cache
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from medusa_like.apps.config_checks import computes_in_bf16
from medusa_like.data import split
from medusa_like.data.datamodule import TrainingDataModule
from medusa_like.data.generation import GenerationConfig
from medusa_like.data.prepare import load_model
from medusa_like.drafters.medusa import HeadsConfig
from medusa_like.runs import resolved
from medusa_like.training.build import build_module, module_class

from .conftest import CONF, compose_config

TRAIN_GROUPS = ("model", "drafter", "data", "trainer", "callbacks", "logger", "experiment", "debug")
OPTIONS = [(group, p.stem) for group in TRAIN_GROUPS for p in sorted((CONF / group).glob("*.yaml")) if p.stem != "base"]


@cache
def loaded(loader_yaml: str):
    """(target, tokenizer) of a tiny model loader, built once for all options."""
    return instantiate(OmegaConf.create(loader_yaml))


def test_every_group_option_is_covered():
    assert len(OPTIONS) >= 28
    for group in TRAIN_GROUPS + ("paths", "hydra"):
        assert list((CONF / group).glob("*.yaml")), group
    expected = {"smollm2_135m", "tiny_llama", "tiny_qwen2", "vicuna_7b", "llama3_8b_instruct", "qwen2_5_7b_instruct"}
    assert expected <= {option for group, option in OPTIONS if group == "model"}
    assert {"medusa", "eagle3"} <= {option for group, option in OPTIONS if group == "drafter"}
    assert {"cpu", "gpu", "ddp", "fsdp"} <= {option for group, option in OPTIONS if group == "trainer"}
    assert {"wandb", "csv", "none"} <= {option for group, option in OPTIONS if group == "logger"}
    assert {"fdr", "overfit"} <= {option for group, option in OPTIONS if group == "debug"}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_train_option_composes_and_instantiates(group, option, tmp_path, monkeypatch):
    overrides = [f"{group}={option}"]
    if group not in ("model", "experiment"):
        overrides.append("model=tiny_llama")
    cfg = compose_config("train", tmp_path, *overrides)
    resolved(cfg)

    if cfg.drafter.kind == "medusa":
        heads = instantiate(cfg.drafter.heads, hidden_size=64, vocab_size=1000)
        assert isinstance(heads, HeadsConfig) and (heads.hidden_size, heads.vocab_size) == (64, 1000)
        assert heads.num_heads == 4  # conf/drafter/medusa.yaml; no option changes it
    gen = GenerationConfig(**cfg.data.generation)
    assert gen.max_new_tokens >= 1
    if OmegaConf.is_missing(cfg.data, "source"):
        assert option == "local"
    else:
        assert isinstance(instantiate(cfg.data.module), TrainingDataModule)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    assert all(isinstance(c, L.Callback) for c in callbacks)
    assert all(isinstance(lg, L.pytorch.loggers.Logger) for lg in loggers)
    trainer_cfg = cfg.trainer
    if trainer_cfg.accelerator in ("gpu", "auto") and not torch.cuda.is_available():
        with open_dict(trainer_cfg):
            trainer_cfg.accelerator, trainer_cfg.devices = "cpu", 1
            if OmegaConf.is_dict(trainer_cfg.get("strategy")):  # FSDP needs CUDA: build the strategy alone
                assert instantiate(trainer_cfg.strategy) is not None
                trainer_cfg.strategy = "auto"
    trainer = instantiate(trainer_cfg, callbacks=callbacks, logger=loggers or False)
    assert isinstance(trainer, L.Trainer)

    loader = cfg.model.loader
    if cfg.model.name.startswith("tiny_"):
        target, tokenizer = loaded(OmegaConf.to_yaml(loader, resolve=True))
        assert tokenizer.chat_template and target.config.vocab_size == len(tokenizer)
        vocab_size = target.config.vocab_size
        # the draft vocabulary is counted on the built training split; no data is built here: every token counts once
        monkeypatch.setattr(split, "split_token_counts", lambda *args, **kwargs: (torch.ones(vocab_size), None))
        module = build_module(cfg, target)
        assert type(module) is module_class(cfg) and module.kind == cfg.drafter.kind
        if cfg.drafter.get("heads") is not None:  # Medusa heads' settings
            assert module.drafter.num_heads == cfg.drafter.heads.num_heads
        if cfg.drafter.get("draft_vocab_size") is not None:  # a reduced draft vocabulary's
            assert module.drafter.vocab.size == min(cfg.drafter.draft_vocab_size, vocab_size)
    else:  # hub models are not downloaded in tests: the loader must exist and name a model
        assert callable(get_method(loader._target_)) and cfg.model.name_or_path


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_experiments_compose_for_distillation_and_training_alike(experiment, tmp_path):
    train_cfg = compose_config("train", tmp_path, f"experiment={experiment}")
    distill_cfg = compose_config("distill", tmp_path, f"experiment={experiment}")
    assert train_cfg.task_name == distill_cfg.task_name == experiment
    assert train_cfg.data.dir == distill_cfg.data.dir  # training reads what distillation writes
    assert resolved(train_cfg)["data"] == resolved(distill_cfg)["data"]
    assert train_cfg.model.name == distill_cfg.model.name == "smollm2_135m"


@pytest.mark.parametrize("data", sorted(p.stem for p in (CONF / "data").glob("*.yaml") if p.stem != "base"))
def test_distill_config_composes_with_every_data_option(data, tmp_path):
    cfg = compose_config("distill", tmp_path, f"data={data}", "distill.shard=1", "distill.num_shards=3")
    assert (cfg.distill.shard, cfg.distill.num_shards) == (1, 3)
    if not OmegaConf.is_missing(cfg.data, "source"):
        resolved_data = resolved(cfg)["data"]  # data/<recipe>/<model>/<name>
        name = resolved_data["name"]
        assert name == data or (data == "local" and name.startswith("local-"))
        assert resolved_data["recipe"] in ("distilled", "original")
        assert Path(resolved_data["dir"]) == tmp_path / "data" / resolved_data["recipe"] / "smollm2_135m" / name


@pytest.mark.parametrize("name", ["train", "eval", "export", "distill"])
def test_every_entry_point_composes_paths_hydra_and_model(name, tmp_path):
    extra = {"export": ["drafter.path=x", "out=y"]}.get(name, [])
    cfg = compose_config(name, tmp_path, "model=tiny_qwen2", *extra)
    assert cfg.model.name == "tiny_qwen2"
    assert cfg.paths.output_dir == str(tmp_path)
    assert "run" in cfg.hydra and cfg.task_name
    resolved(cfg)


def test_eval_reads_the_training_split_settings(tmp_path):
    cfg = compose_config("eval", tmp_path, "data@validation=sharegpt_small")
    train = compose_config("train", tmp_path, "data=sharegpt_small")
    assert (cfg.validation.val_fraction, cfg.validation.split_seed) == (train.data.val_fraction, train.data.split_seed)
    assert cfg.validation.source == train.data.source


def test_overrides_reach_the_objects(tmp_path):
    cfg = compose_config(
        "train",
        tmp_path,
        "drafter=medusa",
        "module.optimizer.lr=3e-4",
        "drafter.heads.num_heads=5",
        "logger.wandb.offline=false",
    )
    assert cfg.module.optimizer._partial_ and cfg.module.optimizer.lr == 3e-4 and cfg.drafter.heads.num_heads == 5
    assert cfg.model.name == "smollm2_135m" and cfg.logger.wandb.offline is False
    optimizer = instantiate(cfg.module.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 3e-4


# ---------------------------------------------------------------------------------------------------------------------
# One name per setting: the target's dtype is `model.dtype`, `distill:` is defined once, debug configs add no keys

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


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_the_target_dtype_has_one_name_model_dtype(tmp_path, model):
    for name in ("train", "distill"):
        cfg = compose_config(name, tmp_path, f"model={model}", "model.dtype=bfloat16")
        assert OmegaConf.to_container(cfg.model.loader, resolve=True)["dtype"] == "bfloat16"
        assert not [k for k in keys(cfg) if k.rsplit(".", 1)[-1] == "target_dtype"]


@pytest.mark.slow
def test_model_dtype_reaches_the_loaded_target(tmp_path, train_cfg):
    target, _ = load_model(train_cfg("model.dtype=bfloat16").model)
    assert target.dtype == torch.bfloat16
    target, _ = load_model(train_cfg().model)
    assert target.dtype == torch.float32
    eagle3 = compose_config("train", tmp_path, "experiment=smollm2_eagle3")
    # the default experiment trains in bf16 only where the machine computes in it natively (elsewhere bf16 is emulated and fp32 is faster)
    native = computes_in_bf16()
    assert eagle3.model.dtype == ("bfloat16" if native else "float32") and eagle3.drafter.kind == "eagle3"
    assert eagle3.trainer.precision == ("bf16-mixed" if native else "32-true")
    # and trains longer there, where steps are cheaper (`${if_bf16:...}`), labelled at every token
    assert eagle3.trainer.max_time == ("00:00:10:00" if native else "00:00:06:00")
    assert eagle3.drafter.module.train_on == "all" and eagle3.data.num_conversations == 2000
    # each row read once and served twice, and the rate decaying over the budget's last quarter
    assert eagle3.data.module.echo == 2 and eagle3.module.scheduler.decay_ratio == 0.25
    assert eagle3.drafter.module.vocab_check is False  # training's labels from the draft vocabulary's logits alone
    long = compose_config("train", tmp_path, "experiment=smollm2_eagle3_long")
    # the default recipe for 90 minutes, on conversations of its own (every step reads new ones), 3 unrolled steps
    assert long.data.module.echo == 2 and long.module.scheduler.decay_ratio == 0.25 and long.trainer.max_epochs == 1
    assert long.trainer.max_time == "00:01:30:00" and long.drafter.module.ttt_steps == 3
    assert long.data.num_conversations == 10000 and long.data.dir != eagle3.data.dir
    assert long.trainer.limit_val_batches == eagle3.trainer.limit_val_batches  # make run's held-out rows
    assert long.drafter.module.target_cache_dir is None and long.drafter.module.vocab_check is False
    for measured in ("long_cached", "ablation", "curve"):  # keep the recipe they were measured with
        cfg = compose_config("train", tmp_path, f"experiment=smollm2_eagle3_{measured}")
        assert cfg.drafter.module.train_on == "assistant" and cfg.data.num_conversations == 800
        assert cfg.data.dir != eagle3.data.dir and cfg.trainer.limit_val_batches is None
        assert cfg.data.module.echo == 1 and cfg.module.scheduler.decay_ratio == 1.0


@pytest.mark.slow
def test_distill_settings_are_defined_once_and_shared(tmp_path, train_cfg):
    train = train_cfg().distill
    distill = compose_config("distill", tmp_path, "model=tiny_llama", "data=tiny", "distill.progress=false").distill
    assert train == distill
    assert set(train) == {"batch_size", "engine", "vllm_args", "shard", "num_shards", "max_chunks", "progress"}
    full = compose_config("distill", tmp_path, "experiment=smollm2_medusa_full")
    assert full.distill.batch_size == 64 and full.distill.num_shards == 1  # an experiment changes one key


@pytest.mark.slow
def test_debug_configs_set_only_keys_the_train_config_has(train_cfg):
    plain = keys(train_cfg())
    for debug in ("default", "fdr", "overfit"):
        cfg = train_cfg(f"debug={debug}")
        assert cfg.export_drafter is False
        new = {k for k in keys(cfg) - plain if not k.startswith(("callbacks", "logger", "trainer"))}
        assert not new, (debug, new)
