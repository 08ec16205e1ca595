"""Training the heads on tiny random targets: targets and losses, fast dev run, overfitting, checkpoints (last.ckpt every
N steps, at each epoch's end and at the end) and resume, the NaN guard, the heads' target cache, W&B offline logging
and 2-process DDP on the CPU (gloo)."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from safetensors.torch import load_file, save_file

from medusa_like import targets
from medusa_like.data.storage import is_complete
from medusa_like.formats import load_drafter, read_drafter
from medusa_like.training.build import build_module as build_drafter_module
from medusa_like.training.losses import IGNORE, decay_weights, head_labels, head_losses, topk_correct
from medusa_like.training.schedule import cosine_with_warmup
from train.train import train

from .conftest import TINY_TRAIN, compose_config, stock_greedy

ROOT = Path(__file__).resolve().parents[1]


def compose_train(out_dir: Path, data_dir: Path, *overrides: str):
    """The tiny training config; Medusa heads unless `overrides` name another drafter (train.yaml's default is EAGLE-3)."""
    drafter = () if any(o.startswith("drafter=") for o in overrides) else ("drafter=medusa",)
    return compose_config("train", out_dir, *TINY_TRAIN, *drafter, *overrides, data_dir=data_dir)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The `tiny` data distilled once by the tiny llama (train() distils it when missing)."""
    root = tmp_path_factory.mktemp("data")
    cfg = compose_train(root / "run", root, "debug=fdr")
    train(cfg)
    assert is_complete(cfg.data.dir)
    return root


def build_module(data_dir: Path, tmp_path: Path, *overrides: str):
    cfg = compose_train(tmp_path, data_dir, *overrides)
    target, _ = instantiate(cfg.model.loader)
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    return build_drafter_module(cfg, target), datamodule


# ---- targets and losses --------------------------------------------------------------------------------------------


def test_head_k_at_position_t_learns_token_t_plus_1_plus_k():
    input_ids = torch.arange(100, 112).view(1, 12)  # token at position t is 100 + t
    loss_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]])
    labels = head_labels(input_ids, loss_mask, num_heads=3)  # [3, 1, 12]
    for k in (1, 2, 3):
        for t in range(12):
            future = t + 1 + k
            expected = 100 + future if future < 12 and loss_mask[0, future] else IGNORE
            assert labels[k - 1, 0, t] == expected, (k, t)


def test_losses_accuracies_and_weights():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)  # [K, N, V]
    labels = torch.tensor([[1, 2, 3, IGNORE, IGNORE], [IGNORE] * 5])
    loss, counts = head_losses(logits, labels)
    assert counts.tolist() == [3, 0] and loss[1] == 0
    torch.testing.assert_close(loss[0], F.cross_entropy(logits[0, :3], labels[0, :3]))
    same, _ = head_losses(logits, labels, teacher_logits=logits, kl_weight=0.25)
    torch.testing.assert_close(same, 0.75 * loss)  # KL to itself is 0
    kl_only, _ = head_losses(logits, labels, teacher_logits=logits.flip(-1), kl_weight=1.0)
    expected = F.kl_div(
        F.log_softmax(logits[0, :3], -1),
        F.log_softmax(logits.flip(-1)[0, :3], -1),
        log_target=True,
        reduction="batchmean",
    )
    torch.testing.assert_close(kl_only[0], expected)
    hits = topk_correct(logits, labels, (1, 5))
    top1 = (logits[0, :3].argmax(-1) == labels[0, :3]).sum()
    assert hits[1].tolist() == [top1.item(), 0] and hits[1][0] <= hits[5][0] <= 3
    torch.testing.assert_close(decay_weights(3, 0.8, first=1), torch.tensor([0.8, 0.64, 0.512]))
    torch.testing.assert_close(decay_weights(2, 0.5), torch.tensor([1.0, 0.5]))


# ---- training runs ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fast_dev_run_trains_validates_and_exports(tmp_path, data_dir):
    cfg = compose_train(tmp_path, data_dir, "debug=fdr", "export_drafter=true", "model=tiny_qwen2")
    metrics = train(cfg)
    for k in range(1, 5):
        assert 0 <= metrics[f"val/acc_top1_head{k}"] <= metrics[f"val/acc_top5_head{k}"] <= 1
        assert metrics[f"val/loss_head{k}"] > 0
    target, _ = instantiate(cfg.model.loader)
    heads = load_drafter(tmp_path / "drafter", target)
    assert heads.num_heads == 4 and any(p.abs().sum() > 0 for p in heads.parameters())  # trained away from zero init
    assert (tmp_path / "metrics.json").is_file()


@pytest.mark.slow
def test_eagle3_trains_validates_and_exports_through_train_on_the_cpu(tmp_path, data_dir):
    """`train.train` with `drafter=eagle3` on the CPU: per-depth validation metrics, and an exported drafter that
    loads against the target and decodes losslessly."""
    from medusa_like import Eagle3Drafter, MedusaLikeModel

    cfg = compose_train(tmp_path, data_dir, "debug=fdr", "drafter=eagle3", "export_drafter=true")
    metrics = train(cfg)
    steps = cfg.drafter.module.ttt_steps
    for depth in range(1, steps + 1):
        assert 0 <= metrics[f"val/acc_top1_depth{depth}"] <= 1 and metrics[f"val/loss_depth{depth}"] > 0
    assert f"val/loss_depth{steps + 1}" not in metrics
    target, _ = instantiate(cfg.model.loader)
    drafter = load_drafter(tmp_path / "drafter", target)
    assert isinstance(drafter, Eagle3Drafter)
    assert drafter.config.draft_vocab_size == min(cfg.drafter.draft_vocab_size, target.config.vocab_size)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = MedusaLikeModel(target, None, drafter, backend="sdpa").generate(prompt, 12, tree="dynamic", eos_token_id=[])
    untouched, _ = instantiate(cfg.model.loader)  # loaded again: the model above swapped the first one's layers
    assert out.sequences.tolist() == [prompt[0].tolist() + stock_greedy(untouched, [prompt], 12)[0]]


@pytest.mark.slow
def test_the_block_drafter_trains_validates_and_exports_through_train_on_the_cpu(tmp_path, data_dir):
    """`train.train` with `drafter=block`: per-position and chain validation metrics, the best checkpoint chosen by
    the chain's acceptance length, and an exported drafter that loads against the target and decodes losslessly."""
    from medusa_like import MedusaLikeModel
    from medusa_like.drafters.block import BlockDrafter

    cfg = compose_train(tmp_path, data_dir, "debug=fdr", "drafter=block", "drafter.module.block_size=4",
                        "export_drafter=true")  # fmt: skip
    metrics = train(cfg)
    for position in range(1, 4):
        assert 0 <= metrics[f"val/acc_top1_pos{position}"] <= metrics[f"val/acc_top4_pos{position}"] <= 1
    assert "val/acc_top1_pos4" not in metrics and 1.0 <= metrics["val/sim_tau_chain"] <= 4.0
    target, _ = instantiate(cfg.model.loader)
    drafter = load_drafter(tmp_path / "drafter", target)
    assert isinstance(drafter, BlockDrafter) and drafter.config.block_size == 4
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = MedusaLikeModel(target, None, drafter, backend="sdpa").generate(prompt, 12, tree="dynamic", eos_token_id=[])
    untouched, _ = instantiate(cfg.model.loader)  # loaded again: the model above swapped the first one's layers
    assert out.sequences.tolist() == [prompt[0].tolist() + stock_greedy(untouched, [prompt], 12)[0]]


@pytest.mark.slow
def test_the_seed_decides_the_drafter_whether_or_not_the_run_builds_its_data(tmp_path):
    """Building the tiny data samples the target's answers (temperature 0.7) from torch's generator; with the same
    seed, the run that builds the data and a later run that finds it built start from the same drafter and train it
    the same: their exported EAGLE-3 drafters are equal bit for bit."""
    data, exported = tmp_path / "data", {}
    for run in ("builds", "finds"):
        cfg = compose_train(tmp_path / run, data, "debug=fdr", "drafter=eagle3", "export_drafter=true")
        assert is_complete(cfg.data.dir) == (run == "finds")
        train(cfg)
        target, _ = instantiate(cfg.model.loader)
        exported[run] = load_drafter(tmp_path / run / "drafter", target).state_dict()
    assert exported["builds"].keys() == exported["finds"].keys() and len(exported["builds"]) > 1
    for name, tensor in exported["builds"].items():
        assert torch.equal(tensor, exported["finds"][name]), name


@pytest.mark.slow
def test_a_time_budget_stops_the_epoch_then_validates_and_exports(tmp_path, data_dir):
    """`trainer.max_time` (the default experiment's budget) ends the first epoch early: the step that passes the budget
    is the last, its learning rate has decayed to the floor as the whole epoch's last would, and the run still
    validates and exports its drafter (`min_epochs: null`, as the experiment sets)."""
    from medusa_like import Eagle3Drafter

    budget = ("drafter=eagle3", "trainer.max_epochs=1", "trainer.min_epochs=null", "data.module.batch_size=1")
    steps, last_lr = {}, {}
    for run, limit in (("full", "null"), ("cut", "{milliseconds: 1}")):
        cfg = compose_train(tmp_path / run, data_dir, *budget, "callbacks=default", f"trainer.max_time={limit}")
        metrics = train(cfg)
        checkpoint = torch.load(tmp_path / run / "checkpoints/last.ckpt", weights_only=True)
        steps[run], last_lr[run] = checkpoint["global_step"], checkpoint["lr_schedulers"][0]["_last_lr"][0]
        assert 0 <= metrics["val/acc_top1_depth1"] <= 1
    assert steps["full"] > 1 and steps["cut"] == 1
    floor = cfg.module.optimizer.lr * cfg.module.scheduler.min_lr_ratio
    assert last_lr["cut"] == pytest.approx(floor) and last_lr["full"] == pytest.approx(floor)
    target, _ = instantiate(compose_train(tmp_path, data_dir).model.loader)
    assert isinstance(load_drafter(tmp_path / "cut/drafter", target), Eagle3Drafter)


def test_the_schedule_decays_with_the_steps_or_the_time_budget_whichever_is_further():
    """Without a budget the rate follows the steps (warmup, cosine, floor); under one, the share of it spent brings
    the floor forward, and a budget barely begun leaves the step schedule as it is."""
    lr, total, floor = 1.0, 100, 0.1
    spent = [0.0]

    def rates(time_spent=None) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        scheduler = cosine_with_warmup(optimizer, total, warmup_ratio=0.05, min_lr_ratio=floor, time_spent=time_spent)
        out = []
        for _ in range(total):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    by_steps = rates()
    assert by_steps[0] < by_steps[4] < by_steps[5] == pytest.approx(lr)  # 5 warmup steps, then the peak
    assert all(a >= b for a, b in zip(by_steps[5:-1], by_steps[6:], strict=True)) and by_steps[-1] > floor
    assert rates(lambda: spent[0]) == pytest.approx(by_steps)  # no time spent: the steps decide
    spent[0] = 0.5  # half the budget gone: the warmup over, at least half-way down the cosine
    half = rates(lambda: spent[0])
    assert half[:6] == pytest.approx([floor + (lr - floor) / 2] * 6) and half[-1] == pytest.approx(by_steps[-1])
    spent[0] = 1.0  # the budget is out: the floor
    assert rates(lambda: spent[0])[5:] == pytest.approx([floor] * (total - 5))


def test_a_budget_that_ends_long_before_the_steps_warms_up_and_decays_by_its_time():
    """`trainer.max_epochs` set high for a time budget to stop the run (many epochs on a GPU): the steps counted are 20
    times those the budget reaches. The warmup ends at its share of the budget, the peak holds, and the floor comes
    when the budget runs out, instead of the whole run climbing a warmup sized for the steps never reached."""
    total, reached, floor = 2000, 100, 0.1
    done = [0]  # optimizer steps taken; the budget's share spent is done / reached
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = cosine_with_warmup(
        optimizer, total, warmup_ratio=0.05, min_lr_ratio=floor, decay_ratio=0.25, time_spent=lambda: done[0] / reached
    )
    rates = []
    for _ in range(reached):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        done[0] += 1
        scheduler.step()
    assert all(a < b for a, b in zip(rates[:5], rates[1:6], strict=True)) and rates[4] == pytest.approx(0.8)
    assert rates[5:75] == pytest.approx([1.0] * 70)  # the peak from 5% of the budget to 75%
    assert rates[-1] == pytest.approx(floor, abs=0.01)  # the budget's last step: the floor


def test_warmup_stable_decay_keeps_the_peak_until_its_last_share():
    """decay_ratio=0.2: the peak after the warmup until 80% of the steps after it (or of the budget), then the same
    cosine compressed into the rest, to the floor; a bad ratio is refused."""
    total, floor = 105, 0.1
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = cosine_with_warmup(optimizer, total, warmup_ratio=0.05, min_lr_ratio=floor, decay_ratio=0.2)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:5] == pytest.approx([(s + 1) / 6 for s in range(5)])  # 5 warmup steps
    assert rates[5:85] == pytest.approx([1.0] * 80)  # stable: the first 80 of the 100 steps after the warmup
    assert rates[95] == pytest.approx(floor + (1 - floor) / 2)  # half-way through the decay
    assert all(a > b for a, b in zip(rates[85:-1], rates[86:], strict=True)) and rates[-1] > floor
    spent = cosine_with_warmup(optimizer, total, min_lr_ratio=floor, decay_ratio=0.2, time_spent=lambda: 0.9)
    assert spent.lr_lambdas[0](10) == pytest.approx(floor + (1 - floor) / 2)  # the budget's share leads here
    with pytest.raises(ValueError, match="decay_ratio"):
        cosine_with_warmup(optimizer, total, decay_ratio=0.0)


@pytest.mark.slow
def test_the_loss_falls_on_an_overfit_batch(tmp_path, data_dir):
    cfg = compose_train(tmp_path, data_dir, "debug=overfit", "trainer.max_epochs=30", "module.optimizer.lr=0.05")
    train(cfg)
    rows = list(csv.DictReader(open(next(tmp_path.glob("csv/version_*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 30
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_checkpoints_hold_heads_and_optimizer_only_and_resume_exactly(tmp_path, data_dir):
    common = ["module.scheduler=null", "data.module.batch_size=64", "data.module.shuffle=false", "callbacks=default"]
    train(compose_train(tmp_path / "a", data_dir, *common, "trainer.max_steps=2"))
    train(compose_train(tmp_path / "b", data_dir, *common, "trainer.max_steps=1"))
    ckpt_path = tmp_path / "b" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert ckpt["state_dict"] and all(k.startswith("heads.") for k in ckpt["state_dict"])
    assert ckpt["optimizer_states"][0]["state"], "optimizer moments must be saved"
    target, _ = instantiate(compose_train(tmp_path, data_dir).model.loader)
    assert ckpt["medusa_like"]["target_fingerprint"] == targets.target_fingerprint(target.config)
    assert ckpt["medusa_like"]["heads_config"]["num_heads"] == 4 and ckpt["medusa_like"]["target"] == "tiny_llama"
    heads, meta = read_drafter(ckpt_path, target)
    assert meta["global_step"] == 1 and heads.num_heads == 4
    train(compose_train(tmp_path / "c", data_dir, *common, "trainer.max_steps=2", f"ckpt_path={ckpt_path}"))
    # the last weights (the exported drafter is the best checkpoint by the monitored metric, which may be earlier)
    straight, resumed, after_one = (
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for run in "acb"
    )
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0)
    assert any(not torch.equal(after_one[n], straight[n]) for n in straight)


class LastCheckpointProbe(Callback):
    """Records, at each epoch start and at the end of fitting, the step of checkpoints/last.ckpt and the step the
    previous epoch ended at."""

    def __init__(self, path: Path):
        self.path, self.seen, self.epoch_end_steps = path, [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_end_steps.append(trainer.global_step)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.seen.append(torch.load(self.path, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.parametrize(("every", "max_steps"), [(2, -1), (2, 7), (None, -1)])
def test_last_checkpoint_is_written_every_n_steps_at_every_epoch_end_and_at_the_end(
    tmp_path, train_cfg, every, max_steps
):
    overrides = [] if every is None else [f"callbacks.last_checkpoint.every_n_train_steps={every}"]
    cfg = train_cfg(*overrides)
    checkpoint = instantiate(cfg.callbacks.last_checkpoint)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    probe = LastCheckpointProbe(last)
    saved_steps = []

    class StepRecorder(Callback):  # which steps last.ckpt held after each batch
        def on_train_batch_end(self, trainer, *args):
            if last.exists():
                saved_steps.append(torch.load(last, map_location="cpu", weights_only=False)["global_step"])

    trainer = L.Trainer(
        max_epochs=3,
        max_steps=max_steps,
        limit_train_batches=5,  # 5 steps per epoch: an epoch never ends on a multiple of 2
        limit_val_batches=1,
        callbacks=[checkpoint, probe, StepRecorder()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    final = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert final == trainer.global_step == (15 if max_steps == -1 else max_steps)
    assert probe.seen == probe.epoch_end_steps[: len(probe.seen)] and probe.seen  # each epoch's end was saved
    if every:
        assert {2, 4} <= set(saved_steps)  # and every N steps within the epoch
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_non_finite_loss_and_empty_batches_stop_training(tmp_path, data_dir):
    module, datamodule = build_module(data_dir, tmp_path)
    with torch.no_grad():
        module.heads.blocks[0][0].linear.weight.fill_(float("nan"))
    trainer = L.Trainer(fast_dev_run=True, logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        trainer.fit(module, datamodule=datamodule)
    batch = next(iter(datamodule.train_dataloader()))
    batch["loss_mask"].zero_()
    with pytest.raises(ValueError, match="no supervised assistant token"):
        module._forward(batch)


@pytest.mark.slow
def test_heads_read_from_the_target_cache_give_the_targets_own_loss(tmp_path, data_dir):
    """Medusa heads' target cache holds the target's last hidden state in its dtype: the states and the loss from the
    cache, KL term included, are those computed through the target (up to fp32 rounding), with no target forward."""
    overrides = ("drafter.module.kl_weight=0.5",)
    module, datamodule = build_module(data_dir, tmp_path, *overrides, f"drafter.module.target_cache_dir={tmp_path}/c")
    plain, _ = build_module(data_dir, tmp_path, *overrides)
    module.heads.load_state_dict(plain.heads.state_dict())
    module.prepare_target_cache(datamodule)
    assert len(module.target_cache.rows) == len(datamodule.train_set) + len(datamodule.val_set)
    module.target.base_model.forward = None  # a target forward would now fail: the cache must serve every row
    for batch in (next(iter(datamodule.train_dataloader())), next(iter(datamodule.val_dataloader()))):
        real = batch["attention_mask"].bool()  # [B, T]
        cached = module.read_target(batch, compute=None)["hidden"]  # [B, T, H], from the cache alone
        # the target's own states in its dtype, up to fp32 rounding: the cache read the rows in other batches
        torch.testing.assert_close(cached[real], plain.target_hidden(batch)[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(module._forward(batch)[0], plain._forward(batch)[0])


@pytest.mark.slow
def test_soft_labels_change_the_loss(tmp_path, data_dir):
    hard, datamodule = build_module(data_dir, tmp_path)
    soft, _ = build_module(data_dir, tmp_path, "drafter.module.kl_weight=0.5")
    batch = next(iter(datamodule.train_dataloader()))
    loss_hard, loss_soft = hard._forward(batch)[0], soft._forward(batch)[0]
    assert torch.isfinite(loss_soft) and not torch.isclose(loss_hard, loss_soft)


@pytest.mark.slow
def test_wandb_offline_run_holds_the_per_head_metrics(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_train(tmp_path, data_dir, "logger=wandb", "trainer.max_epochs=1", "export_drafter=false")
    train(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    blob = runs[0].read_bytes()
    for k in range(1, 5):
        assert f"val/acc_top1_head{k}".encode() in blob and f"val/acc_top5_head{k}".encode() in blob


@pytest.mark.slow
def test_a_run_that_raises_leaves_no_wandb_run_open(tmp_path, data_dir, monkeypatch):
    """train() closes its W&B run however it ends: an open one would take the next run's logs in this process."""
    import wandb

    from medusa_like.apps import train as train_app

    def fail(*args):
        assert wandb.run is not None  # the run was open when training ended
        raise RuntimeError("stopped after fitting")

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(train_app, "check_trained", fail)
    cfg = compose_train(tmp_path, data_dir, "logger=wandb", "trainer.max_epochs=1", "export_drafter=false")
    with pytest.raises(RuntimeError, match="stopped after fitting"):
        train(cfg)
    assert wandb.run is None


class SaveHeadsPerRank(Callback):
    """Each rank writes its own copy of the heads at the end of fit (for the DDP test)."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def on_fit_end(self, trainer, pl_module):
        state = {k: v.detach().contiguous() for k, v in pl_module.heads.state_dict().items()}
        save_file(state, str(self.out_dir / f"rank{trainer.global_rank}.safetensors"))


@pytest.mark.slow
def test_two_process_ddp_on_cpu_ends_with_identical_heads(tmp_path, data_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEDUSA_LIKE_ROOT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "train.train", "model=tiny_llama", "data=tiny", "logger=none", "drafter=medusa", "trainer=ddp",
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true", "trainer.max_steps=3",
        "+trainer.enable_progress_bar=false", "~callbacks.progress_bar", "data.module.batch_size=2", f"paths.data_dir={data_dir}",
        "+callbacks.per_rank._target_=tests.test_training.SaveHeadsPerRank", f"+callbacks.per_rank.out_dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = load_file(tmp_path / "rank0.safetensors"), load_file(tmp_path / "rank1.safetensors")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0)
    assert any(t.abs().sum() > 0 for t in rank0.values())  # they trained, away from the zero init
    assert len(list(tmp_path.glob("runs/train/*/drafter/model.safetensors"))) == 1  # rank 0 alone exported


class KillAtStep(Callback):
    """SIGKILLs its own process after optimizer step `step`: a real interruption, nothing is cleaned up."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def run_train(tmp_path: Path, data_dir: Path, run: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "train.train", *TINY_TRAIN, "drafter=medusa", "~callbacks.progress_bar",
        "+trainer.enable_progress_bar=false",
        f"paths.data_dir={data_dir}", f"hydra.run.dir={tmp_path / run}", "trainer.max_steps=6", "trainer.max_epochs=10",
        "callbacks.last_checkpoint.every_n_train_steps=1", *overrides,
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "echo",
    [(), ("data.module.echo=2", "data.module.echo_window=2", "drafter.module.target_cache_dir=${paths.output_dir}/c")],
    ids=["each-row-once", "echoed"],
)  # echoed: 4 batches a window (2 read, 2 repeats), killed inside the first window's repeats. The repeats' hidden
# states come from the target cache, which outlives the kill: the in-memory memo does not, and a resumed run
# recomputes a window's repeats in other batches, equal only up to rounding
def test_a_killed_run_resumes_from_last_to_the_same_weights(tmp_path, data_dir, echo):
    whole = run_train(tmp_path, data_dir, "whole", *echo)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run_train(
        tmp_path,
        data_dir,
        "killed",
        "+callbacks.kill._target_=tests.test_training.KillAtStep",
        "+callbacks.kill.step=4",
        *echo,
    )
    assert killed.returncode == -signal.SIGKILL
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 3  # written after step 3; step 4 died first
    assert not state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"]  # mid-epoch
    resumed = run_train(tmp_path, data_dir, "killed", "ckpt_path=last", *echo)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(last, weights_only=False)["global_step"] == 6
    a = load_file(tmp_path / "whole" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
