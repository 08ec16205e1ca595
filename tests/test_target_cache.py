"""The EAGLE-3 target cache: the top-k loss against the full one, refusal of a cache made for other settings or other
rows, a killed build resumed to the same content, training read from the cache, and the best checkpoint exported."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from medusa_like.formats import load_drafter
from medusa_like.training.target_cache import FIELDS, MANIFEST, TargetCache, TargetCacheMismatchError, cache_key
from medusa_like.training.ttt import loss_function, simulated_tau, topk_soft_cross_entropy
from train.train import train

from .test_training import build_module, compose_train, data_dir  # noqa: F401  (data_dir: the module's fixture)


def full_soft_cross_entropy(logits, teacher_logp):
    return -(teacher_logp.exp() * F.log_softmax(logits, -1)).sum(-1).mean()


def test_topk_loss_equals_the_full_loss_where_k_covers_the_mass():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    # a teacher whose whole mass lies on 5 tokens per row (the rest 0)
    support = torch.randn(6, 50).topk(5, -1).indices
    teacher = torch.full((6, 50), float("-inf")).scatter(-1, support, torch.randn(6, 5)).log_softmax(-1)
    top = teacher.topk(8, -1)
    full = full_soft_cross_entropy(logits, torch.where(teacher.isinf(), -1e30, teacher))
    torch.testing.assert_close(topk_soft_cross_entropy(logits, top.indices, top.values), full)
    # k = the whole vocabulary equals the full loss for any teacher
    teacher = torch.randn(6, 50).log_softmax(-1)
    top = teacher.topk(50, -1)
    torch.testing.assert_close(
        topk_soft_cross_entropy(logits, top.indices, top.values), full_soft_cross_entropy(logits, teacher)
    )
    # and a teacher cut to too few tokens gives another loss: the equality above is not vacuous
    top = teacher.topk(3, -1)
    assert not torch.isclose(
        topk_soft_cross_entropy(logits, top.indices, top.values), full_soft_cross_entropy(logits, teacher)
    )


def test_acceptance_losses_equal_their_full_distribution_forms_and_mix_by_weight():
    """TV = 1/2 sum |p - q| and LK-style -log sum min(p, q) over the whole vocabulary, from top-k labels that hold the
    teacher's mass; a weighted mix is the weighted sum; a drafter that equals the teacher has TV 0; bad names and
    weights are refused naming the choices."""
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    teacher = torch.randn(6, 50).log_softmax(-1)
    top = teacher.topk(50, -1)
    p, q = teacher.exp(), logits.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(loss_function("tv")(logits, top.indices, top.values), tv.mean())
    torch.testing.assert_close(loss_function("lk")(logits, top.indices, top.values), (-(1 - tv).log()).mean())
    mix = loss_function("0.1*soft_ce + 0.9*tv")(logits, top.indices, top.values)
    torch.testing.assert_close(mix, 0.1 * full_soft_cross_entropy(logits, teacher) + 0.9 * tv.mean())
    assert loss_function("tv")(teacher, top.indices, top.values).abs() < 1e-6
    # a teacher kept as its top 8 of 50: TV counts the drafter's mass outside those 8 as disagreement
    cut = teacher.topk(8, -1)
    p8 = torch.zeros(6, 50).scatter(-1, cut.indices, cut.values.softmax(-1))
    torch.testing.assert_close(
        loss_function("tv")(logits, cut.indices, cut.values), (0.5 * (p8 - q).abs().sum(-1)).mean()
    )
    with pytest.raises(ValueError, match="unknown drafter loss 'kl'.*soft_ce"):
        loss_function("kl")
    with pytest.raises(ValueError, match="weight 'x'"):
        loss_function("x*tv")
    with pytest.raises(ValueError, match="weight '0' of 'tv' must be positive"):
        loss_function("1*soft_ce+0*tv")


def test_simulated_tau_of_a_chain():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def rows_of(datamodule, n=None):
    rows = [dict(r) for split in (datamodule.train_set, datamodule.val_set) for r in split]
    return rows[:n] if n else rows


def fake_outputs(batch):
    """Deterministic FIELDS from a batch: what `Eagle3Module._cacheable_outputs` returns, without a target."""
    ids = batch["input_ids"]  # [B, T]
    return {
        "aux": ids[..., None].expand(-1, -1, 6).to(torch.bfloat16),
        "topk_ids": (ids[..., None] + torch.arange(4)).to(torch.int16),
        "topk_logp": -ids[..., None].expand(-1, -1, 4).to(torch.float16) / 100,
        "labelled": batch["loss_mask"].bool(),
    }


KEY = cache_key("fp", torch.arange(10), [0, 1, 2], 4, 64)


@pytest.mark.slow
def test_a_cache_for_other_settings_or_rows_is_refused(tmp_path, data_dir):  # noqa: F811
    _, datamodule = build_module(data_dir, tmp_path)
    rows = rows_of(datamodule, 6)
    TargetCache(tmp_path / "cache", KEY).build(rows, fake_outputs, batch_tokens=64, shard_tokens=100)
    others = {
        "target_fingerprint": cache_key("other", torch.arange(10), [0, 1, 2], 4, 64),
        "draft_vocab": cache_key("fp", torch.arange(1, 11), [0, 1, 2], 4, 64),
        "aux_layer_ids": cache_key("fp", torch.arange(10), [0, 1, 3], 4, 64),
        "top_k": cache_key("fp", torch.arange(10), [0, 1, 2], 8, 64),
        "max_length": cache_key("fp", torch.arange(10), [0, 1, 2], 4, 128),
        # KEY's cache holds labels at the assistant's tokens only: refused for a run that trains on every token
        "train_on": cache_key("fp", torch.arange(10), [0, 1, 2], 4, 64, train_on="all"),
    }
    for field, key in others.items():
        with pytest.raises(TargetCacheMismatchError, match=field):
            TargetCache(tmp_path / "cache", key)
    cache = TargetCache(tmp_path / "cache", KEY)
    row = rows[0]
    ids = torch.tensor([row["input_ids"][:64]])
    cache.get([row["index"]], ids, torch.tensor([ids.shape[1]]))  # the same row is served
    ids[0, -1] += 1  # another dataset's row under the same index
    with pytest.raises(TargetCacheMismatchError, match="other token ids"):
        cache.get([row["index"]], ids, torch.tensor([ids.shape[1]]))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text("{not json")
    with pytest.raises(TargetCacheMismatchError, match="not a target cache manifest"):
        TargetCache(tmp_path / "bad", KEY)


@pytest.mark.slow
def test_a_killed_build_resumes_to_the_same_content(tmp_path, data_dir):  # noqa: F811
    _, datamodule = build_module(data_dir, tmp_path)
    rows = rows_of(datamodule)
    whole = TargetCache(tmp_path / "whole", KEY)
    assert whole.build(rows, fake_outputs, batch_tokens=64, shard_tokens=150) == len(rows)

    calls = {"n": 0}

    def killed(batch):
        calls["n"] += 1
        if calls["n"] > 4:
            raise KeyboardInterrupt  # a kill in the middle of the build
        return fake_outputs(batch)

    with pytest.raises(KeyboardInterrupt):
        TargetCache(tmp_path / "cut", KEY).build(rows, killed, batch_tokens=64, shard_tokens=150)
    assert not [p for p in (tmp_path / "cut").iterdir() if ".tmp-" in p.name]  # no half-written file
    kept = TargetCache(tmp_path / "cut", KEY)
    survived = len(kept.rows)
    assert 0 < survived < len(rows)  # finished shards survive the kill
    assert kept.build(rows, fake_outputs, batch_tokens=64, shard_tokens=150) == len(rows) - survived
    assert TargetCache(tmp_path / "cut", KEY).build(rows, fake_outputs) == 0  # nothing left to compute
    again = TargetCache(tmp_path / "cut", KEY)
    for row in rows:
        ids = torch.tensor([row["input_ids"][:64]])
        lengths = torch.tensor([ids.shape[1]])
        a, b = whole.get([row["index"]], ids, lengths), again.get([row["index"]], ids, lengths)
        for name in FIELDS:
            assert torch.equal(a[name], b[name])
    manifest = json.loads((tmp_path / "cut" / MANIFEST).read_text())
    shards = {shard for shard, _, _ in manifest["rows"].values()}
    assert all(set(load_file(str(tmp_path / "cut" / s))) for s in shards)


@pytest.mark.slow
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_training_from_the_cache_matches_the_target_and_runs_no_target_forward(tmp_path, data_dir, train_on):  # noqa: F811
    """Training and validation batches read from the cache equal those computed by the target: with labels at every
    token in training, the cache holds them all and validation still reads the assistant's only."""
    cache_dir = tmp_path / "cache"
    common = ("drafter=eagle3", "drafter.module.top_k=null", f"drafter.module.train_on={train_on}")
    module, datamodule = build_module(data_dir, tmp_path, *common)
    cached, _ = build_module(data_dir, tmp_path, *common, f"drafter.module.target_cache_dir={cache_dir}")
    cached.prepare_target_cache(datamodule)
    assert (cache_dir / MANIFEST).is_file()
    cached.target.base_model.forward = None  # a target forward would now fail: the cache must serve every row
    batch = next(iter(datamodule.train_dataloader()))
    rows = {}
    for training in (True, False):
        expected, got = module._forward(batch, training), cached._forward(batch, training)
        torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=2e-2)  # features kept in bf16
        assert [int(a[2]) for a in got[2]] == [int(a[2]) for a in expected[2]]  # the same labelled rows
        rows[training] = int(got[2][0][2])
    assert (rows[True] > rows[False]) == (train_on == "all")  # the prompts' tokens add labels in training only
    aux, k = batch_aux_width(cached), cached.top_k
    expected = aux * 2 + k * (2 + 2) + 1  # bf16 features, int16 ids and fp16 log-probabilities, a bool
    assert expected <= cached.target_cache.bytes_per_token() < 1.1 * expected  # plus the shards' headers


def batch_aux_width(module) -> int:
    return len(module.drafter.config.aux_layer_ids) * module.drafter.config.target_hidden_size


@pytest.mark.slow
def test_train_with_the_cache_exports_the_best_checkpoint(tmp_path, data_dir):  # noqa: F811
    cfg = compose_train(
        tmp_path,
        data_dir,
        "drafter=eagle3",
        "export_drafter=true",
        f"drafter.module.target_cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=3",
        "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=2",
    )
    metrics = train(cfg)
    assert metrics["best/val/sim_tau_chain"] >= metrics["val/sim_tau_chain"]
    best = sorted((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == 1
    state = torch.load(best[0], weights_only=False)["state_dict"]
    from hydra.utils import instantiate

    target, _ = instantiate(cfg.model.loader)
    exported = load_drafter(tmp_path / "drafter", target).state_dict()
    for name, tensor in state.items():
        torch.testing.assert_close(exported[name.removeprefix("drafter.")], tensor)


@pytest.mark.slow
def test_token_milestones_make_a_learning_curve(tmp_path, data_dir, monkeypatch):  # noqa: F811
    """A run with TokenMilestones saves a checkpoint per milestone (and stops after the last); eval.learning_curve
    measures each on the run's validation rows (as many batches as the run validated on) and by decoding, and writes
    the table, curve.json and the plot."""
    import sys

    from eval import learning_curve

    cfg = compose_train(
        tmp_path,
        data_dir,
        "drafter=eagle3",
        f"drafter.module.target_cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=50",
        "+callbacks.token_milestones._target_=medusa_like.training.checkpoints.TokenMilestones",
        f"+callbacks.token_milestones.dirpath={tmp_path / 'checkpoints'}",
        "+callbacks.token_milestones.milestones=[20,40,80]",
        "+trainer.limit_val_batches=1",
        "data.module.batch_size=2",  # two validation batches or more, of which the run validates on the first
    )
    metrics = train(cfg)
    saved = json.loads((tmp_path / "checkpoints" / "milestones.json").read_text())
    assert [s["milestone"] for s in saved] == [20, 40, 80]
    assert all(s["tokens"] >= s["milestone"] for s in saved)
    assert saved[-1]["step"] < 50 * 3  # stopped at the last milestone, long before 50 epochs
    monkeypatch.setattr(sys, "argv", ["learning_curve", str(tmp_path), "--prompts", "2", "--max-new-tokens", "8"])
    learning_curve.main()
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert [p["milestone"] for p in curve["points"]] == [20, 40, 80]
    # a point is what the run's own validation reports for the same weights, on the same rows: the run's last
    # checkpoint against its last validation
    from hydra.utils import instantiate

    target, _ = instantiate(cfg.model.loader)
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    last = learning_curve.held_out(cfg, target, datamodule, tmp_path / "checkpoints" / "last.ckpt")
    run_val = {k: v for k, v in metrics.items() if k.startswith("val/")}
    assert "val/loss" in run_val and "val/sim_tau_chain" in run_val
    assert {k: last[k] for k in run_val} == pytest.approx(run_val, rel=1e-5)
    for point in curve["points"]:
        assert 1.0 <= point["val/sim_tau_chain"] <= 1 + cfg.drafter.module.ttt_steps
        assert point["tau_alone"] >= 1.0
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_the_ablation_table_compares_each_arm_with_the_base(tmp_path, monkeypatch, capsys):
    """`eval.ablations` reads each finished arm's metrics and overrides and reports its change against the base arm;
    an arm with fewer unrolled steps shows no deeper depths, an unfinished arm is left out, and a folder without the
    base arm is one error line."""
    from eval import ablations

    def arm(name, top1, overrides):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        metrics = {f"val/acc_top1_depth{d}": a for d, a in enumerate(top1, 1)}
        metrics["val/sim_tau_chain"] = simulated_tau(top1)
        (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
        lines = "".join(f"- {o}\n" for o in ["experiment=smollm2_eagle3_ablation", "hydra.run.dir=x", *overrides])
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(lines)

    arm("base", [0.2, 0.1, 0.1, 0.1], [])
    arm("tv", [0.25, 0.1, 0.1, 0.1], ["drafter.module.loss=tv"])
    arm("ttt2", [0.3, 0.2], ["drafter.module.ttt_steps=2"])  # two unrolled steps: no depths 3 and 4
    (tmp_path / "running").mkdir()  # no metrics.json yet
    monkeypatch.setattr("sys.argv", ["ablations", str(tmp_path)])
    ablations.main()
    table = json.loads((tmp_path / "ablations.json").read_text())
    tv = next(a for a in table["arms"] if a["name"] == "tv")
    assert [a["name"] for a in table["arms"]] == ["base", "ttt2", "tv"]
    assert table["arms"][1]["top1"] == [0.3, 0.2, None, None]
    assert tv["overrides"] == ["drafter.module.loss=tv"]
    assert tv["delta_top1_d1"] == pytest.approx(0.05)
    assert tv["delta_sim_tau"] == pytest.approx(
        simulated_tau([0.25, 0.1, 0.1, 0.1]) - simulated_tau([0.2, 0.1, 0.1, 0.1])
    )
    printed = capsys.readouterr().out
    assert "+0.050 d1" in printed
    ttt2_row = next(line for line in printed.splitlines() if "ttt2" in line)
    assert "0.300" in ttt2_row and ttt2_row.count(" - ") >= 2  # depths 3 and 4 shown as dashes
    monkeypatch.setattr("sys.argv", ["ablations", str(tmp_path), "--base", "nothing"])
    with pytest.raises(SystemExit, match="no finished base arm"):
        ablations.main()
