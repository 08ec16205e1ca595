"""Every config composes, in both entry points where it belongs, and everything it describes instantiates."""

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf, open_dict

from medusa_like.data.datamodule import DistilledDataModule
from medusa_like.distill import GenerationConfig
from medusa_like.heads import HeadsConfig
from medusa_like.training.module import MedusaHeadsModule

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAIN_GROUPS = ("model", "heads", "data", "trainer", "callbacks", "logger", "experiment", "debug")
OPTIONS = [(group, p.stem) for group in TRAIN_GROUPS for p in sorted((CONF / group).glob("*.yaml"))]


def compose_cfg(name: str, tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(name, return_hydra_config=True, overrides=list(overrides))
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        cfg.paths.data_dir = str(tmp_path / "data")
    return cfg


def test_every_group_option_is_covered():
    assert len(OPTIONS) >= 25
    for group in TRAIN_GROUPS + ("paths", "hydra"):
        assert list((CONF / group).glob("*.yaml")), group
    expected = {"smollm2_135m", "tiny_llama", "tiny_qwen2", "vicuna_7b", "llama3_8b_instruct", "qwen2_5_7b_instruct"}
    assert expected <= {option for group, option in OPTIONS if group == "model"}
    assert {"cpu", "gpu", "ddp", "fsdp"} <= {option for group, option in OPTIONS if group == "trainer"}
    assert {"wandb", "csv", "none"} <= {option for group, option in OPTIONS if group == "logger"}
    assert {"fdr", "overfit"} <= {option for group, option in OPTIONS if group == "debug"}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_train_option_composes_and_instantiates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if group not in ("model", "experiment"):
        overrides.append("model=tiny_llama")
    cfg = compose_cfg("train", tmp_path, *overrides)
    OmegaConf.resolve(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))

    heads = instantiate(cfg.heads, hidden_size=64, vocab_size=1000)
    assert isinstance(heads, HeadsConfig)
    gen = GenerationConfig(**cfg.data.generation)
    assert gen.max_new_tokens >= 1
    if OmegaConf.is_missing(cfg.data, "source"):
        assert option == "local"
    else:
        assert isinstance(instantiate(cfg.data.module), DistilledDataModule)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    assert all(isinstance(c, L.Callback) for c in callbacks)
    assert all(isinstance(lg, L.pytorch.loggers.Logger) for lg in loggers)
    trainer_cfg = cfg.trainer
    if trainer_cfg.accelerator == "gpu" and not torch.cuda.is_available():
        with open_dict(trainer_cfg):
            trainer_cfg.accelerator, trainer_cfg.devices = "cpu", 1
            if OmegaConf.is_dict(trainer_cfg.get("strategy")):  # FSDP needs CUDA: build the strategy alone
                assert instantiate(trainer_cfg.strategy) is not None
                trainer_cfg.strategy = "auto"
    trainer = instantiate(trainer_cfg, callbacks=callbacks, logger=loggers or False)
    assert isinstance(trainer, L.Trainer)

    loader = cfg.model.loader
    if cfg.model.name.startswith("tiny_"):
        target, tokenizer = instantiate(loader)
        assert tokenizer.chat_template and target.config.vocab_size == len(tokenizer)
        lm_head = target.get_output_embeddings().weight
        heads = instantiate(cfg.heads, vocab_size=lm_head.shape[0], hidden_size=lm_head.shape[1])
        module = instantiate(
            cfg.module, target=target, heads_config=heads, target_name=cfg.model.name_or_path, _convert_="object"
        )
        assert isinstance(module, MedusaHeadsModule) and module.heads.num_heads == heads.num_heads
    else:  # hub models are not downloaded in tests: the loader must exist and name a model
        assert callable(get_method(loader._target_)) and cfg.model.name_or_path


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_experiments_compose_for_distillation_and_training_alike(experiment, tmp_path):
    train_cfg = compose_cfg("train", tmp_path, f"experiment={experiment}")
    distill_cfg = compose_cfg("distill", tmp_path, f"experiment={experiment}")
    assert train_cfg.task_name == distill_cfg.task_name == experiment
    assert train_cfg.data.dir == distill_cfg.data.dir  # training reads what distillation writes
    assert OmegaConf.to_container(train_cfg.data.generation) == OmegaConf.to_container(distill_cfg.data.generation)
    assert train_cfg.model.name == distill_cfg.model.name == "smollm2_135m"


@pytest.mark.parametrize("data", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_distill_config_composes_with_every_data_option(data, tmp_path):
    cfg = compose_cfg("distill", tmp_path, f"data={data}", "distill.shard=1", "distill.num_shards=3")
    assert (cfg.distill.shard, cfg.distill.num_shards) == (1, 3)
    assert cfg.data.dir.endswith(f"distilled/{cfg.model.name}/{cfg.data.name}")
    GenerationConfig(**cfg.data.generation)


def test_defaults_and_command_line_overrides(tmp_path):
    cfg = compose_cfg("train", tmp_path, "module.optimizer.lr=3e-4", "heads.num_heads=5", "logger.wandb.offline=false")
    assert cfg.model.name == "smollm2_135m" and cfg.data.name == "sharegpt_small" and cfg.logger.wandb.offline is False
    assert cfg.module.optimizer._partial_ and cfg.module.optimizer.lr == 3e-4 and cfg.heads.num_heads == 5
    optimizer = instantiate(cfg.module.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 3e-4
