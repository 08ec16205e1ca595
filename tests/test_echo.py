"""Data echoing: the batch sampler serves every row `echo` times, reshuffled within its window, and resumes to the
same batches; the target memo returns exactly what it was given for the same token ids only; EAGLE-3 and Medusa
modules trained on echoed data read the target once per row, and EAGLE-3's memo gives the target's own features and
labels."""

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from torch.utils.data import SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from medusa_like.data.datamodule import PadCollator
from medusa_like.data.echo import EchoBatchSampler
from medusa_like.training.target_memo import TargetMemo
from train.train import train

from .test_training import build_module, compose_train, data_dir  # noqa: F401  (data_dir: the module's fixture)


def served(sampler: EchoBatchSampler) -> list[list[int]]:
    return list(sampler)


@pytest.mark.parametrize("rows, batch_size, window, echo", [(37, 4, 3, 2), (24, 4, 2, 3), (5, 2, 8, 2)])
def test_every_row_is_served_echo_times_within_its_window_reshuffled(rows, batch_size, window, echo):
    sampler = EchoBatchSampler(SequentialSampler(range(rows)), batch_size, echo=echo, window=window, seed=3)
    batches = served(sampler)
    assert len(batches) == len(sampler)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == sorted(list(range(rows)) * echo)
    assert all(1 <= len(batch) <= batch_size for batch in batches)
    size, reshuffled = window * batch_size, False
    for start in range(0, rows, size):  # each window's rows come back only inside that window
        first_pass = -(-min(size, rows - start) // batch_size)
        group = batches[: first_pass * echo]
        rows_of = {i for batch in group[:first_pass] for i in batch}
        assert all(set(batch) <= rows_of for batch in group)
        reshuffled |= any(sorted(again) != sorted(once) for again, once in zip(group[first_pass:], group, strict=False))
        batches = batches[first_pass * echo :]
    assert reshuffled  # the repeats are regrouped, not the same batches again
    # echo=1 is the plain batching of the sampler's order
    plain = EchoBatchSampler(SequentialSampler(range(rows)), batch_size, echo=1, window=window, shuffle=False)
    assert served(plain) == [list(range(s, min(s + batch_size, rows))) for s in range(0, rows, batch_size)]


def loader(shuffle: bool, seed=None) -> StatefulDataLoader:
    rows = list(range(30))
    sampler = EchoBatchSampler(SequentialSampler(rows), batch_size=3, echo=2, window=2, shuffle=shuffle, seed=seed)
    return StatefulDataLoader(rows, batch_sampler=sampler, collate_fn=lambda r: r)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("taken", [0, 1, 3, 4, 5, 19, 20])  # a window is 4 batches here: its start, middle and end
@pytest.mark.parametrize("epoch", [0, 2])
def test_a_resumed_loader_serves_the_same_remaining_batches(shuffle, taken, epoch):
    torch.manual_seed(0)
    first = loader(shuffle)
    first.batch_sampler.set_epoch(epoch)
    whole = list(first)
    if shuffle:
        assert sorted(i for batch in whole[:4] for i in batch) != [i for i in range(6) for _ in range(2)]
    first.batch_sampler.set_epoch(epoch)  # the same epoch again, cut short
    it = iter(first)
    assert [next(it) for _ in range(taken)] == whole[:taken]
    state = first.state_dict()
    torch.manual_seed(1)  # another process: its own seed and epoch until the state restores them
    resumed = loader(shuffle)
    resumed.load_state_dict(state)
    assert list(resumed) == whole[taken:]


def test_the_memo_returns_what_it_was_given_for_the_same_token_ids_only():
    torch.manual_seed(0)
    memo = TargetMemo(max_rows=3)
    ids = torch.randint(1, 50, (2, 6))
    lengths = torch.tensor([6, 4])
    out = {"aux": torch.randn(2, 6, 5), "labelled": torch.rand(2, 6) > 0.5}
    memo.put([10, 11], ids, lengths, out)
    # the same rows in another order and padded wider come back as they were, zero past each row's length
    wider = torch.zeros(2, 8, dtype=torch.long)
    wider[0, :4], wider[1, :6] = ids[1, :4], ids[0]
    got = memo.get([11, 10], wider, torch.tensor([4, 6]))
    assert torch.equal(got["aux"][0, :4], out["aux"][1, :4]) and torch.equal(got["aux"][1, :6], out["aux"][0])
    assert got["aux"][0, 4:].abs().sum() == 0 and got["aux"].shape == (2, 8, 5)
    assert torch.equal(got["labelled"][1, :6], out["labelled"][0])
    # a row held for other token ids, or a row not held, is not served
    other = ids.clone()
    other[0, 2] += 1
    assert memo.get([10, 11], other, lengths) is None
    assert memo.get([10, 12], ids, lengths) is None
    # bounded: the oldest rows leave first
    memo.put([12, 13], ids, lengths, out)
    assert len(memo) == 3 and memo.get([10], ids[:1], lengths[:1]) is None
    assert memo.get([11, 12], ids.flip(0), lengths.flip(0)) is not None
    with pytest.raises(ValueError, match="at least one row"):
        TargetMemo(0)


def test_features_and_labels_from_the_memo_equal_the_targets_own(tmp_path, data_dir):  # noqa: F811
    module, datamodule = build_module(data_dir, tmp_path, "drafter=eagle3", "drafter.module.top_k=8")
    module.memo = TargetMemo(max_rows=8)
    rows = [datamodule.train_set[i] for i in range(4)]
    collate = PadCollator(datamodule.max_length)
    module.train()
    first = collate(rows)
    module._target_outputs(first, module._wanted(first, True))  # computed, kept
    calls = []
    module.target.base_model.register_forward_pre_hook(lambda *_: calls.append(1))
    regrouped = collate([rows[2], rows[0]])  # the same rows regrouped and padded to another width
    wanted = module._wanted(regrouped, True)
    from_memo = module._target_outputs(regrouped, wanted)
    assert not calls  # no target forward
    computed = module._compute_target_outputs(regrouped, wanted)
    assert calls and from_memo.keys() == computed.keys()
    real = regrouped["attention_mask"].bool()  # [B, T]: what the target computes on padding is never read
    assert (~real).any()
    for name in computed:
        torch.testing.assert_close(from_memo[name][real], computed[name][real])
    module.eval()  # validation never reads the memo
    module._target_outputs(regrouped, wanted)
    assert len(calls) == 2


class CountTrainingReads(Callback):
    """Records each forward of the frozen target: True in a training step, False in validation or the sanity check."""

    reads: list[bool] = []

    def on_fit_start(self, trainer, pl_module):
        pl_module.target.base_model.register_forward_pre_hook(lambda *_: self.reads.append(trainer.training))


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["eagle3", "medusa"])
def test_training_with_echo_reads_the_target_once_per_row_and_steps_on_every_batch(
    tmp_path,
    data_dir,  # noqa: F811
    drafter,
):
    echo = ("data.module.echo=2", "data.module.echo_window=2", "data.module.batch_size=2")
    cfg = compose_train(
        tmp_path, data_dir, f"drafter={drafter}", "trainer.max_epochs=1", "export_drafter=false", *echo,
        f"+callbacks.count._target_={__name__}.CountTrainingReads",
    )  # fmt: skip
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    batches = len(datamodule.train_dataloader())
    CountTrainingReads.reads.clear()
    train(cfg)
    assert batches >= 4 and sum(CountTrainingReads.reads) == batches // 2
    assert not all(CountTrainingReads.reads)  # validation read the target too, and was not counted
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == batches
