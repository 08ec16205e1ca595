"""Resuming a training run means what it says: `ckpt_path=last` is this run directory's own checkpoint; a changed
learning rate or run length is applied from the checkpoint's step and recorded; a changed objective, draft vocabulary,
data or target is refused in one line naming each difference; a checkpoint already at the run's limits trains nothing
and writes no drafter; a damaged target cache stops the run in one line naming its shard."""

import json

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from medusa_like.training.resume import RECORD, NothingToTrainError, TrainingResumeError
from medusa_like.training.target_cache import TargetCacheCorruptError
from train.train import train

from .test_training import compose_train, data_dir  # noqa: F401  (data_dir: the module's fixture)

QUICK = ("trainer.max_epochs=20", "+trainer.limit_val_batches=1", "export_drafter=false")


class StopAtStep(Callback):
    """Ends training gracefully after optimizer step `step` (last.ckpt is written at the end, at that step)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def stop_at(step: int) -> tuple[str, ...]:
    return (f"+callbacks.stop._target_={__name__}.StopAtStep", f"+callbacks.stop.step={step}")


def last_state(run) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.slow
def test_last_resumes_this_run_directory_only_and_another_kind_is_refused(tmp_path, data_dir):  # noqa: F811
    first, sibling = tmp_path / "runs" / "first", tmp_path / "runs" / "second"
    train(compose_train(first, data_dir, *QUICK, "trainer.max_steps=2"))
    assert last_state(first)["global_step"] == 2
    with pytest.raises(FileNotFoundError) as refusal:  # a new run directory next to it: not a resume of it
        train(compose_train(sibling, data_dir, *QUICK, "trainer.max_steps=4", "ckpt_path=last"))
    message = one_line(refusal)
    assert f"resumes this run's own directory only, and {sibling} holds no checkpoints/last.ckpt" in message
    assert str(first / "checkpoints" / "last.ckpt") in message and "hydra.run.dir" in message
    assert not (sibling / "checkpoints").exists()  # nothing trained there
    with pytest.raises(TrainingResumeError) as refusal:  # another drafter kind: refused before anything is loaded
        train(compose_train(sibling, data_dir, "drafter=eagle3", *QUICK, f"ckpt_path={first}/checkpoints/last.ckpt"))
    assert "drafter.kind: 'medusa' in the checkpoint, 'eagle3' now" in one_line(refusal)
    train(compose_train(first, data_dir, *QUICK, "trainer.max_steps=4", "ckpt_path=last"))  # its own: resumed
    assert last_state(first)["global_step"] == 4
    assert json.loads((first / RECORD).read_text())[0]["applied"] == {"trainer.max_steps": {"checkpoint": 2, "run": 4}}


@pytest.mark.slow
def test_a_changed_learning_rate_is_the_new_peak_from_the_checkpoints_step(tmp_path, data_dir):  # noqa: F811
    """A run stopped at step 3 of 6, resumed with module.optimizer.lr=0.05 instead of 1e-3: its schedule goes on
    with 0.05 as its peak (at step 6, the end of the cosine: 0.05 x min_lr_ratio), the run's config.yaml and the
    checkpoint say 0.05, and resumes.json records the change with its step."""
    run = tmp_path / "run"
    common = (*QUICK, "trainer.max_steps=6", "module.scheduler.warmup_ratio=0.0")
    train(compose_train(run, data_dir, *common, *stop_at(3)))
    stopped = last_state(run)
    assert stopped["global_step"] == 3 and stopped["lr_schedulers"][0]["base_lrs"] == [1e-3]
    cfg = compose_train(run, data_dir, *common, "module.optimizer.lr=0.05", "ckpt_path=last")
    train(cfg)
    state = last_state(run)
    assert state["global_step"] == 6
    floor = cfg.module.scheduler.min_lr_ratio
    assert state["lr_schedulers"][0]["base_lrs"] == [0.05]
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.05 * floor, rel=1e-9)
    assert state["medusa_like_resume"]["module.optimizer.lr"] == 0.05
    assert OmegaConf.load(run / "config.yaml").module.optimizer.lr == 0.05
    (record,) = json.loads((run / RECORD).read_text())
    assert record["step"] == 3 and record["applied"] == {"module.optimizer.lr": {"checkpoint": 0.001, "run": 0.05}}


@pytest.mark.slow
def test_a_changed_objective_vocabulary_data_or_target_is_refused_naming_each_difference(tmp_path, data_dir):  # noqa: F811
    run = tmp_path / "run"
    base = ("drafter=eagle3", *QUICK, "trainer.max_steps=1")
    train(compose_train(run, data_dir, *base))
    config = (run / "config.yaml").read_text()
    cases = {
        ("drafter.module.ttt_steps=2", "drafter.module.loss=tv"): [
            "drafter.module.ttt_steps: 4 in the checkpoint, 2 now",
            "drafter.module.loss: '0.1*soft_ce+0.9*tv' in the checkpoint, 'tv' now",
        ],
        ("drafter.draft_vocab_size=1000",): ["drafter.draft_vocab_size: 8192 in the checkpoint, 1000 now"],
        ("data.module.batch_size=2",): ["data.module.batch_size: 4 in the checkpoint, 2 now"],
        ("model.loader.seed=1",): ["target weights: '"],  # other weights under the same model config and name
        ("model.dtype=bfloat16",): ["target weights: '", "target dtype: 'torch.float32' in the checkpoint"],
    }
    for overrides, differences in cases.items():
        with pytest.raises(TrainingResumeError) as refusal:
            train(compose_train(run, data_dir, *base, "trainer.max_steps=2", "ckpt_path=last", *overrides))
        message = one_line(refusal)
        assert message.startswith(f"ckpt_path={run}/checkpoints/last.ckpt was trained with other settings")
        for difference in differences:
            assert difference in message, message
        assert (run / "config.yaml").read_text() == config  # the refused settings are not recorded as the run's
    # a draft vocabulary of the same size counted on other data: the vocabulary itself differs
    state = last_state(run)
    state["medusa_like_resume"]["draft vocabulary"] = "8192:0123456789abcdef"
    torch.save(state, run / "checkpoints" / "other_vocab.ckpt")
    with pytest.raises(TrainingResumeError, match="draft vocabulary: '8192:0123456789abcdef' in the checkpoint"):
        train(compose_train(run, data_dir, *base, f"ckpt_path={run}/checkpoints/other_vocab.ckpt"))
    assert last_state(run)["global_step"] == 1


@pytest.mark.slow
def test_a_resume_at_its_limits_is_refused_and_changes_nothing(tmp_path, data_dir):  # noqa: F811
    """A resume whose checkpoint reached the run's epochs, steps or time budget is refused in one line before it
    writes anything (it rewrote last.ckpt, config.yaml and resumes.json, then refused); raised limits train on."""
    run = tmp_path / "run"
    # a time budget it does not reach: Lightning's timer runs and saves what it counted in the checkpoint
    finished = (
        "trainer.max_epochs=1",
        "+trainer.limit_val_batches=1",
        "export_drafter=true",
        "trainer.max_time={seconds:3600}",
    )
    train(compose_train(run, data_dir, *finished))
    steps, spent = last_state(run)["global_step"], last_state(run)["callbacks"]["Timer"]["time_elapsed"]["train"]
    (run / "drafter" / "model.safetensors").unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts}
    for limit, said in (
        ("trainer.max_epochs=1", "trainer.max_epochs=1"),
        (f"trainer.max_steps={steps}", f"trainer.max_steps={steps}"),
        (f"trainer.max_time={{seconds:{spent / 2}}}", f"({spent:.0f} s trained)"),  # half what its timer counted
    ):
        limits = (*finished[1:], "trainer.max_epochs=5", limit)  # the last setting of a key wins
        with pytest.raises(NothingToTrainError) as refusal:
            train(compose_train(run, data_dir, *limits, "module.optimizer.lr=0.05", "ckpt_path=last"))
        message = one_line(refusal)
        assert f"is at step {steps} after 1 epochs" in message and said in message
        assert "nothing to train, so nothing is written" in message
        assert ("trainer.max_time" in message) == ("max_time" in limit)  # the time budget only where it was reached
        after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts}
        assert after == before
    train(compose_train(run, data_dir, *finished, "trainer.max_epochs=2", "ckpt_path=last"))  # more epochs: trains
    assert last_state(run)["global_step"] == 2 * steps and (run / "drafter" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_truncated_cache_shard_stops_the_run_in_one_line(tmp_path, data_dir):  # noqa: F811
    run = tmp_path / "run"
    cached = ("drafter=eagle3", *QUICK, "trainer.max_steps=1", f"drafter.module.target_cache_dir={tmp_path}/cache")
    train(compose_train(run, data_dir, *cached))
    (shard,) = sorted((tmp_path / "cache").glob("shard-*.safetensors"))[:1]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(TargetCacheCorruptError) as refusal:
        train(compose_train(tmp_path / "again", data_dir, *cached))
    assert f"target cache shard {shard} cannot be read" in one_line(refusal)
    shard.unlink()  # as the message says: its rows are computed again
    train(compose_train(tmp_path / "again", data_dir, *cached))
    assert shard.is_file()


@pytest.mark.slow
def test_a_fresh_run_is_refused_where_a_run_is_and_changes_nothing(tmp_path, data_dir):  # noqa: F811
    """Without ckpt_path, a run directory holding a run's checkpoint is refused before anything is written (it was
    overwritten: a forgotten ckpt_path=last after a kill lost the run); so is a ckpt_path that is no checkpoint."""
    run = tmp_path / "run"
    train(compose_train(run, data_dir, *QUICK, "trainer.max_steps=2", "callbacks.progress_bar=null"))  # null: left out
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts}
    with pytest.raises(FileExistsError) as refusal:
        train(compose_train(run, data_dir, *QUICK, "trainer.max_steps=3"))
    assert f"{run} already holds a run (checkpoints/last.ckpt): resume it with ckpt_path=last" in one_line(refusal)
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts}
    assert after == before
    for not_one in (run / "config.yaml", tmp_path / "cut.ckpt"):
        if not not_one.exists():
            not_one.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes()[:1000])  # a checkpoint cut short
        with pytest.raises(ValueError, match=f"ckpt_path={not_one} is not a readable training checkpoint") as bad:
            train(compose_train(tmp_path / "other", data_dir, *QUICK, f"ckpt_path={not_one}"))
        one_line(bad)


@pytest.mark.slow
def test_a_run_resumed_from_an_epochs_end_trains_every_epoch_to_the_same_weights(tmp_path, data_dir):  # noqa: F811
    """With last.ckpt written every step, the epoch's last step is saved at the epoch's end: a run stopped there and
    resumed trains the epochs left, to the weights of a run never stopped (saved at its batch's end, Lightning resumed
    it an epoch ahead and the run trained one epoch less; and each epoch's order was drawn from torch's global
    generator, which a resumed run does not restore)."""
    every_step = ("callbacks.last_checkpoint.every_n_train_steps=1", "+trainer.limit_val_batches=1",
                  "export_drafter=false", "trainer.max_epochs=3")  # fmt: skip
    whole = tmp_path / "whole"
    train(compose_train(whole, data_dir, *every_step))
    steps = last_state(whole)["global_step"]
    per_epoch = steps // 3
    cut = tmp_path / "cut"
    train(compose_train(cut, data_dir, *every_step, *stop_at(per_epoch)))  # the same schedule, stopped
    assert last_state(cut)["global_step"] == per_epoch
    train(compose_train(cut, data_dir, *every_step, "ckpt_path=last"))
    resumed, reference = last_state(cut), last_state(whole)
    assert resumed["global_step"] == steps and resumed["epoch"] == reference["epoch"]
    for key, value in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("cut", [("trainer.max_epochs=1", "trainer.max_steps=1000"), ("trainer.max_steps=1",)])
def test_a_run_with_max_steps_resumed_trains_what_the_run_never_stopped_trains(tmp_path, data_dir, cut):  # noqa: F811
    """With `trainer.max_steps` set, a run stopped at an epoch's end, or by max_steps inside an epoch, and resumed with
    limits raised trains the steps the uninterrupted run trains, to its weights. (Lightning took the epoch-end
    checkpoint for a restart inside that epoch, counted it twice and trained none of the next; a run cut by max_steps
    was saved at its epoch's end, as if that epoch were done.)"""
    common = ("+trainer.limit_val_batches=1", "export_drafter=false", "module.scheduler=null")
    limits = ("trainer.max_epochs=2", "trainer.max_steps=1000")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(compose_train(whole, data_dir, *common, *limits))
    train(compose_train(stopped, data_dir, *common, *cut))
    assert 0 < last_state(stopped)["global_step"] < last_state(whole)["global_step"]
    train(compose_train(stopped, data_dir, *common, *limits, "ckpt_path=last"))
    resumed, reference = last_state(stopped), last_state(whole)
    assert resumed["global_step"] == reference["global_step"] and resumed["epoch"] == reference["epoch"]
    for key, value in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
